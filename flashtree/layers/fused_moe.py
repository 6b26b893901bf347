"""Routed experts in two grouped GEMMs with no host sync, so a MoE step can replay a CUDA graph.

A program multiplies a block of BLOCK_M (token, slot) pairs of one expert by a BLOCK_N slice of
that expert's weights: gate and up together with SiLU-and-multiply fused, then down with the
routing weight fused; the top-k partial outputs of each token are summed last. At few pairs
(decode, small verifies) each pair is a block of its own, read straight from the router's ids
with no grouping launch (INT4 experts: a GEMV of its own, `layers/moe_gemv.py`); past that the
pairs are grouped by expert on the device (`layers/moe_align.py`), each expert's run padded to
BLOCK_M (INT4 tiles under bf16 unpack their weights in PTX, `layers/int4_unpack.py`). Where the
pairs touch too few experts to fill the GPU, gate/up splits its input dim over programs that
write float32 partial sums, which one small kernel adds up under SiLU.
Rounding follows the eager path (`layers/moe.py`): the projections and SiLU round to the
activation dtype where its ops do, so results differ from it only in summation order (and, in
the INT4 GEMVs, the weights' rounding). Used for CUDA tensors (`SparseMoE` chooses);
TRITON_INTERPRET=1 runs it on CPU tensors in tests."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashtree.layers import programs_to_fill
from flashtree.layers.int4_unpack import scaled_planes
from flashtree.layers.moe_align import BLOCK_M, align_by_expert
from flashtree.layers.moe_gemv import pair_gate_up_kernel, silu_mul, token_down_kernel
from flashtree.layers.stacked_experts import StackedExperts
from flashtree.pdl import pdl_args, wait_for_previous

PER_PAIR_MAX = 64  # at most this many pairs: a block per pair, no grouping launch


@triton.jit
def _dot_tile(acc, a_rows, a_ok, w, s, rows, rows_ok, k0, k_total, stride_wn, stride_sn,
              BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
              PRECISION: tl.constexpr, PACKED_UNPACK: tl.constexpr):
    # acc + a[:, k0:k0+BLOCK_K] . W[rows, k0:k0+BLOCK_K]^T, a's rows at pointers `a_rows`, W a
    # [rows, k] weight: dense; FP8 (BO > 0) times one scale per BO x BI block; or INT4
    # (GROUP > 0) packed eight to an int32 along k, lowest bits first, value + 8, times one
    # scale per GROUP columns. INT4 words are loaded once as a [BLOCK_K / 8, rows] tile and
    # each nibble position j is its own dot against the columns k = 8 * word + j; with
    # PACKED_UNPACK (bf16), unpacked and scaled by `int4_unpack.scaled_planes`.
    dtype = a_rows.dtype.element_ty
    if GROUP > 0:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        kw_ok = kw < k_total // 8
        w_ok = kw_ok[:, None] & rows_ok[None, :]
        words = tl.load(w + rows[None, :] * stride_wn + kw[:, None], mask=w_ok, other=0)
        scale = tl.load(s + rows[None, :] * stride_sn + (kw[:, None] * 8) // GROUP, mask=w_ok,
                        other=0.0)
        if PACKED_UNPACK:
            planes = scaled_planes(words, scale)
        for j in tl.static_range(8):
            a = tl.load(a_rows[:, None] + (kw * 8 + j)[None, :],
                        mask=a_ok[:, None] & kw_ok[None, :], other=0.0)
            if PACKED_UNPACK:
                tile = planes[j]
            else:
                values = ((words >> (4 * j)) & 0xF) - 8
                tile = (values.to(tl.float32) * scale.to(tl.float32)).to(dtype)
            acc += tl.dot(a, tile, input_precision=PRECISION)
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
def _block_pairs(pairs_ptr, experts_ptr, ids_ptr, first_expert, num_pairs, num_experts,
                 BLOCK_M: tl.constexpr, PER_PAIR: tl.constexpr):
    # (pair ids [BLOCK_M], which are real, this block's local expert; -1: not on this rank).
    # PER_PAIR: a block per pair, its expert read from the router's global ids.
    block = tl.program_id(0)
    if PER_PAIR:
        pairs = block + tl.arange(0, BLOCK_M)
        rows_ok = (tl.arange(0, BLOCK_M) == 0) & (block < num_pairs)
        expert = (tl.load(ids_ptr + block) - first_expert).to(tl.int32)
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, -1)
    else:
        pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        rows_ok = pairs < num_pairs
        expert = tl.load(experts_ptr + block)
    return tl.where(rows_ok, pairs, 0), rows_ok, expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, experts_ptr, ids_ptr,
                    first_expert, num_pairs, num_experts, top_k, hidden, inter, k_per_split,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_ot,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                    PER_PAIR: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                    PACKED_UNPACK: tl.constexpr):
    # out[pair, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for a block of pairs;
    # with SPLIT, this split's share of the input dim: out[split, pair, n] = x . gate[e, n]
    # and out[split, pair, inter + n] = x . up[e, n], in float32.
    pairs, rows_ok, expert = _block_pairs(pairs_ptr, experts_ptr, ids_ptr, first_expert,
                                          num_pairs, num_experts, BLOCK_M, PER_PAIR)
    if expert < 0:
        return
    a_rows = x_ptr + (pairs // top_k) * stride_xt
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, hidden), BLOCK_K):
        gate = _dot_tile(gate, a_rows, rows_ok, w, sc, cols, cols_ok, k0, hidden, stride_wn,
                         stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION, PACKED_UNPACK)
        up = _dot_tile(up, a_rows, rows_ok, w, sc, inter + cols, cols_ok, k0, hidden,
                       stride_wn, stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION, PACKED_UNPACK)
    out = out_ptr + tl.program_id(2) * stride_os + pairs[:, None] * stride_ot + cols[None, :]
    ok = rows_ok[:, None] & cols_ok[None, :]
    if SPLIT:
        tl.store(out, gate, mask=ok)
        tl.store(out + inter, up, mask=ok)
    else:
        tl.store(out, silu_mul(gate, up, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_activation_kernel(part_ptr, act_ptr, splits, inter, stride_ps, stride_pt,
                             stride_at, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # act[pair, n] = silu(sum over splits of gate) * (sum of up), for one pair's columns.
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    p = part_ptr + pair * stride_pt + cols
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        gate += tl.load(p + split * stride_ps, mask=ok, other=0.0)
        up += tl.load(p + split * stride_ps + inter, mask=ok, other=0.0)
    tl.store(act_ptr + pair * stride_at + cols, silu_mul(gate, up, act_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, weights_ptr, out_ptr, pairs_ptr, experts_ptr, ids_ptr,
                 first_expert, num_pairs, num_experts, hidden, inter, stride_at, stride_we,
                 stride_wn, stride_se, stride_sn, stride_ot, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 BO: tl.constexpr, BI: tl.constexpr, PER_PAIR: tl.constexpr,
                 PRECISION: tl.constexpr, PACKED_UNPACK: tl.constexpr):
    # out[pair, n] = routing weight[pair] * (act[pair] . down[e, n]) for a block of pairs.
    pairs, rows_ok, expert = _block_pairs(pairs_ptr, experts_ptr, ids_ptr, first_expert,
                                          num_pairs, num_experts, BLOCK_M, PER_PAIR)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    out = out_ptr + pairs[:, None] * stride_ot + cols[None, :]
    if expert < 0:
        if PER_PAIR:  # `out` is not zeroed first: a pair of another rank adds 0 here
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty),
                     mask=rows_ok[:, None] & cols_ok[None, :])
        return
    a_rows = act_ptr + pairs * stride_at
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _dot_tile(acc, a_rows, rows_ok, w, sc, cols, cols_ok, k0, inter, stride_wn,
                        stride_sn, BLOCK_K, GROUP, BO, BI, PRECISION, PACKED_UNPACK)
    routing = tl.load(weights_ptr + pairs, mask=rows_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * routing[:, None]
    tl.store(out, y.to(dtype), mask=rows_ok[:, None] & cols_ok[None, :])


class Tiles(NamedTuple):
    """A launch configuration of both grouped GEMMs."""

    block_n: int = 64
    block_k: int = 128  # INT4 needs >= 128: its dots are BLOCK_K / 8 deep, tl.dot needs 16
    num_warps: int = 4
    num_stages: int = 3


class PairTiles(NamedTuple):
    """A launch configuration of the INT4 per-pair GEMVs (`layers/moe_gemv.py`)."""

    block_n: int = 16  # gate/up columns a program streams (each twice: gate's and up's rows)
    block_k: int = 512
    down_block_n: int = 8  # a down program's tile: all top_k slots x down_block_n x block_k / 8
    down_block_k: int = 256
    num_warps: int = 4
    split_per_sm: int = 4  # gate/up programs an SM the input split aims for (4 beat 2 and 8)


def default_tiles(experts: StackedExperts) -> Tiles:
    # The fastest of `python -m benchmarks.moe --tiles` on an H200 at 1-128 tokens
    # (benchmarks/results/archive/2026-12-04-moe-gpu.md); INT4's single stage at a Kimi
    # rank's 16-64 tokens on an H100 (results/2026-12-06-moe-pair-gemv-gpu.md).
    return Tiles(block_k=256, num_stages=1) if experts.group else Tiles()


def split_k(pairs: int, local_experts: int, routed_experts: int, col_blocks: int,
            k_blocks: int, device: torch.device, per_sm: int = 2) -> int:
    """How many programs share gate/up's input dim: enough that the blocks the pairs are
    expected to occupy (pairs spread uniformly over the routed experts, this rank holding
    `local_experts` of them) make `per_sm` programs an SM."""
    busy = max(1, min(local_experts, -(-pairs * local_experts // routed_experts)))
    programs = programs_to_fill(device) * per_sm // 2  # programs_to_fill: two an SM
    return max(1, min(k_blocks, programs // (busy * col_blocks)))


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                  ids: torch.Tensor, first_expert: int, tiles: Tiles | None = None,
                  routed_experts: int | None = None, pair_tiles: PairTiles | None = None,
                  shared: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, hidden]; `experts` this rank's E experts (first_expert .. first_expert + E - 1)
    of `routed_experts` (default E); the router's weights (float32) and global expert ids
    [n, top_k]. -> sum over the top_k slots of weight * expert(x), [n, hidden] (zero for
    slots on other ranks), plus `shared` [n, hidden] (the shared experts' output) where given,
    rounded after the sum."""
    x = x.contiguous()  # the kernels read rows with unit column stride
    n, hidden = x.shape
    num_experts, inter = experts.gate_up.shape[0], experts.inter
    top_k = ids.shape[1]
    if experts.group % 8:
        raise ValueError(f"INT4 group size {experts.group} is not a multiple of 8")
    num_pairs = n * top_k
    per_pair = num_pairs <= PER_PAIR_MAX
    if per_pair and experts.group:
        return _int4_pair_gemvs(x, experts, weights, ids, first_expert,
                                routed_experts or num_experts, pair_tiles or PairTiles(), shared)
    ids = ids.flatten()
    if per_pair:  # a block per pair, which reads its expert from `ids` and writes its row
        pairs = blocks = ids  # unread
        num_blocks = num_pairs
        out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    else:
        local = ids - first_expert
        local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
        pairs, blocks = align_by_expert(local, num_experts)
        num_blocks = blocks.numel()
        out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    tiles = tiles or default_tiles(experts)
    block_n, block_k = tiles.block_n, tiles.block_k
    splits, k_per_split = _splits(num_pairs, num_experts, routed_experts, inter, hidden,
                                  block_n, block_k, x.device)
    act, part = _buffers(x, num_pairs, inter, splits)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only rounds float32
    bo, bi = experts.fp8_block or (0, 0)
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=experts.group,
                  BO=bo, BI=bi, PER_PAIR=per_pair, PRECISION=precision,
                  PACKED_UNPACK=packed_unpack_applies(x, experts),
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    w13, s13 = experts.gate_up, experts.gate_up_scale
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n), splits)](
        x, w13, w13 if s13 is None else s13, part, pairs, blocks, ids, first_expert, num_pairs,
        num_experts, top_k, hidden, inter, k_per_split, x.stride(0), w13.stride(0),
        w13.stride(1), *_strides(s13), part.stride(0), part.stride(1), SPLIT=splits > 1,
        **common)
    _split_activation(part, act, splits)
    w2, s2 = experts.down, experts.down_scale
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2, w2 if s2 is None else s2, weights.flatten().contiguous(), out, pairs, blocks,
        ids, first_expert, num_pairs, num_experts, hidden, inter, act.stride(0), w2.stride(0),
        w2.stride(1), *_strides(s2), out.stride(0), **common)
    routed = out.view(n, top_k, hidden).sum(dim=1)
    return routed if shared is None else routed + shared


