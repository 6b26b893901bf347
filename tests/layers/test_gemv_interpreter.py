"""The GEMV kernels (`layers/gemv.py`) on CPU through Triton's interpreter: one bf16 or fp16
row, or a verify's few rows against a float32 router, against weights of odd shapes and
strides equal a float64 `F.linear` within the error the kernel can honestly have, element by
element. Skipped where triton is not installed (a failure under CI=true) and where CUDA
exists: there tests/gpu/test_gemv_cuda.py runs it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernel", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from flashtree.layers.gemv import (  # noqa: E402
    ROWS_MAX,
    gemv,
    gemv_applies,
    gemv_rows,
    gemv_rows_applies,
)

# u = 2^-p for p significand bits: half an ulp of 1, relative, rounding to nearest.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Products of two bf16/fp16 values are exact in float32; summing k of them in float32
    errs by at most k * u32 * sum|w x| (the worst case of any order), and the final rounding
    to y's dtype by u * |y| (or u * its smallest normal, below that)."""
    x64, w64 = x.double().reshape(-1, weight.shape[1]), weight.double()
    exact = F.linear(x64, w64).reshape(y.shape)
    k, u = weight.shape[1], UNIT_ROUNDOFF[y.dtype]
    summation = k * UNIT_ROUNDOFF[torch.float32] * F.linear(x64.abs(), w64.abs()).reshape(y.shape)
    bound = u * exact.abs() + (1 + u) * summation + u * torch.finfo(y.dtype).smallest_normal
    error = (y.double() - exact).abs()
    worst = (error / bound).argmax()
    assert (error <= bound).all(), (f"output {worst.item()}: |y - exact| = "
                                     f"{error[worst].item():.3g} > {bound[worst].item():.3g}")


def random_case(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    return torch.randn(k, generator=gen).to(dtype), weight


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(7, 1000), (13, 129), (64, 1024), (200, 576), (300, 257)])
def test_one_row_matches_float64(dtype, n, k):
    """Fewer rows than a block, a partial last row block, K below one block, a partial last
    K block, and exact multiples of both (blocks of 8 rows by 512 columns)."""
    x, weight = random_case(n, k, dtype, seed=n + k)
    assert gemv_applies(x, weight)
    y = gemv(x, weight)
    assert y.shape == (n,) and y.dtype == dtype
    assert_within_rounding(y, x, weight)


@torch.inference_mode()
@pytest.mark.parametrize("n,k", [(13, 129), (384, 1024)])  # 384: Kimi K2.6's routed experts
def test_float32_weight_gives_float32(n, k):
    """A float32 router against a bf16 row: float32 out, as F.linear(x.float(), weight)."""
    x, weight = random_case(n, k, torch.bfloat16, seed=n)
    weight = weight.float() * (1 + torch.rand(n, k, generator=torch.Generator().manual_seed(3)))
    assert gemv_applies(x, weight)
    y = gemv(x, weight)
    assert y.shape == (n,) and y.dtype == torch.float32
    assert_within_rounding(y, x, weight)


@torch.inference_mode()
@pytest.mark.parametrize("x_shape", [(1, -1), (1, 1, -1)])
def test_leading_dims_kept(x_shape):
    x, weight = random_case(24, 300, torch.bfloat16, seed=1)
    x = x.reshape([300 if d == -1 else d for d in x_shape])
    y = gemv(x, weight)
    assert y.shape == x.shape[:-1] + (24,)
    assert_within_rounding(y, x, weight)


@torch.inference_mode()
def test_strided_row_and_weight_columns():
    """A row viewed out of a wider tensor, and a weight whose rows are column slices of a wider
    matrix (row stride 700 != k = 600): the kernel steps rows by the weight's own stride."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 1200, generator=gen).to(torch.bfloat16)
    full = (torch.randn(40, 700, generator=gen) / 600 ** 0.5).to(torch.bfloat16)
    x, weight = wide[1, ::2], full[:, 50:650]
    assert weight.stride(0) == 700 and gemv_applies(x, weight)
    assert_within_rounding(gemv(x, weight), x, weight)


@torch.inference_mode()
@pytest.mark.parametrize("m", [2, 5, ROWS_MAX])
@pytest.mark.parametrize("n,k", [(13, 129), (40, 1000), (384, 1024)])  # 384: Kimi's router
def test_few_rows_against_a_float32_router_match_float64(m, n, k):
    """A verify's rows against a float32 weight: float32 out, as F.linear(x.float(), weight),
    through splits of k (a partial last one at k 1000 and 129) and a partial column block."""
    gen = torch.Generator().manual_seed(m * n + k)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    assert gemv_rows_applies(x, weight)
    y = gemv_rows(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within_rounding(y, x, weight)


@torch.inference_mode()
def test_few_rows_keep_every_bit_of_a_float32_weight():
    """Unit rows pick the weight's columns: one exact product each, so y equals them bit for
    bit, which only holds if all 24 significand bits reach the products (the kernel's three
    bf16 parts of W), not the 8 or 16 of one or two."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 300, generator=gen)
    picked = torch.tensor([0, 7, 128, 129, 299])
    x = torch.zeros(len(picked), 300, dtype=torch.bfloat16)
    x[torch.arange(len(picked)), picked] = 1
    assert torch.equal(gemv_rows(x, weight), weight[:, picked].t())


@torch.inference_mode()
def test_gemv_rows_takes_only_a_verifys_rows_against_float32():
    weight = torch.randn(8, 64)
    assert gemv_rows_applies(torch.randn(3, 2, 64).to(torch.bfloat16), weight)  # 6 rows
    assert not gemv_rows_applies(torch.randn(1, 64).to(torch.bfloat16), weight)  # gemv's
    assert not gemv_rows_applies(torch.randn(ROWS_MAX + 1, 64).to(torch.bfloat16), weight)
    assert not gemv_rows_applies(torch.randn(4, 64).to(torch.bfloat16), weight.bfloat16())
    assert not gemv_rows_applies(torch.randn(4, 64).to(torch.bfloat16), weight.t())
    assert not gemv_rows_applies(torch.randn(4, 64).to(torch.float16), weight)


@torch.inference_mode()
@pytest.mark.parametrize("n,k", [(13, 129), (200, 1536)])  # 1536: Kimi's q LoRA rank
def test_rms_norm_folded_in_matches_float64(n, k):
    """gemv(x, W, norm=(g, eps)) = rms_norm(x) W^T: against float64, within the norm's two
    roundings to bf16 (normalised, then times g: 2u of each input, rstd's float32 error
    besides) carried through |W|, plus the product's own error."""
    gen = torch.Generator().manual_seed(k)
    x = (3 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    g = (1 + torch.rand(k, generator=gen)).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    eps = 1e-6
    x64 = x.double()
    normed = x64 / (x64.square().mean() + eps).sqrt() * g.double()
    y = gemv(x, weight, norm=(g, eps))
    exact = F.linear(normed, weight.double())
    u, u32 = UNIT_ROUNDOFF[torch.bfloat16], UNIT_ROUNDOFF[torch.float32]
    inputs = (2 * u + k * u32) * F.linear(normed.abs(), weight.double().abs())
    bound = inputs * (1 + u) + u * exact.abs() + (1 + u) * k * u32 * F.linear(
        normed.abs(), weight.double().abs()) * (1 + 2 * u)
    error = (y.double() - exact).abs()
    assert (error <= bound).all(), (error / bound).max().item()
