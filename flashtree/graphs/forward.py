"""The fixed-shape forwards a GraphRunner captures, and the bridge from an eager ForwardBatch to
the schema's inputs. Both forwards read only the static buffers, build their attention metadata
in the padded layout (no host read of device data) and need a backend that plans nothing on the
host inside the forward (TritonBackend; its FlashInfer decode plans in `before_replay`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.graphs.schema import GraphKey, GraphMode, Inputs
from flashtree.models.dflash import DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.runner.forward_batch import ForwardBatch, Mode


def graph_mode(batch: ForwardBatch) -> GraphMode:
    """The graph mode that runs `batch`."""
    if batch.mode == Mode.VERIFY:
        tree = batch.attn.new_token_mask is not None
        return GraphMode.VERIFY_TREE if tree else GraphMode.VERIFY_CHAIN
    return {Mode.DECODE: GraphMode.DECODE, Mode.DRAFT: GraphMode.DRAFT,
            Mode.PREFILL: GraphMode.PREFILL}[batch.mode]


def graph_inputs(batch: ForwardBatch) -> Inputs:
    """Every schema field from an eager batch (new_token_mask is None for chains)."""
    a = batch.attn
    return {
        "input_ids": batch.input_ids, "positions": batch.positions,
        "query_start": a.query_start, "kv_lens": a.kv_lens, "slot_mapping": a.slot_mapping,
        "page_tables": a.page_tables, "new_token_mask": a.new_token_mask,
        "logit_rows": batch.logit_rows,
    }


def static_metadata(key: GraphKey, static: dict[str, torch.Tensor], page_size: int,
                    causal: bool = True, sliding_window: int | None = None
                    ) -> AttentionMetadata:
    """Attention metadata over the static buffers of `key` (views, never copies)."""
    page_tables = static["page_tables"]  # [batch, max_pages]
    return AttentionMetadata(
        query_start=static["query_start"], kv_lens=static["kv_lens"],
        slot_mapping=static["slot_mapping"], page_tables=page_tables,
        max_query_len=key.tokens, max_kv_len=page_tables.shape[1] * page_size,
        new_token_mask=static.get("new_token_mask"), causal=causal,
        sliding_window=sliding_window, padded=True,
    )


# Writes context rows' K/V to a drafter's cache: (features [n, F], positions [n], slots [n]).
ContextWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


class TargetForward:
    """DECODE, VERIFY_CHAIN, VERIFY_TREE and PREFILL: the target over the paged cache ->
    (float32 logits of the scored rows [num_scored, vocab], captured layer outputs
    [batch * tokens, len(capture_layers) * hidden] or None).

    With a `context_writer`, DECODE and PREFILL write their tokens' captured outputs to the
    drafter's cache themselves, at the batch's positions and slots (padding rows: the scratch
    slot), and return None for them: a plain step keeps the drafter's context at no host cost,
    where returning the features costs a copy, rows held until the next draft and that draft's
    catch-up over all of them (a few percent of a launch-bound plain step's time). The write
    runs on a stream of its own from the last captured layer on, joined before the forward
    ends: in the graph it is a branch beside the target's last layers and LM head, whose
    small kernels leave the device room for it. Verify steps return their features: only the
    accepted nodes' become context."""

    def __init__(self, model: DecoderModel, backend: AttentionBackend,
                 capture_layers: tuple[int, ...] = (), gather_logits: bool = True,
                 context_writer: ContextWriter | None = None) -> None:
        self.model, self.backend = model, backend
        self.capture_layers, self.gather_logits = capture_layers, gather_logits
        assert context_writer is None or capture_layers, "context needs captured layers"
        self.context_writer = context_writer
        self._write_stream: torch.cuda.Stream | None = None  # made on the first write

    @torch.inference_mode()
    def __call__(self, key: GraphKey, static: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert key.mode != GraphMode.DRAFT, f"{key}: the target does not draft"
        self.backend.begin_forward(static_metadata(key, static, self.backend.cache.page_size))
        writes = (self.context_writer is not None
                  and key.mode in (GraphMode.DECODE, GraphMode.PREFILL))

        def write(captured: list[torch.Tensor]) -> None:
            self._fork_write(captured, static["positions"], static["slot_mapping"])

        hidden, captured = self.model(static["input_ids"], static["positions"], self.backend,
                                      self.capture_layers, write if writes else None)
        logits = self.model.compute_logits(hidden[static["logit_rows"]], self.gather_logits)
        if writes:
            assert self._write_stream is not None
            # Joined while `captured` is still referenced: the write stream's reads of it are
            # done before its memory can go to anything the main stream allocates next.
            torch.cuda.current_stream().wait_stream(self._write_stream)
            return logits, None
        return logits, torch.cat(captured, dim=-1) if captured else None

    def _fork_write(self, captured: list[torch.Tensor], positions: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """The context write of the captured outputs [n, hidden] each, on the write stream
        once the main stream has produced them."""
        assert self.context_writer is not None
        if self._write_stream is None:
            self._write_stream = torch.cuda.Stream(captured[0].device)
        self._write_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._write_stream):
            self.context_writer(torch.cat(captured, dim=-1), positions, slots)


class DraftForward:
    """DRAFT: the DFlash block through the drafter -> float32 logits of the scored rows
    [batch * tokens, vocab]. `backends` maps each (causal, sliding window) kind of draft layer
    to a backend over the draft cache, as DFlashProposer's do."""

    def __init__(self, draft: DFlashDraftModel, target: DecoderModel,
                 backends: dict[tuple[bool, int | None], AttentionBackend],
                 gather_logits: bool = True) -> None:
        cfg = draft.cfg
        self.draft, self.target, self.backends = draft, target, backends
        self.layer_backends = [backends[kind] for kind in zip(cfg.layer_causal,
                                                              cfg.layer_windows)]
        self.gather_logits = gather_logits

    @torch.inference_mode()
    def __call__(self, key: GraphKey, static: dict[str, torch.Tensor]) -> torch.Tensor:
        assert key.mode == GraphMode.DRAFT, f"{key}: the drafter only drafts"
        for (causal, window), backend in self.backends.items():
            backend.begin_forward(static_metadata(key, static, backend.cache.page_size,
                                                  causal, window))
        embeds = self.target.embed_tokens(static["input_ids"])  # [batch * tokens, hidden]
        hidden = self.draft(embeds, static["positions"], self.layer_backends)
        return self.draft.logits(hidden[static["logit_rows"]], self.target.lm_head,
                                 self.gather_logits)