def packed_unpack_applies(x: torch.Tensor, experts: StackedExperts) -> bool:
    """Whether the INT4 tiles unpack with `int4_unpack.scaled_planes`: bf16 activations and
    scales on a compiled (not interpreted) sm_80+ device."""
    return (bool(experts.group) and x.is_cuda and x.dtype == torch.bfloat16
            and experts.gate_up_scale is not None
            and experts.gate_up_scale.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def _int4_pair_gemvs(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor,
                     ids: torch.Tensor, first_expert: int, routed_experts: int,
                     tiles: PairTiles, shared: torch.Tensor | None) -> torch.Tensor:
    """`fused_experts` for INT4 experts at few pairs: a GEMV per pair for gate/up, one per
    token for down (`layers/moe_gemv.py`), which picks the pairs on this rank from the global
    ids itself."""
    n, hidden = x.shape
    num_experts, inter = experts.gate_up.shape[0], experts.inter
    num_pairs, top_k = ids.numel(), ids.shape[1]
    ids, weights = ids.contiguous(), weights.contiguous()
    splits, k_per_split = _splits(num_pairs, num_experts, routed_experts, inter, hidden,
                                  tiles.block_n, tiles.block_k, x.device, tiles.split_per_sm)
    act, part = _buffers(x, num_pairs, inter, splits)
    w13, s13, w2, s2 = experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale
    pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, tiles.block_n), splits)](
        x, w13, s13, part, ids, first_expert, num_experts, top_k, hidden, inter, k_per_split,
        x.stride(0), w13.stride(0), w13.stride(1), *_strides(s13), part.stride(0),
        part.stride(1), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=experts.group,
        SPLIT=splits > 1, num_warps=tiles.num_warps, **pdl_args(x.device))
    _split_activation(part, act, splits)
    out = torch.empty_like(x)
    # Expert parallel: most of a token's slots are other ranks', so a tile takes one slot
    # (skipped when not this rank's) and as many more rows as the slots it leaves out.
    top_k_tile = triton.next_power_of_2(top_k)
    slots = top_k_tile if num_experts == routed_experts else 1
    down_rows = tiles.down_block_n * top_k_tile // slots
    token_down_kernel[(n, triton.cdiv(hidden, down_rows))](
        act, w2, s2, weights, x if shared is None else shared, out, ids, first_expert,
        num_experts, top_k, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        *_strides(s2), 0 if shared is None else shared.stride(0), out.stride(0),
        TOP_K=top_k_tile, SLOTS=slots, BLOCK_N=down_rows,
        BLOCK_K=tiles.down_block_k, GROUP=experts.group, HAS_SHARED=shared is not None,
        EVEN_K=inter % tiles.down_block_k == 0, num_warps=tiles.num_warps,
        **pdl_args(x.device))
    return out


