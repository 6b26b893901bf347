"""Fused Triton kernels for the elementwise work between a decoder layer's matrix multiplies,
one launch where eager PyTorch takes four to a dozen: RMSNorm (optionally adding the residual
first), SiLU-and-multiply, and a per-head RMSNorm followed by rotate-half RoPE.

A decode step is a few hundred small kernels besides its GEMMs; on a GPU each costs a launch
and a gap in the graph, so their count, not their bytes, sets the step time past the floor.
Every kernel rounds where the eager code rounds (to the activation dtype after the residual
add, after the norm, after SiLU), so results match the eager modules up to float32 reduction
order. Used for CUDA tensors only (`layers/norm.py`, `layers/rotary.py`, `models/llama.py`
choose); set TRITON_INTERPRET=1 before importing triton to run them on CPU tensors in tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.pdl import pdl_args, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh, stride_st,
    num_heads, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (token, head) row of `dim` elements.
    wait_for_previous(PDL)
    t = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + t * stride_st + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, (normed * w).to(x.dtype), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x: [n, dim] or [n, heads, dim] (any strides but a
    contiguous last dim). With `residual` ([n, dim]): s = x + residual, rounded to x's dtype,
    is normalised instead. -> (normalised, [n, heads?, dim] contiguous; s or None)."""
    dim = x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (dim,), (
        f"rms_norm needs [n, dim] or [n, heads, dim] with a contiguous last dim and a [{dim}] "
        f"weight: x {tuple(x.shape)} "
        f"strides {x.stride()}, weight {tuple(weight.shape)}")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x  # [n, heads, dim]
    n, heads = x3.shape[0], x3.shape[1]
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1, (
            f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        total = torch.empty_like(x)
    if n:
        res, acc = (residual, total) if residual is not None else (x, x)  # unread without
        _rms_norm_kernel[(n * heads,)](
            x3, res, weight, out, acc,
            x3.stride(0), x3.stride(1), res.stride(0), out.stride(0), out.stride(1),
            acc.stride(0), heads, dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim),
            **pdl_args(x.device),
        )
    return out.view(x.shape), total


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2 * inter] (gate first) -> silu(gate) * up: [n, inter]."""
    n, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1, (
        f"silu_mul needs [n, 2 * inter] with a contiguous last dim, got {tuple(gate_up.shape)}")
    inter = width // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
            **pdl_args(gate_up.device))
    return out


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slots_ptr, v_ptr, v_out_ptr,
    stride_xt, stride_xl, stride_xh, stride_wl, stride_ct, stride_ol, stride_ot, stride_oh,
    stride_vt, stride_vl, stride_vh, stride_vol, stride_vot, stride_voh,
    layers, num_heads, half, v_dim, eps,
    HAS_NORM: tl.constexpr, TO_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
):
    # One program per (token, layer, head); cos/sin rows hold `half` frequencies twice
    # (rotate-half). Layer l reads its x and v rows, its norm weight and writes its output at
    # offsets l * stride_*l. TO_SLOTS: the result goes to row slots[t] of out (a KV cache), and
    # v's row beside it.
    t = tl.program_id(0) // (layers * num_heads)
    lh = tl.program_id(0) % (layers * num_heads)
    layer = lh // num_heads
    h = lh % num_heads
    lo = tl.arange(0, BLOCK)
    ok = lo < half
    row = x_ptr + t * stride_xt + layer * stride_xl + h * stride_xh
    x1 = tl.load(row + lo, mask=ok, other=0.0)
    x2 = tl.load(row + half + lo, mask=ok, other=0.0)
    if HAS_NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * half) + eps)
        w = w_ptr + layer * stride_wl
        w1 = tl.load(w + lo, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w + half + lo, mask=ok, other=0.0).to(tl.float32)
        x1 = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((b * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    trig = t * stride_ct + lo
    c1 = tl.load(cos_ptr + trig, mask=ok, other=0.0)
    c2 = tl.load(cos_ptr + trig + half, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + trig, mask=ok, other=0.0)
    s2 = tl.load(sin_ptr + trig + half, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    o = t
    if TO_SLOTS:
        o = tl.load(slots_ptr + t)
        vd = tl.arange(0, V_BLOCK)
        v_ok = vd < v_dim
        v = tl.load(v_ptr + t * stride_vt + layer * stride_vl + h * stride_vh + vd, mask=v_ok,
                    other=0.0)
        tl.store(v_out_ptr + layer * stride_vol + o * stride_vot + h * stride_voh + vd, v,
                 mask=v_ok)
    out = out_ptr + layer * stride_ol + o * stride_ot + h * stride_oh
    tl.store(out + lo, (a * c1 - b * s1).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + half + lo, (b * c2 + a * s2).to(out_ptr.dtype.element_ty), mask=ok)


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    weight: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:
    """Rotate-half RoPE of x: [n, heads, head_dim] (a contiguous last dim, any other strides),
    after a per-head RMSNorm with `weight` ([head_dim]) when given; cos, sin: [n, 1, head_dim]
    float32. -> [n, heads, head_dim] contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_rope(x.unsqueeze(1), cos, sin, None if weight is None else weight.unsqueeze(0), eps,
               out.unsqueeze(0), None, None, None)
    return out


