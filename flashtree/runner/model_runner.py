"""Runs a model, the target or the drafter, on a ForwardBatch over its paged KV cache, replaying
a captured CUDA graph when one holds the batch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from flashtree.attention import LayerKind, make_backend
from flashtree.graphs.runner import GraphRunner
from flashtree.graphs.schema import GraphDims, GraphMode
from flashtree.kv.cache import KVCache, PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.runner.graph_forward import (
    ContextWriter,
    GraphForward,
    RunnerModel,
    graph_inputs,
    graph_mode,
)


class ModelRunner:
    def __init__(
        self,
        model: RunnerModel,
        cache: KVCache,
        pages: PageTables,
        capture_layers: tuple[int, ...] = (),
        layer_kinds: Sequence[LayerKind] | None = None,
    ) -> None:
        """`layer_kinds`: each layer's (causal, sliding window), for a model whose layers
        set their own masks (the drafter's); one backend per kind, each given the batch's
        metadata with its kind's flags. None: every layer attends as the batch says."""
        self.model = model
        self.cache = cache
        self.pages = pages
        self.backend = make_backend(cache, layer_kinds)
        self.device = cache.k.device
        # Decoder layers whose outputs every forward returns (DFlash context features).
        self.capture_layers = capture_layers
        self.graphs: GraphRunner | None = None
        # The last forward's batch: its positions and slot mapping on the device serve the
        # drafter's context injection of the same tokens (the caches share page tables).
        self.last_batch: ForwardBatch | None = None

    def capture_graphs(self, dims: GraphDims, buckets: list[int],
                       shapes: Iterable[tuple[GraphMode, int, int]],
                       context_writer: ContextWriter | None = None) -> None:
        """Capture the forward for every (mode, tokens per request, max rows) in `shapes` at
        every batch bucket of at most that many token rows. Needs a backend that plans on the
        host only in `before_replay`, and a cache slot no request owns (dims.scratch_slot).
        `context_writer`: replayed decode steps and prompt chunks write the drafter's context
        themselves and return no features (`GraphForward`); eager ones still return them."""
        forward = GraphForward(self.model, self.backend, self.capture_layers,
                               context_writer=context_writer)
        self.graphs = GraphRunner(forward, dims, self.device, buckets)
        for mode, tokens, max_rows in shapes:
            self.graphs.capture(mode, tokens, max_rows)

    @torch.inference_mode()
    def forward(
        self, mode: Mode, items: list[BatchItem], gather_logits: bool = True,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run` on the batch of `items`. `device_inputs`: token ids and positions
        [num_tokens] already on the device, read in place of the items' (which then give only
        the counts): candidates built on the device need not visit the host."""
        batch = ForwardBatch.build(mode, items, self.pages, self.device)
        if device_inputs is not None:
            batch.input_ids, batch.positions = device_inputs
        return self.run(batch, gather_logits)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, gather_logits: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write KV for every token of `batch`; return float32 logits of its scored rows
        [num_scored, vocab] (this TP rank's vocab slice unless `gather_logits`) and, when
        capture layers are set, the concatenated outputs of those layers for every token
        [num_tokens, len(capture_layers) * hidden] (None from a decode or prompt graph that
        wrote them to the drafter's cache itself: `capture_graphs`)."""
        self.last_batch = batch
        replayed = self._replay(batch)
        if replayed is not None:
            logits, features = replayed
            return (logits if gather_logits else self.model.lm_head.vocab_slice(logits)), features
        self.backend.begin_forward(batch.attn)
        hidden, captured = self.model(
            batch.input_ids, batch.positions, self.backend, self.capture_layers
        )
        features = torch.cat(captured, dim=-1) if captured else None
        return self.model.compute_logits(hidden[batch.logit_rows], gather_logits), features

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The captured graph's outputs for `batch` (copies: the static outputs are overwritten
        by the next replay), or None when no graph holds it. Graphs gather the whole vocab
        (`run` slices a TP rank's part where the caller asked for it)."""
        if self.graphs is None:
            return None
        if batch.mode == Mode.PREFILL and batch.logit_rows.shape[0] > batch.attn.num_seqs:
            return None  # prompt graphs score one row per request (prompt log-probs: every row)
        mode = graph_mode(batch)
        key = self.graphs.bucket(mode, batch.attn.num_seqs, batch.attn.max_query_len)
        if key is None:
            return None
        self.backend.before_replay(key.batch, key.tokens, batch.attn)
        logits, features = self.graphs.replay(key, batch.attn.num_seqs, graph_inputs(batch))
        logits = logits[: batch.logit_rows.shape[0]].clone()
        if features is not None:
            features = features[: batch.input_ids.shape[0]].clone()
        return logits, features
