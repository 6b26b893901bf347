from collections.abc import Sequence

from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.attention.kinds import LayerKind, LayerKindsBackend
from flashtree.attention.sdpa import SdpaBackend
from flashtree.kv.cache import KVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKind", "SdpaBackend", "make_backend"]


def make_backend(cache: KVCache, layer_kinds: Sequence[LayerKind] | None = None
                 ) -> AttentionBackend:
    """The Triton paged-attention kernels on CUDA, MLA's key-only latent caches included
    (nothing planned on the host: CUDA graphs capture them), with FlashInfer's MLA decode where
    it is installed and applies (planned before each replay); the SDPA reference on CPU.
    `layer_kinds`: each layer's (causal, sliding window) where they are the model's own, not
    the batch's (a DFlash drafter's): one such backend per kind (`LayerKindsBackend`)."""
    if layer_kinds is not None:
        return LayerKindsBackend(cache, layer_kinds, make_backend)
    if cache.k.device.type == "cuda":
        from flashtree.attention.flashinfer_mla import latent_decode_for
        from flashtree.attention.triton import TritonBackend  # triton ships with CUDA torch

        return TritonBackend(cache, latent_decode=latent_decode_for(cache))
    return SdpaBackend(cache)
