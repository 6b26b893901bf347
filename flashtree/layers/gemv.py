"""y = x W^T for one row of x on CUDA: the GEMMs of a batch-1 decode step, a weight read once.

On an H200 this streams the smaller Qwen3-8B projections (q/k/v, o, down) faster than cuBLAS
does at batch 1 (docs/benchmarks.md, `python -m benchmarks.kernels --sections gemv`).
`layers.dense` chooses it; every other case (several rows, float32, CPU, autograd) stays
with `F.linear`. A float32 weight against a half-precision row (DeepSeek's router) gives
float32, as `F.linear(x.float(), weight)` does without the cast's launch. An RMSNorm right
before the product (MLA's q_a norm before q_b) can run inside it. `gemv_rows` takes
2 to ROWS_MAX bf16 rows against a float32 router (a verify's tokens), where cuBLAS runs a
float32 GEMM at a fraction of bandwidth: split along k, the weight read once, its float32
products exact through three bf16 tensor-core dots. Results equal `F.linear`'s up to float32
summation order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.layers import programs_to_fill
from flashtree.pdl import pdl_args, wait_for_previous

_BLOCK_N, _BLOCK_K, _WARPS, _STAGES = 8, 512, 4, 3  # see benchmarks/kernels.py --sections gemv
_SHORT_BLOCK_K = 1024
ROWS_MAX = 16  # gemv_rows: a chain's or a small tree's tokens verified at batch 1
_ROWS_BLOCK_N, _ROWS_BLOCK_K = 32, 64  # benchmarks/kernels.py --sections router


@triton.jit
def _gemv_input(x_ptr, g_ptr, c, k, rstd, NORM: tl.constexpr):
    # x[c] in float32; under NORM RMS-normalised with weight g and rounded as
    # `fused.rms_norm` rounds it (normalised, then times g, each to x's dtype).
    x = tl.load(x_ptr + c, mask=c < k, other=0.0)
    if NORM:
        g = tl.load(g_ptr + c, mask=c < k, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * g).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv_rstd(x_ptr, k, eps, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    # 1 / rms(x) under NORM, else 1. Each program sums x's squares itself: x is one short
    # row, the weight is the traffic.
    rstd = 1.0
    if NORM:
        cols = tl.arange(0, BLOCK_K)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            xs = tl.load(x_ptr + start + cols, mask=start + cols < k, other=0.0).to(tl.float32)
            squares += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
    return rstd


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, g_ptr, n, k, stride_w, eps, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    # One program per BLOCK_N outputs: stream their weight rows, accumulate in float32. With
    # PDL the first weight tile (nobody's output) loads while the kernel before finishes;
    # with NORM, x is RMS-normalised as it is read.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    first = 0
    if PDL:
        w = tl.load(w_rows + cols[None, :], mask=(rows[:, None] < n) & (cols[None, :] < k),
                    other=0.0)
        wait_for_previous(PDL)
        rstd = _gemv_rstd(x_ptr, k, eps, BLOCK_K, NORM)
        acc += w.to(tl.float32) * _gemv_input(x_ptr, g_ptr, cols, k, rstd, NORM)[None, :]
        first = BLOCK_K
    else:
        rstd = _gemv_rstd(x_ptr, k, eps, BLOCK_K, NORM)
    for start in range(first, k, BLOCK_K):
        c = start + cols
        w = tl.load(w_rows + c[None, :], mask=(rows[:, None] < n) & (c[None, :] < k), other=0.0)
        acc += w.to(tl.float32) * _gemv_input(x_ptr, g_ptr, c, k, rstd, NORM)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < n)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, part_ptr, m, n, k, k_per_split, stride_x, stride_w,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # part[split, :m, cols] = x[:m, split's k range] . W[cols, same range], float32 W. On
    # tensor cores as three bf16 dots: W = hi + mid + lo exactly (8 bits of its 24 each), and
    # bf16 x times a bf16 part is exact in the float32 accumulator. Rows padded to ROWS (16).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    start = tl.program_id(1) * k_per_split
    for k0 in range(start, tl.minimum(start + k_per_split, k), BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :],
                    mask=(rows[:, None] < m) & (c[None, :] < k), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + c[:, None],
                    mask=(cols[None, :] < n) & (c[:, None] < k), other=0.0)  # [BLOCK_K, BLOCK_N]
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(x, hi, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, lo, acc)
    out = part_ptr + tl.program_id(1) * m * n + rows[:, None] * n + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < m) & (cols[None, :] < n))


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x: one row of a half-precision activation against a 2-D weight of
    its dtype or float32 with contiguous rows (the caller checks it is on CUDA, outside
    autograd)."""
    return (x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype in (x.dtype, torch.float32)
            and x.numel() == x.shape[-1] > 0 and weight.dim() == 2 and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [..., k] holding one row, weight [n, k] -> x W^T [..., n] in the weight's dtype (see
    `gemv_applies`). With `norm` (an RMSNorm's weight [k] and eps), rms_norm(x) W^T in one
    launch instead of two."""
    assert gemv_applies(x, weight), (
        f"gemv takes one bf16/fp16 row and a weight of its dtype or float32 with contiguous "
        f"rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x_row = x.reshape(k).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=weight.dtype, device=x.device)
    block_n, block_k = launch_shape(n, x.device)
    g, eps = norm if norm is not None else (x_row, 0.0)  # x_row: an unread stand-in
    assert g.shape == (k,) and g.is_contiguous(), f"norm weight {tuple(g.shape)} for k = {k}"
    _gemv_kernel[(triton.cdiv(n, block_n),)](x_row, weight, y, g, n, k, weight.stride(0), eps,
                                             BLOCK_N=block_n, BLOCK_K=block_k,
                                             NORM=norm is not None, num_warps=_WARPS,
                                             num_stages=_STAGES, **pdl_args(x.device))
    return y


def launch_shape(n: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) a program streams per step: _BLOCK_N x _BLOCK_K, or one row x
    _SHORT_BLOCK_K for a matrix whose _BLOCK_N-row programs would not fill two per SM (a
    rank's share of a projection, a LoRA-down: faster there on an H100,
    `python -m benchmarks.kernels --sections gemv --gemv-shapes kimi-tp8`)."""
    if -(-n // _BLOCK_N) <= programs_to_fill(device):
        return 1, _SHORT_BLOCK_K
    return _BLOCK_N, _BLOCK_K


def gemv_rows_applies(x: torch.Tensor, weight: torch.Tensor, rows_max: int = ROWS_MAX) -> bool:
    """Whether `gemv_rows` takes x: 2 to `rows_max` rows of a bf16 activation against a
    float32 2-D weight with contiguous rows (the caller checks CUDA, outside autograd)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.float32
            and 2 <= rows <= rows_max and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[1] == x.shape[-1] > 0)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, rows_max: int = ROWS_MAX) -> torch.Tensor:
    """x [..., k] of 2 to `rows_max` rows, weight [n, k] float32 -> x W^T [..., n] float32, as
    `F.linear(x.float(), weight)`. The k dim splits so that the programs fill the device;
    the splits' partial sums add up in one more launch (in order: deterministic)."""
    assert gemv_rows_applies(x, weight, rows_max), (
        f"gemv_rows takes 2 to {rows_max} bf16 rows and a float32 weight with contiguous "
        f"rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, col_blocks = x2.shape[0], triton.cdiv(n, _ROWS_BLOCK_N)
    blocks_k = triton.cdiv(k, _ROWS_BLOCK_K)
    per_split = triton.cdiv(blocks_k, max(1, min(blocks_k, programs_to_fill(x.device)
                                                  // col_blocks))) * _ROWS_BLOCK_K
    splits = triton.cdiv(k, per_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _gemv_rows_kernel[(col_blocks, splits)](
        x2, weight, part, m, n, k, per_split, x2.stride(0), weight.stride(0),
        ROWS=max(16, triton.next_power_of_2(m)), BLOCK_N=_ROWS_BLOCK_N, BLOCK_K=_ROWS_BLOCK_K)
    y = part[0] if splits == 1 else part.sum(0)
    return y.reshape(*x.shape[:-1], n)
