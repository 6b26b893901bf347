"""ForwardBatch: everything one forward pass reads, built the same way for every mode."""

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
    DRAFT = "draft"  # DFlash block [bonus, mask x (B-1)] through the drafter
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
    def build(
        mode: Mode, items: list[BatchItem], pages: PageTables, device: torch.device,
        causal: bool = True, sliding_window: int | None = None,
    ) -> ForwardBatch:
        assert items, f"{mode.value}: empty batch"
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        starts = [0]
        for it in items:
            n = len(it.tokens)
            assert n > 0, f"{mode.value}: request {it.seq_id} has no tokens"
            first = len(ids)
            ids += it.tokens
            positions += it.positions if it.positions is not None else range(
                it.start, it.start + n
            )
            slots += pages.slots(it.seq_id, it.start, n)
            scored = range(first, first + n) if it.all_logits else [first + n - 1]
            scored = scored if it.wants_logits else []
            rows += scored
            starts.append(len(ids))
        tables = [pages.table(it.seq_id) for it in items]
        width = max(len(t) for t in tables)
        kv_lens = [it.start + len(it.tokens) for it in items]

        max_q = max(len(it.tokens) for it in items)
        new_token_mask = None
        if all(it.visible is not None and len(it.tokens) == max_q for it in items):
            # Trees of one size (a fixed budget): one stack instead of a copy per request.
            new_token_mask = torch.stack([it.visible for it in items]).to(device)
            assert new_token_mask.shape == (len(items), max_q, max_q), (
                f"{mode.value}: visibility {tuple(new_token_mask.shape)} for {len(items)} "
                f"requests of {max_q} tokens"
            )
        elif any(it.visible is not None for it in items):
            # [num_seqs, max_q, max_q]
            new_token_mask = causal_mask(max_q, device).repeat(len(items), 1, 1)
            for i, it in enumerate(items):
                if it.visible is not None:
                    n = len(it.tokens)
                    assert it.visible.shape == (n, n), (
                        f"{mode.value}: request {it.seq_id} visibility "
                        f"{tuple(it.visible.shape)} for {n} tokens"
                    )
                    new_token_mask[i, :n, :n] = it.visible

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
            causal=causal,
            sliding_window=sliding_window,
            host_layout=HostLayout(kv_lens, tables),
        )
        return ForwardBatch(mode, input_ids, positions_t, attn, logit_rows)
