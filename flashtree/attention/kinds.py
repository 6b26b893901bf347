"""Layers of several mask kinds over one cache (a DFlash drafter's: bidirectional full layers
beside causal sliding-window ones) behind one backend, so that a runner drives them as it
drives a target: one metadata per forward, specialised here to each kind."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.kv.cache import KVCache

# A layer's mask: (causal inside the new tokens, sliding window or None for full attention).
LayerKind = tuple[bool, int | None]


class LayerKindsBackend(AttentionBackend):
    """One backend per distinct (causal, sliding window) kind, each begun with the forward's
    metadata carrying that kind's flags; layer i attends through the backend of its kind."""

    def __init__(self, cache: KVCache, layer_kinds: Sequence[LayerKind],
                 make: Callable[[KVCache], AttentionBackend]) -> None:
        super().__init__(cache)
        assert layer_kinds, "a model with no layers"
        self.by_kind = {kind: make(cache) for kind in sorted(set(layer_kinds), key=str)}
        self.layers = [self.by_kind[kind] for kind in layer_kinds]
        # Those with host planning before a replay (none over a drafter's cache): a replay
        # costs the others nothing.
        self._planning = {k: b for k, b in self.by_kind.items() if b.plans_before_replay}

    def begin_forward(self, meta: AttentionMetadata) -> None:
        for (causal, window), backend in self.by_kind.items():
            backend.begin_forward(replace(meta, causal=causal, sliding_window=window))

    def before_replay(self, batch: int, tokens: int, meta: AttentionMetadata) -> None:
        for (causal, window), backend in self._planning.items():
            backend.before_replay(batch, tokens,
                                  replace(meta, causal=causal, sliding_window=window))

    @property
    def plans_before_replay(self) -> bool:
        return bool(self._planning)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.layers[0].slot_mapping  # every kind's: the forward's slots

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:
        return self.layers[layer].forward(layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].attend(layer, q)

    def attend_latent(self, layer: int, q: torch.Tensor, v_dim: int, scale: float
                      ) -> torch.Tensor:
        return self.layers[layer].attend_latent(layer, q, v_dim, scale)
