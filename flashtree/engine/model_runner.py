"""Runs the target model on a ForwardBatch over the paged KV cache."""

from __future__ import annotations

import torch

from flashtree.attention.sdpa import SdpaBackend
from flashtree.engine.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.llama import DecoderModel


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        pages: PageTables,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.cache = cache
        self.pages = pages
        self.backend = SdpaBackend(cache)
        self.device = cache.k.device
        # Decoder layers whose outputs every forward returns (DFlash context features).
        self.capture_layers = capture_layers

    @torch.inference_mode()
    def forward(
        self, mode: Mode, items: list[BatchItem], gather_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write KV for every item's tokens; return float32 logits of the scored rows
        [num_scored, vocab] (this TP rank's vocab slice unless `gather_logits`) and, when capture
        layers are set, the concatenated outputs of those layers for every token
        [num_tokens, len(capture_layers) * hidden]."""
        batch = ForwardBatch.build(mode, items, self.pages, self.device)
        self.backend.begin_forward(batch.attn)
        hidden, captured = self.model(
            batch.input_ids, batch.positions, self.backend, self.capture_layers
        )
        features = torch.cat(captured, dim=-1) if captured else None
        return self.model.compute_logits(hidden[batch.logit_rows], gather_logits), features
