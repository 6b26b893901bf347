"""The attention backend interface. A forward pass carries one AttentionMetadata for all its
layers; the backend writes each layer's new K/V into the paged cache and attends over it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from flashtree.kv.cache import KVCache


@dataclass(frozen=True)
class HostLayout:
    """A batch's KV lengths and page tables as host lists, for a backend that plans on the host
    (FlashInfer's); the device tensors of AttentionMetadata are never read back for it."""

    kv_lens: list[int]
    page_tables: list[list[int]]


@dataclass
class AttentionMetadata:
    """Layout of the new tokens of one forward pass, packed sequence after sequence.

    Sequence i owns query rows [query_start[i], query_start[i + 1]); its KV after this forward
    spans logical indices [0, kv_lens[i]), of which the last query_lens[i] are the new tokens.
    """

    query_start: torch.Tensor  # [num_seqs + 1] int64, cumulative query lengths
    kv_lens: torch.Tensor  # [num_seqs] int64, context + new tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token's K/V
    page_tables: torch.Tensor  # [num_seqs, max_pages] int64, padded with 0
    max_query_len: int
    max_kv_len: int
    # Optional visibility among the new tokens: [num_seqs, max_query_len, max_query_len] bool,
    # entry [i, a, b] says whether new token a of sequence i sees new token b. Context tokens
    # are always visible. None means causal (or all-visible when `causal` is False). Tree
    # verification passes the ancestor mask here; under `causal` a mask must be
    # lower-triangular (parents before children): kernels skip keys after a tile's last row.
    new_token_mask: torch.Tensor | None = None
    causal: bool = True
    # Keys more than `sliding_window - 1` positions before a query are hidden (and after it,
    # when not causal). Positions are logical indices: valid for chains, not for trees.
    sliding_window: int | None = None
    # A captured graph's static layout: rows past query_start[-1] are padding (their K/V go to a
    # scratch slot, their outputs are unspecified) and nothing here reads device data. Only
    # backends that plan nothing on the host inside the forward (TritonBackend) accept it.
    padded: bool = False
    # The same lengths and page tables on the host, where the batch was built there (the page
    # tables' own lists: read them within the step).
    host_layout: HostLayout | None = None

    def __post_init__(self) -> None:
        n = self.kv_lens.shape[0]
        assert self.query_start.shape == (n + 1,), (
            f"query_start {tuple(self.query_start.shape)} vs {n} sequences"
        )
        # Checked off the GPU only: reading a device tensor would wait for the device.
        assert (self.padded or self.query_start.is_cuda
                or self.slot_mapping.shape[0] == int(self.query_start[-1])), (
            f"slot_mapping has {self.slot_mapping.shape[0]} rows for {int(self.query_start[-1])} "
            "new tokens"
        )
        if self.new_token_mask is not None:
            q = self.max_query_len
            assert self.new_token_mask.shape == (n, q, q), (
                f"new_token_mask {tuple(self.new_token_mask.shape)}, expected {(n, q, q)}"
            )

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start[1:] - self.query_start[:-1]


class AttentionBackend(ABC):
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    @abstractmethod
    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Precompute whatever all layers of this forward share (gather indices, masks)."""

    @property
    @abstractmethod
    def slot_mapping(self) -> torch.Tensor:
        """[num_tokens] flat cache slots of the current forward's new tokens."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [num_tokens, heads, hd]; k, v: [num_tokens, kv_heads, hd] -> [num_tokens, heads, hd].
        Writes k, v into the cache at the slots of the current forward first."""
        self.cache.write(layer, self.slot_mapping, k, v)
        return self.attend(layer, q)

    def before_replay(self, batch: int, tokens: int, meta: AttentionMetadata) -> None:
        """Runs before a graph captured at `batch` requests of `tokens` rows replays the
        forward of `meta` (copied into the graph's buffers): where a backend plans on the host,
        it plans here."""
        return None  # the kernels here read everything from the device

    @property
    def plans_before_replay(self) -> bool:
        """Whether `before_replay` does anything (callers holding several backends skip the
        others)."""
        return False

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """`forward` once the new tokens' K/V are in the cache (written there by the caller, at
        `slot_mapping`): q [num_tokens, heads, hd] -> [num_tokens, heads, hd]."""

    def forward_latent(
        self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int, scale: float
    ) -> torch.Tensor:
        """MLA over a key-only latent cache. q: [num_tokens, heads, d]; latent: [num_tokens, 1, d]
        (one head shared by all query heads); values are the first `v_dim` columns of the keys
        -> [num_tokens, heads, v_dim]. Writes `latent` into the cache first."""
        self.cache.write(layer, self.slot_mapping, latent, None)
        return self.attend_latent(layer, q, v_dim, scale)

    def attend_latent(self, layer: int, q: torch.Tensor, v_dim: int, scale: float
                      ) -> torch.Tensor:
        """`forward_latent` once the new tokens' latents are in the cache (written there by the
        caller, at `slot_mapping`)."""
        raise NotImplementedError(f"{type(self).__name__} has no MLA latent attention")
