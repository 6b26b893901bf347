"""Routed experts in two grouped GEMMs with no host sync, so a MoE step can replay a CUDA graph.

The (token, slot) pairs a router chose are grouped by expert on the device, each expert's run
padded to a multiple of BLOCK_M (`layers/moe_align.py`). One Triton program then multiplies a
BLOCK_M-row block of one expert's pairs by a BLOCK_N slice of that expert's weights: gate and
up together with SiLU-and-multiply fused, then down with the routing weight fused; the top-k
partial outputs of each token are summed last. Rounding follows the eager path
(`layers/moe.py`): the projections and SiLU round to the activation dtype where its ops do, so
results differ from it only in summation order. Used for CUDA tensors (`SparseMoE` chooses);
TRITON_INTERPRET=1 runs it on CPU tensors in tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.layers.moe_align import BLOCK_M, StackedExperts, align_by_expert


@triton.jit
def _weight_tile(w, s, rows, k, mask, stride_wn, stride_sn, GROUP: tl.constexpr,
                 BO: tl.constexpr, BI: tl.constexpr, dtype: tl.constexpr):
    # The [k, rows] tile of a [rows, k] weight: dense; INT4 (GROUP > 0) packed eight to an
    # int32 along k, lowest bits first, value + 8, times one scale per GROUP columns; or FP8
    # (BO > 0) times one scale per BO x BI block.
    # One return at the end: compiled Triton type-checks code after an early return too.
    if BO > 0:
        weight = tl.load(w + rows[None, :] * stride_wn + k[:, None], mask=mask, other=0.0)
        scale = tl.load(s + (rows[None, :] // BO) * stride_sn + k[:, None] // BI, mask=mask,
                        other=0.0)
        tile = (weight.to(tl.float32) * scale).to(dtype)
    elif GROUP == 0:
        tile = tl.load(w + rows[None, :] * stride_wn + k[:, None], mask=mask, other=0.0)
    else:
        words = tl.load(w + rows[None, :] * stride_wn + k[:, None] // 8, mask=mask, other=0)
        values = ((words >> ((k[:, None] % 8) * 4)) & 0xF) - 8
        scale = tl.load(s + rows[None, :] * stride_sn + k[:, None] // GROUP, mask=mask,
                        other=0.0)
        tile = (values.to(tl.float32) * scale.to(tl.float32)).to(dtype)
    return tile


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, experts_ptr, num_pairs, top_k,
                    hidden, inter, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                    stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                    PRECISION: tl.constexpr):
    # out[pair, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for a block of pairs.
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    tokens = tl.where(rows_ok, pairs // top_k, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    dtype = out_ptr.dtype.element_ty
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & cols_ok[None, :]
        wg = _weight_tile(w, sc, cols, k, w_ok, stride_wn, stride_sn, GROUP, BO, BI,
                          dtype)
        wu = _weight_tile(w, sc, inter + cols, k, w_ok, stride_wn, stride_sn, GROUP, BO, BI,
                          dtype)
        gate += tl.dot(a, wg, input_precision=PRECISION)
        up += tl.dot(a, wu, input_precision=PRECISION)
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], act,
             mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, weights_ptr, out_ptr, pairs_ptr, experts_ptr, num_pairs,
                 hidden, inter, stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                 PRECISION: tl.constexpr):
    # out[pair, n] = routing weight[pair] * (act[pair] . down[e, n]) for a block of pairs.
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    safe = tl.where(rows_ok, pairs, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_ok = k < inter
        a = tl.load(act_ptr + safe[:, None] * stride_at + k[None, :],
                    mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        wd = _weight_tile(w, sc, cols, k, k_ok[:, None] & cols_ok[None, :], stride_wn,
                          stride_sn, GROUP, BO, BI, dtype)
        acc += tl.dot(a, wd, input_precision=PRECISION)
    routing = tl.load(weights_ptr + safe, mask=rows_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(dtype),
             mask=rows_ok[:, None] & cols_ok[None, :])


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                  ids: torch.Tensor, first_expert: int) -> torch.Tensor:
    """x [n, hidden]; `experts` this rank's E experts (first_expert .. first_expert + E - 1);
    the router's weights (float32) and global expert ids [n, top_k]. -> sum over the top_k
    slots of weight * expert(x), [n, hidden] (zero for slots on other ranks)."""
    x = x.contiguous()  # the kernels read rows with unit column stride
    n, hidden = x.shape
    num_experts, inter = experts.gate_up.shape[0], experts.inter
    top_k = ids.shape[1]
    local = ids.flatten() - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    pairs, blocks = align_by_expert(local, num_experts)
    num_pairs = n * top_k
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only rounds float32
    bo, bi = experts.fp8_block or (0, 0)
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=experts.group,
                  BO=bo, BI=bi, PRECISION=precision)
    w13, s13 = experts.gate_up, experts.gate_up_scale
    _gate_up_kernel[(blocks.numel(), triton.cdiv(inter, block_n))](
        x, w13, w13 if s13 is None else s13, act, pairs, blocks, num_pairs, top_k, hidden,
        inter, x.stride(0), w13.stride(0), w13.stride(1), *_strides(s13), act.stride(0),
        **common)
    w2, s2 = experts.down, experts.down_scale
    _down_kernel[(blocks.numel(), triton.cdiv(hidden, block_n))](
        act, w2, w2 if s2 is None else s2, weights.flatten().contiguous(), out, pairs, blocks,
        num_pairs, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), *_strides(s2),
        out.stride(0), **common)
    return out.view(n, top_k, hidden).sum(dim=1)


def _strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))
