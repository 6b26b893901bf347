"""Rotary position embedding (rotate-half layout) with Llama-3 and YaRN frequency scaling, and
the interleaved pair layout DeepSeek's MLA uses."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from flashtree.layers import fused_kernels_apply
from flashtree.layers.config import RopeConfig
from flashtree.layers.norm import RMSNorm

if TYPE_CHECKING:
    from flashtree.attention.backend import AttentionBackend


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) low frequencies, extrapolated (kept) high ones,
    a linear ramp between the dims that rotate beta_slow and beta_fast times over the original
    context. Computed in float32 as transformers does, so the frequencies match bit for bit."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim / 2], 1 = keep (extrapolate) the original frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, inv_freq)
    return inv_freq.float()


def rope_attention_scaling(rope: RopeConfig) -> float:
    """Factor on cos/sin (transformers' `attention_scaling`): YaRN's mscale ratio, else 1."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor,
                                                                     rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax scale (squared into the attention scale): yarn mscale of
    `mscale_all_dim` when the rope is scaled and that field is set, else 1."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim)


class RotaryEmbedding:
    """Computes cos/sin once per forward for all layers. Frequencies stay float32 whatever the
    model dtype (a plain attribute, so `module.to(dtype)` never touches it)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(rope, head_dim).to(device)  # [head_dim / 2]
        self.inv_freq_twice = torch.cat((inv_freq, inv_freq))  # [head_dim] (rotate-half)
        self.scaling = rope_attention_scaling(rope)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n] -> cos, sin: [n, 1, head_dim] float32. The product promotes the
        # integer positions to float32 in the kernel: three launches, no cast or concatenation
        # of their own (a decode graph replays these every step).
        emb = (positions.unsqueeze(-1) * self.inv_freq_twice).unsqueeze(1)
        if self.scaling == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x cos + (-x2, x1) sin, taken as roll(x) times sin with its first half
    negated: the same products bit for bit, in 5 ops instead of 9 (the CPU decode step runs it
    per layer). x: [n, heads, head_dim]; cos, sin: [n, 1, head_dim]."""
    xf = x.float()
    signed_sin = sin * _half_signs(x.shape[-1], sin.device)
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * signed_sin).to(x.dtype)


@functools.cache
def _half_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """[-1] * (head_dim / 2) + [1] * (head_dim / 2), float32, made on the device (no host
    copy, so a first call inside a CUDA graph capture is legal)."""
    signs = torch.ones(head_dim, device=device)
    signs[: head_dim // 2] = -1
    return signs


def norm_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None = None
) -> torch.Tensor:
    """Rotate-half RoPE of x: [n, heads, head_dim], after the per-head RMSNorm `norm` when
    given (Qwen3's q/k norm); one kernel on CUDA."""
    if fused_kernels_apply(x):
        from flashtree.layers.fused import norm_rope

        if norm is None:
            return norm_rope(x, cos, sin)
        return norm_rope(x, cos, sin, norm.weight, norm.eps)
    return apply_rotary(x if norm is None else norm(x), cos, sin)


def write_rotary_kv(
    k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norm: RMSNorm | None, backend: AttentionBackend, layer: int,
) -> None:
    """`norm_rotary` of the keys written straight to `backend`'s cache of `layer` at the
    current forward's slots, the values copied beside them: one kernel where `norm_rotary`
    and the cache write take three (CUDA only). k: [n, kv_heads, head_dim], v: [n, kv_heads,
    v_dim]."""
    from flashtree.layers.fused import norm_rope_to_cache

    cache = backend.cache
    assert cache.v is not None, "write_rotary_kv needs a cache with values"
    norm_rope_to_cache(k, v, cos, sin, cache.k[layer], cache.v[layer], backend.slot_mapping,
                       None if norm is None else norm.weight, 0.0 if norm is None else norm.eps)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... -> rotate-half layout
    (x0, x2, ..., x1, x3, ...); rotate-half RoPE on the result is the interleaved RoPE."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
