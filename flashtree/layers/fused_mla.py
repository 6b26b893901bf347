"""MLA's work between its projections and its attention in one Triton launch: the latent's
RMSNorm, RoPE of the shared key and of every head's query (after DeepSeek's de-interleave where
the checkpoint interleaves), the cache write of [latent | key] and the absorbed query
[q_latent | roped q_pe] assembled for the attention kernel. Eagerly that is about twenty small
torch ops per layer (slices copied, casts, two concatenations, a roll, the cache's scatter),
which at decode cost more than the layer's attention. Rounds where the eager ops round, so
results match `MLAttention`'s eager path up to float32 summation order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.pdl import pdl_args, wait_for_previous


@triton.jit
def _rope_half_pair(row, lo, ok, half, cos_row, sin_row, INTERLEAVED: tl.constexpr):
    """RoPE of a 2 * half row as its two halves in float32, from the checkpoint's layout
    (pairs (x0, x1), (x2, x3), ... when INTERLEAVED, which rotate-half reads de-interleaved)."""
    if INTERLEAVED:
        x1 = tl.load(row + 2 * lo, mask=ok, other=0.0)
        x2 = tl.load(row + 2 * lo + 1, mask=ok, other=0.0)
    else:
        x1 = tl.load(row + lo, mask=ok, other=0.0)
        x2 = tl.load(row + half + lo, mask=ok, other=0.0)
    c1 = tl.load(cos_row + lo, mask=ok, other=0.0)
    c2 = tl.load(cos_row + half + lo, mask=ok, other=0.0)
    s1 = tl.load(sin_row + lo, mask=ok, other=0.0)
    s2 = tl.load(sin_row + half + lo, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return a * c1 - b * s1, b * c2 + a * s2


@triton.jit
def _mla_prologue_kernel(
    q_lat_ptr, q_pe_ptr, kv_a_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, cache_ptr, slots_ptr,
    stride_lt, stride_lh, stride_pt, stride_ph, stride_kt, stride_ct, stride_ot, stride_oh,
    stride_cs, heads, latent, half, eps,
    INTERLEAVED: tl.constexpr, BLOCK_LATENT: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # Programs (token, h): h < heads assembles head h's query; h == heads writes the token's
    # cache row.
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK_LATENT)
    c_ok = c < latent
    lo = tl.arange(0, BLOCK_HALF)
    lo_ok = lo < half
    cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
    if h < heads:
        dst = q_out_ptr + t * stride_ot + h * stride_oh
        q = tl.load(q_lat_ptr + t * stride_lt + h * stride_lh + c, mask=c_ok, other=0.0)
        tl.store(dst + c, q, mask=c_ok)
        r1, r2 = _rope_half_pair(q_pe_ptr + t * stride_pt + h * stride_ph, lo, lo_ok, half,
                                 cos_row, sin_row, INTERLEAVED)
    else:
        dst = cache_ptr + tl.load(slots_ptr + t) * stride_cs
        row = kv_a_ptr + t * stride_kt
        x = tl.load(row + c, mask=c_ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / latent + eps)
        w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(dst + c, ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype), mask=c_ok)
        r1, r2 = _rope_half_pair(row + latent, lo, lo_ok, half, cos_row, sin_row, INTERLEAVED)
    out_ty = dst.dtype.element_ty
    tl.store(dst + latent + lo, r1.to(out_ty), mask=lo_ok)
    tl.store(dst + latent + half + lo, r2.to(out_ty), mask=lo_ok)


def mla_prologue(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 cache: torch.Tensor, slots: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """q_latent [n, heads, latent] (W_UK^T q_nope), q_pe [n, heads, rope], kv_a [n, latent +
    rope] (the latent before its norm, then the shared key), all with a contiguous last dim;
    cos, sin [n, 1, rope] float32 (rotate-half). Writes [norm(latent) | rope(key)] to rows
    `slots` of `cache` [cache slots, 1, latent + rope] and returns the query [n, heads,
    latent + rope] = [q_latent | rope(q_pe)]."""
    n, heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    assert rope % 2 == 0 and kv_a.shape == (n, latent + rope) and q_pe.shape[:2] == (n, heads), (
        f"q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}, kv_a {tuple(kv_a.shape)}")
    assert q_latent.stride(-1) == q_pe.stride(-1) == kv_a.stride(-1) == cache.stride(-1) == 1, (
        "the rows must be contiguous")
    assert cos.shape == sin.shape == (n, 1, rope) and cos.stride() == sin.stride(), (
        f"cos/sin {tuple(cos.shape)}, expected {(n, 1, rope)}")
    assert cache.shape[1:] == (1, latent + rope) and slots.shape == (n,), (
        f"cache {tuple(cache.shape)}, slots {tuple(slots.shape)}")
    out = q_latent.new_empty(n, heads, latent + rope)
    if n:
        _mla_prologue_kernel[(n, heads + 1)](
            q_latent, q_pe, kv_a, cos, sin, norm_weight, out, cache, slots,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_a.stride(0), cos.stride(0), out.stride(0), out.stride(1), cache.stride(0),
            heads, latent, rope // 2, eps, INTERLEAVED=interleaved,
            BLOCK_LATENT=triton.next_power_of_2(latent),
            BLOCK_HALF=triton.next_power_of_2(rope // 2), num_warps=4, **pdl_args(out.device))
    return out