def _splits(pairs: int, local_experts: int, routed_experts: int | None, inter: int,
            hidden: int, block_n: int, block_k: int, device: torch.device, per_sm: int = 2
            ) -> tuple[int, int]:
    """(programs sharing gate/up's input dim, input columns each) for `split_k`'s count."""
    k_blocks = triton.cdiv(hidden, block_k)
    splits = split_k(pairs, local_experts, routed_experts or local_experts,
                     triton.cdiv(inter, block_n), k_blocks, device, per_sm)
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    return triton.cdiv(hidden, k_per_split), k_per_split


def _buffers(x: torch.Tensor, pairs: int, inter: int, splits: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations [pairs, inter], gate/up's output: float32 split partials [splits, pairs,
    2 * inter] or the activations themselves)."""
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    part = (torch.empty(splits, pairs, 2 * inter, dtype=torch.float32, device=x.device)
            if splits > 1 else act[None])
    return act, part


def _split_activation(part: torch.Tensor, act: torch.Tensor, splits: int) -> None:
    """act = silu(sum of the splits' gate) * (sum of their up), where gate/up was split."""
    if splits > 1:
        inter = act.shape[1]
        _split_activation_kernel[(act.shape[0], triton.cdiv(inter, 256))](
            part, act, splits, inter, part.stride(0), part.stride(1), act.stride(0), BLOCK=256,
            **pdl_args(act.device))


def _strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))
