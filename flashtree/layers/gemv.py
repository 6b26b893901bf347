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
