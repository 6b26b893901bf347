"""The fixed-shape forward a GraphRunner captures, for the target and the drafter alike, and
the bridge from an eager ForwardBatch to the schema's inputs. The forward reads only the static
buffers, builds its attention metadata in the padded layout (no host read of device data) and
needs a backend that plans nothing on the host inside the forward (TritonBackend; its
FlashInfer decode plans in `before_replay`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from flashtree.attention.backend import AttentionBackend
from flashtree.graphs.schema import GraphKey, GraphMode, Inputs, static_metadata
from flashtree.runner.forward_batch import ForwardBatch, Mode

_GRAPH_MODES = {Mode.DECODE: GraphMode.DECODE, Mode.DRAFT: GraphMode.DRAFT,
                Mode.PREFILL: GraphMode.PREFILL}


def graph_mode(batch: ForwardBatch) -> GraphMode:
    """The graph mode that runs `batch`."""
    if batch.mode == Mode.VERIFY:
        tree = batch.attn.new_token_mask is not None
        return GraphMode.VERIFY_TREE if tree else GraphMode.VERIFY_CHAIN
    return _GRAPH_MODES[batch.mode]


def graph_inputs(batch: ForwardBatch) -> Inputs:
    """Every schema field from an eager batch (new_token_mask is None for chains)."""
    a = batch.attn
    return {
        "input_ids": batch.input_ids, "positions": batch.positions,
        "query_start": a.query_start, "kv_lens": a.kv_lens, "slot_mapping": a.slot_mapping,
        "page_tables": a.page_tables, "new_token_mask": a.new_token_mask,
        "logit_rows": batch.logit_rows,
    }


class RunnerModel(Protocol):
    """What a ModelRunner drives (`DecoderModel`, `DFlashDrafter`): token ids and positions
    [n] through the layers over `backend` -> (final-normed hidden [n, hidden], the outputs of
    `capture_layers`, handed to `on_captured` as soon as the last of them has run), then
    float32 logits of hidden rows (this TP rank's vocab slice unless `gather`)."""

    lm_head: torch.nn.Module

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 backend: AttentionBackend, capture_layers: tuple[int, ...] = (),
                 on_captured: Callable[[list[torch.Tensor]], None] | None = None,
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor: ...


# Writes context rows' K/V to a drafter's cache: (features [n, F], positions [n], slots [n]).
ContextWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


class GraphForward:
    """Any mode: the model over the paged cache -> (float32 logits of the scored rows over the
    whole vocabulary [num_scored, vocab], captured layer outputs [batch * tokens,
    len(capture_layers) * hidden] or None).

    With a `context_writer` (the target of a drafter engine), DECODE and PREFILL write their
    tokens' captured outputs to the drafter's cache themselves, at the batch's positions and
    slots (padding rows: the scratch slot), and return None for them: a plain step keeps the
    drafter's context at no host cost, where returning the features costs a copy, rows held
    until the next draft and that draft's catch-up over all of them (a few percent of a
    launch-bound plain step's time). The write runs on a stream of its own from the last
    captured layer on, joined before the forward ends: in the graph it is a branch beside the
    target's last layers and LM head, whose small kernels leave the device room for it. Verify
    steps return their features: only the accepted nodes' become context."""

    def __init__(self, model: RunnerModel, backend: AttentionBackend,
                 capture_layers: tuple[int, ...] = (),
                 context_writer: ContextWriter | None = None) -> None:
        self.model, self.backend, self.capture_layers = model, backend, capture_layers
        assert context_writer is None or capture_layers, "context needs captured layers"
        self.context_writer = context_writer
        self._write_stream: torch.cuda.Stream | None = None  # made on the first write

    @torch.inference_mode()
    def __call__(self, key: GraphKey, static: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.backend.begin_forward(static_metadata(key, static, self.backend.cache.page_size))
        writes = (self.context_writer is not None
                  and key.mode in (GraphMode.DECODE, GraphMode.PREFILL))

        def write(captured: list[torch.Tensor]) -> None:
            self._fork_write(captured, static["positions"], static["slot_mapping"])

        hidden, captured = self.model(static["input_ids"], static["positions"], self.backend,
                                      self.capture_layers, write if writes else None)
        logits = self.model.compute_logits(hidden[static["logit_rows"]])
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
