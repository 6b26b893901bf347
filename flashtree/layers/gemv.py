"""y = x W^T for one row of x on CUDA: the GEMMs of a batch-1 decode step, a weight read once.

On an H200 this streams the smaller Qwen3-8B projections (q/k/v, o, down) faster than cuBLAS
does at batch 1 (docs/benchmarks.md, `python -m benchmarks.kernels --sections gemv`).
`layers.dense` chooses it; every other case (several rows, float32, CPU, autograd) stays
with `F.linear`. A float32 weight against a half-precision row (DeepSeek's router) gives
float32, as `F.linear(x.float(), weight)` does without the cast's launch. Results equal
`F.linear`'s up to float32 summation order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.layers import programs_to_fill

_BLOCK_N, _BLOCK_K, _WARPS, _STAGES = 8, 512, 4, 3  # see benchmarks/kernels.py --sections gemv
_SHORT_BLOCK_K = 1024


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n, k, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per BLOCK_N outputs: stream their weight rows, accumulate in float32.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        c = start + cols
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + c[None, :],
                    mask=(rows[:, None] < n) & (c[None, :] < k), other=0.0)
        x = tl.load(x_ptr + c, mask=c < k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < n)


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, part_ptr, rows, n, k, k_per_split, stride_x, stride_w,
                      stride_ps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # part[split, r, j] = x[r, this split's k] . W[j, same k] in float32, for BLOCK_N
    # outputs j and every row r: the weight tile is read once for all rows.
    r = tl.arange(0, ROWS)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    k_start = tl.program_id(1) * k_per_split
    for start in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        c = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :],
                    mask=(r[:, None] < rows) & (c[None, :] < k), other=0.0)
        w = tl.load(w_ptr + outs[None, :].to(tl.int64) * stride_w + c[:, None],
                    mask=(outs[None, :] < n) & (c[:, None] < k), other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    tl.store(part_ptr + tl.program_id(1) * stride_ps + r[:, None] * n + outs[None, :], acc,
             mask=(r[:, None] < rows) & (outs[None, :] < n))


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x: one row of a half-precision activation against a 2-D weight of
    its dtype or float32 with contiguous rows (the caller checks it is on CUDA, outside
    autograd)."""
    return (x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype in (x.dtype, torch.float32)
            and x.numel() == x.shape[-1] > 0 and weight.dim() == 2 and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] holding one row, weight [n, k] -> x W^T [..., n] in the weight's dtype (see
    `gemv_applies`)."""
    assert gemv_applies(x, weight), (
        f"gemv takes one bf16/fp16 row and a weight of its dtype or float32 with contiguous "
        f"rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x_row = x.reshape(k).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=weight.dtype, device=x.device)
    block_n, block_k = launch_shape(n, x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x_row, weight, y, n, k, weight.stride(0),
                                             BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=_WARPS, num_stages=_STAGES)
    return y


def launch_shape(n: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) a program streams per step: _BLOCK_N x _BLOCK_K, or one row x
    _SHORT_BLOCK_K for a matrix whose _BLOCK_N-row programs would not fill two per SM (a
    rank's share of a projection, a LoRA-down: faster there on an H100,
    `python -m benchmarks.kernels --sections gemv --gemv-shapes kimi-tp8`)."""
    if -(-n // _BLOCK_N) <= programs_to_fill(device):
        return 1, _SHORT_BLOCK_K
    return _BLOCK_N, _BLOCK_K


ROWS_MAX = 16  # `rows_gemv` takes up to this many rows


def rows_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rows_gemv` takes x: 1 to ROWS_MAX rows of a half-precision activation against
    a float32 2-D weight with contiguous rows (a float32 router at a verify's few tokens)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32
            and 0 < rows <= ROWS_MAX and x.shape[-1] == weight.shape[-1]
            and weight.dim() == 2 and weight.stride(1) == 1)


def rows_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., k] of a few rows, float32 weight [n, k] -> x W^T [..., n] in float32, equal to
    `F.linear(x.float(), weight)` up to summation order: the weight is streamed once for all
    rows, its input dim split over programs to fill the GPU, the splits' float32 partial sums
    added last (cuBLAS's float32 GEMM at a few rows reads it far slower)."""
    assert rows_gemv_applies(x, weight), (
        f"rows_gemv takes 1 to {ROWS_MAX} bf16/fp16 rows and a float32 weight with contiguous "
        f"rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows, block_n, block_k = x2.shape[0], 16, 128
    col_blocks, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = max(1, min(k_blocks, programs_to_fill(x.device) // col_blocks))
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    _rows_gemv_kernel[(col_blocks, splits)](
        x2, weight, part, rows, n, k, k_per_split, x2.stride(0), weight.stride(0),
        part.stride(0), ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4)
    y = part[0] if splits == 1 else part.sum(0)
    return y.reshape(*x.shape[:-1], n)
