"""DFlash drafting over a paged draft KV cache that shares the target's page tables, through a
ModelRunner as the target's forwards run (the same batches, backends and graph replays).

The draft cache holds context K/V for exactly the committed tokens of each request (the same
logical indices as the target cache, so one page table serves both). A draft block writes its
own K/V as scratch past the committed length; the next context write overwrites them."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain

import torch

from flashtree.graphs.rows import RowGraphs
from flashtree.graphs.runner import batch_buckets
from flashtree.kv.cache import KVCache, OutOfPages, PageTables
from flashtree.layers import fused_kernels_apply
from flashtree.models.dflash import DFlashDrafter, DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.runner.capture import GraphPlan
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.speculative.types import DeviceCandidates
from flashtree.transfer import host_to_device, lists_to_device

_GRAPH_CONTEXT_ROWS = 2048  # context rows per injection that replay a captured graph at most
_MAX_DEFERRED_ROWS = 16384  # rows held for the next draft before injecting them anyway


@dataclass
class Ahead:
    """A next step's draft logits, queued early (`DFlashProposer.draft_ahead`), and the blocks
    they answer, set once the host knows them; the step may queue the candidates it builds from
    them too, with the budget they were built for."""

    logits: torch.Tensor
    gather: bool
    first: torch.Tensor  # [R] each block's first (bonus) position, on the device
    blocks: list[tuple[int, int, int, int]] | None = None
    candidates: tuple[int, DeviceCandidates] | None = None  # (budget, candidates)


@dataclass(frozen=True)
class ContextRows:
    """Features of committed tokens of one forward, to inject, and where they go: either
    `spans`, (seq_id, start, count) holding that request's tokens [start, start + count) in
    row order, whose slots are looked up when injected (a speculative step's accepted tokens);
    or the rows' own device `positions` and `slots` (a plain step's: the target batch's) with
    the `leases` of their requests' page allocations then (`PageTables.lease`): the slots stay
    the request's while that lease lasts; rows whose lease has ended since (the request
    finished, or was preempted) are dropped, as their slots may be another's by then and
    nothing reads them (a recompute injects its own)."""

    features: torch.Tensor  # [rows, len(target_layer_ids) * hidden]
    spans: tuple[tuple[int, int, int], ...] = ()
    positions: torch.Tensor | None = None  # [rows] int64
    slots: torch.Tensor | None = None  # [rows] int64
    # Per request, in row order, its lease and (None: one row each, a decode step's) its rows:
    # host ints only, as plain steps make them every step (a host tensor op per step costs
    # more than the step's other host work, where threads wake up for it), looked at only
    # when a lease has ended.
    leases: tuple[int, ...] | None = None
    counts: tuple[int, ...] | None = None

    def run_rows(self) -> tuple[int, ...]:
        """Rows per run (a request's rows; `spans` rows are one run)."""
        if self.leases is None:
            return (self.features.shape[0],)
        return self.counts if self.counts is not None else (1,) * len(self.leases)


class DFlashProposer:
    def __init__(
        self, draft: DFlashDraftModel, target: DecoderModel, pages: PageTables,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.draft, self.pages = draft, pages
        cfg = draft.cfg
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        attn = draft.layers[0].self_attn
        # One page more than the page tables hand out: its first slot takes the K/V of a
        # captured graph's padded tokens (the target cache has the same spare page).
        self.cache = KVCache(
            len(draft.layers), pages.num_pages + 1, pages.page_size, attn.num_kv_heads,
            attn.head_dim, dtype, device,
        )
        self.device = device
        # The drafter runs as the target does, through a ModelRunner over its own cache: one
        # backend per mask kind of its layers (full layers: bidirectional in the block;
        # sliding layers: causal and windowed).
        drafter = DFlashDrafter(draft, target.embed_tokens, target.lm_head)
        self.runner = ModelRunner(drafter, self.cache, pages, layer_kinds=drafter.layer_kinds)
        # Context rows of eager plain steps (graph-replayed ones write their own), injected
        # together before the next draft (the drafter reads nothing in between): the first
        # token of a prompt does not wait for its rows, and while the adaptive policy decodes
        # plain the drafter costs nothing per step.
        self._deferred: list[ContextRows] = []
        self._deferred_rows = 0
        self._ended_leases = pages.watch_ended_leases()  # since the last flush
        self._ahead: Ahead | None = None  # the next step's blocks, drafted early
        self._context_writer: RowGraphs | None = None
        # The layers' K/V projections as one matrix, for the fused context write (CUDA).
        self._context_projection = draft.context_projection() if device.type == "cuda" else None

    def capture_graphs(self, plan: GraphPlan) -> None:
        """Capture the draft block of `plan.draft` (shorter blocks replay padded) at every
        batch bucket of at most its most token rows, and the context writes."""
        assert plan.draft is not None, "a plan without the draft block"
        dims, max_rows = plan.dims, plan.draft[2]
        self.runner.capture_graphs(dims, plan.buckets, [plan.draft])
        graphs = self.runner.graphs
        assert graphs is not None
        # Injections of up to _GRAPH_CONTEXT_ROWS context rows (a step's accepted tokens;
        # longer prompt chunks run eagerly) replay graphs too, captured here for every row
        # bucket; padding rows write to the scratch slot.
        writer = RowGraphs(self.write_context, batch_buckets(min(max_rows, _GRAPH_CONTEXT_ROWS)),
                           self.device, graphs.use_cuda_graphs,
                           pads=(None, 0, dims.scratch_slot))
        width = self.draft.fc.weight.shape[1]  # the concatenated target-layer features
        with torch.inference_mode():
            for rows in writer.buckets:
                writer(torch.zeros(rows, width, dtype=self.cache.k.dtype, device=self.device),
                       torch.zeros(rows, dtype=torch.long, device=self.device),
                       torch.full((rows,), dims.scratch_slot, device=self.device))
        self._context_writer = writer

    @property
    def deferred_rows(self) -> int:
        """Context rows waiting for the next flush."""
        return self._deferred_rows

    def defer(self, rows: ContextRows) -> None:
        """Keep rows for the next flush (past _MAX_DEFERRED_ROWS, inject them all now)."""
        self._deferred.append(rows)
        self._deferred_rows += rows.features.shape[0]
        if self._deferred_rows > _MAX_DEFERRED_ROWS:
            self.flush()

    def flush(self) -> None:
        """Inject the deferred rows in one batch."""
        rows, self._deferred, self._deferred_rows = self._deferred, [], 0
        self.inject(rows)
        self._ended_leases.clear()  # no row noted under them is left

    @torch.inference_mode()
    def inject(self, rows: list[ContextRows]) -> None:
        """Write context K/V of committed tokens to the draft cache, all `rows` in one batch,
        but rows of requests freed since they were noted: while the policy decodes plain,
        most deferred rows can be finished requests', and their K/V would cost a drafter
        forward each (on a CPU, ~1 s for 16384 rows) for nothing."""
        if not rows:
            return
        placed = [self._placement(r) for r in rows]
        features, positions, slots = (torch.cat(t) if len(rows) > 1 else t[0] for t in
                                      ([r.features for r in rows], *zip(*placed)))
        live = self._live_rows(rows)
        if live is not None:
            if live.numel() == 0:
                return
            index = host_to_device(live, self.device)
            features, positions, slots = features[index], positions[index], slots[index]
        if self._context_writer is not None:
            self._context_writer(features, positions, slots)
        else:
            self.write_context(features, positions, slots)

    def _placement(self, rows: ContextRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Device positions and draft-cache slots ([rows] each) of `rows`."""
        if rows.positions is not None and rows.slots is not None:
            return rows.positions, rows.slots
        positions: list[int] = []
        slots: list[int] = []
        for seq_id, start, count in rows.spans:
            positions += range(start, start + count)
            slots += self.pages.slots(seq_id, start, count)
        position_t, slot_t = lists_to_device([positions, slots], self.device)
        return position_t, slot_t

    def _live_rows(self, rows: list[ContextRows]) -> torch.Tensor | None:
        """Indices (host int64, in row order) of the rows of `rows` not noted under a lease
        that has ended since, or None for all of them: nothing looked at unless one of their
        leases has ended, then one pass over the runs' leases and a row mask built from bytes
        (`spans` are looked up just now: their runs never go stale)."""
        ended = self._ended_leases
        if not ended or all(r.leases is None for r in rows):
            return None
        stale = [lease in ended for lease in chain.from_iterable(
            r.leases if r.leases is not None else (None,) for r in rows)]  # per run
        if not any(stale):
            return None
        mask = torch.frombuffer(bytearray(stale), dtype=torch.bool)
        if any(r.counts is not None or r.leases is None for r in rows):  # runs of many rows
            counts = array("q", chain.from_iterable(r.run_rows() for r in rows))
            mask = mask.repeat_interleave(torch.frombuffer(counts, dtype=torch.int64))
        return torch.nonzero(~mask).squeeze(1)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> tuple[()]:
        """features [n, F], positions [n], slots [n] -> the n rows' K/V in every draft layer
        (also captured inside the target's decode and prompt graphs:
        `ModelRunner.capture_graphs`)."""
        if fused_kernels_apply(features):
            assert self._context_projection is not None and self.cache.v is not None
            self.draft.write_context_kv(features, positions, self._context_projection,
                                        self.cache.k, self.cache.v, slots)
            return ()
        for layer, (k, v) in enumerate(self.draft.context_kv(features, positions)):
            self.cache.write(layer, slots, k, v)
        return ()

    def draft_logits(self, blocks: list[tuple[int, int, int, int]], gather: bool = True
                     ) -> torch.Tensor:
        """For each (seq_id, committed_len n, bonus token, block size b >= 2) run
        `[bonus, mask x (b-1)]` at positions n..n+b-1 through the drafter; return float32 logits
        of slots 1..b-1 of every block, packed: [sum(b - 1), vocab] (this TP rank's vocab slice
        unless `gather`). Pages for n + b tokens must be reserved."""
        drafted = self.drafted_ahead(blocks, gather)
        if drafted is not None:
            return drafted
        items = [
            BatchItem(seq_id, n, [bonus] + [self.mask_token_id] * (b - 1), all_logits=True)
            for seq_id, n, bonus, b in blocks
        ]
        return self.runner.forward(Mode.DRAFT, items, gather)[0]

    def drafted_ahead(self, blocks: list[tuple[int, int, int, int]], gather: bool
                      ) -> torch.Tensor | None:
        """The logits `draft_ahead` queued, if they answer exactly `blocks` (taken: asked
        once)."""
        ahead, self._ahead = self.peek_ahead(blocks, gather), None
        return None if ahead is None else ahead.logits

    def peek_ahead(self, blocks: list[tuple[int, int, int, int]], gather: bool
                   ) -> Ahead | None:
        """What `draft_ahead` queued, if it answers exactly `blocks` (not taken)."""
        ahead = self._ahead
        if ahead is not None and ahead.blocks == list(blocks) and ahead.gather == gather:
            return ahead
        return None

    @torch.inference_mode()
    def draft_ahead(self, seq_ids: list[int], starts: list[int], advance: torch.Tensor,
                    bonus: torch.Tensor, most: int, gather: bool = False) -> Ahead | None:
        """Queue the next step's full draft blocks before this step's result reaches the host:
        request i's block starts at starts[i] + advance[i] with token bonus[i] (device [R]
        int64, advance <= `most`). The host then finishes the step while the device drafts;
        `draft_logits` hands the logits out if it is asked for exactly these blocks (set
        `Ahead.blocks` once the step's result is read). None where the pages cannot be
        reserved."""
        b = self.block_size
        try:
            for seq_id, start in zip(seq_ids, starts):
                self.pages.reserve(seq_id, start + most + b)
        except OutOfPages:
            return None
        r = len(seq_ids)
        mask = torch.full((r, b - 1), self.mask_token_id, dtype=torch.long, device=self.device)
        batch = ForwardBatch.device_blocks(Mode.DRAFT, seq_ids, starts, advance,
                                           torch.cat([bonus[:, None], mask], 1),
                                           max(starts) + most + b, self.pages)
        logits, _ = self.runner.run(batch, gather)
        self._ahead = Ahead(logits, gather, batch.positions.view(r, b)[:, 0])
        return self._ahead
