"""ForwardBatch: everything one forward pass reads, built the same way for every mode: from
host items (`build`), or as blocks whose first positions are on the device (`device_blocks`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from flashtree.attention.backend import AttentionMetadata, HostLayout
from flashtree.kv.cache import PageTables
from flashtree.transfer import lists_to_device


class Mode(enum.Enum):
    PREFILL = "prefill"  # prompt chunks (or recompute after preemption)
    DECODE = "decode"  # one token per request
    # DFlash block [bonus, mask x (B-1)] through the drafter: the mask slots are scored, not
    # the bonus (slot 0, already known).
    DRAFT = "draft"
    VERIFY = "verify"  # a block of drafted tokens through the target


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """A chain's ancestor-or-self visibility: [n, n] bool, lower triangular."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


@dataclass(frozen=True)
class BatchItem:
    """One request's slice of a forward: `tokens` at logical indices [start, start + len)."""

    seq_id: int
    start: int
    tokens: list[int]
    all_logits: bool = False  # score every row (verify) instead of only the last
    wants_logits: bool = True
    # Tree verification: explicit positions (committed length + depth; siblings share one) and
    # visibility among the new tokens ([n, n] bool, ancestor-or-self). None: a causal chain.
    positions: list[int] | None = None
    visible: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    mode: Mode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    logit_rows: torch.Tensor  # [num_scored] int64, rows of the packed tokens to score

    @staticmethod
    def build(mode: Mode, items: list[BatchItem], pages: PageTables, device: torch.device
              ) -> ForwardBatch:
        assert items, f"{mode.value}: empty batch"
        ids, positions, slots, rows, starts = _pack(mode, items, pages)
        tables = [pages.table(it.seq_id) for it in items]
        width = max(len(t) for t in tables)
        kv_lens = [it.start + len(it.tokens) for it in items]
        max_q = max(len(it.tokens) for it in items)
        new_token_mask = _visibility(mode, items, max_q, device)
        # One host-to-device copy for every integer field.
        padded_tables = [p for t in tables for p in t + [0] * (width - len(t))]
        (query_start, kv_lens_t, slot_mapping, page_tables, input_ids, positions_t,
         logit_rows) = lists_to_device([starts, kv_lens, slots, padded_tables, ids, positions,
                                        rows], device)
        attn = AttentionMetadata(
            query_start=query_start,
            kv_lens=kv_lens_t,
            slot_mapping=slot_mapping,
            page_tables=page_tables.view(len(items), width),
            max_query_len=max_q,
            max_kv_len=max(kv_lens),
            new_token_mask=new_token_mask,
            host_layout=HostLayout(kv_lens, tables),
        )
        return ForwardBatch(mode, input_ids, positions_t, attn, logit_rows)

    @staticmethod
    def device_blocks(mode: Mode, seq_ids: list[int], starts: list[int], advance: torch.Tensor,
                      input_ids: torch.Tensor, max_kv_len: int, pages: PageTables
                      ) -> ForwardBatch:
        """Request i's block of input_ids[i] ([R, b] on the device) at positions
        starts[i] + advance[i] + (0..b-1), where `advance` [R] is a device value the host has
        not read (a step's accepted lengths): positions, slots and KV lengths are computed on
        the device, with one host-to-device copy (page tables and starts). `max_kv_len`: a
        host bound on every request's KV length after the block. Pages must be reserved."""
        r, b = input_ids.shape
        device, page = input_ids.device, pages.page_size
        tables = [pages.table(seq_id) for seq_id in seq_ids]
        width = max(len(t) for t in tables)
        page_tables, starts_t = lists_to_device(
            [[p for t in tables for p in t + [0] * (width - len(t))], starts], device)
        page_tables = page_tables.view(r, width)
        first = starts_t + advance  # [R] the blocks' first positions
        positions = first[:, None] + torch.arange(b, device=device)  # [R, b]
        slots = page_tables.gather(1, positions // page) * page + positions % page
        query_start = torch.arange(0, (r + 1) * b, b, device=device)
        rows = torch.arange(r * b, device=device)
        if mode is Mode.DRAFT:
            rows = rows.view(r, b)[:, 1:].flatten()
        attn = AttentionMetadata(query_start, first + b, slots.flatten(), page_tables,
                                 max_query_len=b, max_kv_len=max_kv_len)
        return ForwardBatch(mode, input_ids.flatten(), positions.flatten(), attn, rows)


def _pack(mode: Mode, items: list[BatchItem], pages: PageTables
          ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The items packed back to back: token ids, positions, KV slots, scored rows and each
    request's first row (then the total)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    starts = [0]
    skip = 1 if mode is Mode.DRAFT else 0  # a draft block's bonus is not scored
    for it in items:
        n = len(it.tokens)
        assert n > 0, f"{mode.value}: request {it.seq_id} has no tokens"
        first = len(ids)
        ids += it.tokens
        positions += it.positions if it.positions is not None else range(
            it.start, it.start + n
        )
        slots += pages.slots(it.seq_id, it.start, n)
        if it.wants_logits:
            rows += range(first + skip, first + n) if it.all_logits else [first + n - 1]
        starts.append(len(ids))
    return ids, positions, slots, rows, starts


def _visibility(mode: Mode, items: list[BatchItem], max_q: int, device: torch.device
                ) -> torch.Tensor | None:
    """The batch's new_token_mask [num_seqs, max_q, max_q]: None when every item is a causal
    chain, chains' rows causal where others are trees."""
    if all(it.visible is not None and len(it.tokens) == max_q for it in items):
        # Trees of one size (a fixed budget): one stack instead of a copy per request.
        mask = torch.stack([it.visible for it in items]).to(device)
        assert mask.shape == (len(items), max_q, max_q), (
            f"{mode.value}: visibility {tuple(mask.shape)} for {len(items)} requests of "
            f"{max_q} tokens"
        )
        return mask
    if not any(it.visible is not None for it in items):
        return None
    mask = causal_mask(max_q, device).repeat(len(items), 1, 1)
    for i, it in enumerate(items):
        if it.visible is not None:
            n = len(it.tokens)
            assert it.visible.shape == (n, n), (
                f"{mode.value}: request {it.seq_id} visibility {tuple(it.visible.shape)} for "
                f"{n} tokens"
            )
            mask[i, :n, :n] = it.visible
    return mask