def norm_rope_to_cache(
    k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    weight: torch.Tensor | None = None, eps: float = 0.0,
) -> None:
    """`norm_rope` of k written to rows `slots` of k_cache, and v copied to the same rows of
    v_cache, in one kernel. k: [n, kv_heads, head_dim], v: [n, kv_heads, v_dim]; caches:
    [cache slots, kv_heads, dim]; slots: [n] int64."""
    norm_rope_to_layer_caches(k.unsqueeze(1), v.unsqueeze(1), cos, sin, k_cache.unsqueeze(0),
                              v_cache.unsqueeze(0), slots,
                              None if weight is None else weight.unsqueeze(0), eps)


def norm_rope_to_layer_caches(
    k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_caches: torch.Tensor, v_caches: torch.Tensor, slots: torch.Tensor,
    weights: torch.Tensor | None = None, eps: float = 0.0,
) -> None:
    """`norm_rope_to_cache` for several layers at once, in one kernel: layer l's keys (normed
    with weights[l]) and values go to rows `slots` of k_caches[l] and v_caches[l].
    k: [n, layers, kv_heads, head_dim], v: [n, layers, kv_heads, v_dim] (any strides but the
    last); caches: [layers, cache slots, kv_heads, dim]; weights: [layers, head_dim]."""
    assert slots.shape == (k.shape[0],) and v.shape[:3] == k.shape[:3], (
        f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}")
    assert k_caches.shape[0] == k.shape[1] and k_caches.shape[2:] == k.shape[2:] and (
        v_caches.shape[0] == v.shape[1] and v_caches.shape[2:] == v.shape[2:]) and (
        k_caches.stride(-1) == v_caches.stride(-1) == v.stride(-1) == 1), (
        f"caches {tuple(k_caches.shape)} {tuple(v_caches.shape)} for k {tuple(k.shape)}, "
        f"v {tuple(v.shape)}")
    _norm_rope(k, cos, sin, weights, eps, k_caches, slots, v, v_caches)


def _norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: torch.Tensor | None,
    eps: float, out: torch.Tensor, slots: torch.Tensor | None, v: torch.Tensor | None,
    v_out: torch.Tensor | None,
) -> None:
    # x, v: [n, layers, heads, dim]; weights: [layers, head_dim]; out, v_out: [layers, rows,
    # heads, dim] (rows: n without slots, else cache slots).
    n, layers, heads, head_dim = x.shape
    half = head_dim // 2
    assert head_dim % 2 == 0 and x.stride(-1) == 1, (
        f"norm_rope needs an even head_dim and a contiguous last dim, got {tuple(x.shape)} "
        f"strides {x.stride()}")
    assert cos.shape == sin.shape == (n, 1, head_dim) and cos.stride() == sin.stride() and (
        cos.stride(-1) == 1), f"cos/sin {tuple(cos.shape)} {tuple(sin.shape)}, expected " \
        f"{(n, 1, head_dim)} with a contiguous last dim"
    assert weights is None or (weights.shape == (layers, head_dim) and weights.stride(-1) == 1)
    if not n:
        return
    to_slots = slots is not None and v is not None and v_out is not None
    v, v_out = (v, v_out) if to_slots else (x, out)  # unread without slots
    _norm_rope_kernel[(n * layers * heads,)](
        x, x if weights is None else weights, cos, sin, out, slots if to_slots else x, v, v_out,
        x.stride(0), x.stride(1), x.stride(2), 0 if weights is None else weights.stride(0),
        cos.stride(0), out.stride(0), out.stride(1), out.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
        layers, heads, half, v.shape[-1], eps, HAS_NORM=weights is not None, TO_SLOTS=to_slots,
        BLOCK=triton.next_power_of_2(half), V_BLOCK=triton.next_power_of_2(v.shape[-1]),
    )
