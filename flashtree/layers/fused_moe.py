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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashtree.layers.moe_align import BLOCK_M, align_by_expert
from flashtree.layers.stacked_experts import StackedExperts


@triton.jit
def _dot_tile(acc, a_rows, a_ok, w, s, rows, rows_ok, k0, k_total, stride_wn, stride_sn,
              BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
              PRECISION: tl.constexpr):
    # acc + a[:, k0:k0+BLOCK_K] . W[rows, k0:k0+BLOCK_K]^T, a's rows at pointers `a_rows`, W a
    # [rows, k] weight: dense; FP8 (BO > 0) times one scale per BO x BI block; or INT4
    # (GROUP > 0) packed eight to an int32 along k, lowest bits first, value + 8, times one
    # scale per GROUP columns. INT4 words are loaded once as a [BLOCK_K / 8, rows] tile and
    # each nibble position j is its own dot against the columns k = 8 * word + j.
    dtype = a_rows.dtype.element_ty
    if GROUP > 0:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        kw_ok = kw < k_total // 8
        w_ok = kw_ok[:, None] & rows_ok[None, :]
        words = tl.load(w + rows[None, :] * stride_wn + kw[:, None], mask=w_ok, other=0)
        scale = tl.load(s + rows[None, :] * stride_sn + (kw[:, None] * 8) // GROUP, mask=w_ok,
                        other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            a = tl.load(a_rows[:, None] + (kw * 8 + j)[None, :],
                        mask=a_ok[:, None] & kw_ok[None, :], other=0.0)
            values = ((words >> (4 * j)) & 0xF) - 8
            acc += tl.dot(a, (values.to(tl.float32) * scale).to(dtype),
                          input_precision=PRECISION)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_total
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_ok = k_ok[:, None] & rows_ok[None, :]
        tile = tl.load(w + rows[None, :] * stride_wn + k[:, None], mask=w_ok, other=0.0)
        if BO > 0:
            scale = tl.load(s + (rows[None, :] // BO) * stride_sn + k[:, None] // BI,
                            mask=w_ok, other=0.0)
            tile = (tile.to(tl.float32) * scale).to(dtype)
        acc += tl.dot(a, tile, input_precision=PRECISION)
    return acc


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
    a_rows = x_ptr + tl.where(rows_ok, pairs // top_k, 0) * stride_xt
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    dtype = out_ptr.dtype.element_ty
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        gate = _dot_tile(gate, a_rows, rows_ok, w, sc, cols, cols_ok, k0, hidden, stride_wn,
                         stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION)
        up = _dot_tile(up, a_rows, rows_ok, w, sc, inter + cols, cols_ok, k0, hidden,
                       stride_wn, stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION)
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
    a_rows = act_ptr + safe * stride_at
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _dot_tile(acc, a_rows, rows_ok, w, sc, cols, cols_ok, k0, inter, stride_wn,
                        stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION)
    routing = tl.load(weights_ptr + safe, mask=rows_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(dtype),
             mask=rows_ok[:, None] & cols_ok[None, :])


class Tiles(NamedTuple):
    """A launch configuration of both grouped GEMMs."""

    block_n: int = 64
    block_k: int = 128  # INT4 needs >= 128: its dots are BLOCK_K / 8 deep, tl.dot needs 16
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(experts: StackedExperts) -> Tiles:
    # The fastest of `python -m benchmarks.moe --tiles` on an H200 at 1-128 tokens
    # (benchmarks/results/archive/2026-12-04-moe-gpu.md).
    return Tiles(block_k=256) if experts.group else Tiles()


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                  ids: torch.Tensor, first_expert: int, tiles: Tiles | None = None
                  ) -> torch.Tensor:
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
    if experts.group % 8:
        raise ValueError(f"INT4 group size {experts.group} is not a multiple of 8")
    tiles = tiles or default_tiles(experts)
    block_n = tiles.block_n
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only rounds float32
    bo, bi = experts.fp8_block or (0, 0)
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=tiles.block_k, GROUP=experts.group,
                  BO=bo, BI=bi, PRECISION=precision, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)
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
