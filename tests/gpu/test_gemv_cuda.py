"""The GEMV kernels (`layers/gemv.py`) behind `layers.dense`: one row of x against weights of
odd shapes equals a float64 product as closely as cuBLAS's `F.linear` does, and so do a
verify's few rows against a float32 router (`gemv_rows`); other rows, float32 and autograd
stay with `F.linear` exactly. Skips without CUDA or triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree.layers import dense, dense_fp32  # noqa: E402
from flashtree.layers.gemv import ROWS_MAX, gemv, gemv_applies, gemv_rows  # noqa: E402


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.double() - reference).abs().max() / reference.abs().max()).item()


@torch.inference_mode()  # the engine's mode: under autograd `dense` keeps to F.linear
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288), (1000, 576),
                                 (7, 1000), (49152, 129)])
@pytest.mark.parametrize("x_shape", [(1, -1), (-1,), (1, 1, -1)])
def test_one_row_matches_float64_as_closely_as_cublas(dtype, n, k, x_shape):
    gen = torch.Generator("cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    x = torch.randn(k, generator=gen, device="cuda").to(dtype).reshape(
        [k if d == -1 else d for d in x_shape])
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    assert gemv_applies(x, weight)
    reference = F.linear(x.double(), weight.double())
    y, cublas = dense(x, weight), F.linear(x, weight)
    assert torch.equal(y, gemv(x, weight))  # the kernel's result, not F.linear's
    assert y.shape == cublas.shape and y.dtype == dtype
    # bf16/fp16 output rounding dominates: both land within a half-ulp-sized error of float64.
    assert relative_error(y, reference) <= max(2 * relative_error(cublas, reference), 4e-3)
    assert torch.equal(dense(x, weight, bias), y + bias)


@torch.inference_mode()
def test_strided_row_and_weight_view():
    """A row viewed out of a wider tensor and a weight made of rows of a larger one (a fused
    projection's slice) give the same product as their contiguous copies."""
    wide = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    x = wide[1:2, ::2]  # stride 2
    full = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    weight = full[100:300]  # rows contiguous, offset storage
    assert gemv_applies(x, weight)
    assert torch.equal(dense(x, weight), gemv(x.contiguous(), weight.contiguous()))


@pytest.mark.parametrize("case", ["rows", "float32", "autograd"])
def test_other_cases_stay_with_f_linear(case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    weight = torch.randn(256, 512, device="cuda", dtype=dtype)
    x = torch.randn(4 if case == "rows" else 1, 512, device="cuda", dtype=dtype)
    with torch.set_grad_enabled(case == "autograd"):
        if case == "autograd":
            x.requires_grad_(True)
        y = dense(x, weight)
    assert torch.equal(y, F.linear(x, weight))
    if case == "autograd":
        y.sum().backward()  # F.linear's backward: the kernel has none
        assert x.grad is not None


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 2, 9, ROWS_MAX])
def test_float32_router_weight_on_cuda(rows):
    """Kimi K2.6's float32 router (384 x 7168) against a bf16 row or a verify's few: float32
    logits within float32 summation error of `F.linear(x.float(), weight)` (cuBLAS), from
    the GEMV kernels (one row: `gemv`, more: `gemv_rows`)."""
    gen = torch.Generator("cuda").manual_seed(rows)
    weight = torch.randn(384, 7168, generator=gen, device="cuda") / 7168**0.5
    x = torch.randn(rows, 7168, generator=gen, device="cuda").to(torch.bfloat16)
    y, want = dense_fp32(x, weight), F.linear(x.float(), weight)
    assert torch.equal(y, gemv(x, weight) if rows == 1 else gemv_rows(x, weight))
    assert y.dtype == torch.float32 and y.shape == want.shape
    bound = 7168 * 2.0**-24 * F.linear(x.float().abs(), weight.abs())
    assert ((y - want).abs() <= 2 * bound).all()


@torch.inference_mode()
def test_few_rows_keep_every_bit_of_a_float32_router():
    """Unit rows pick the router's columns bit for bit through the tensor cores (one exact
    product each): all 24 significand bits of the float32 weight reach the products."""
    weight = torch.randn(384, 7168, generator=torch.Generator("cuda").manual_seed(1),
                         device="cuda")
    picked = torch.tensor([0, 5, 1000, 7167], device="cuda")
    x = torch.zeros(len(picked), 7168, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(len(picked), device="cuda"), picked] = 1
    assert torch.equal(gemv_rows(x, weight), weight[:, picked].t())


@torch.inference_mode()
def test_rms_norm_folded_into_the_gemv_as_closely_as_two_launches():
    """MLA's q_a norm before q_b (Kimi's 1536 -> a TP8 rank's 1536 rows) in one launch: as
    close to float64 as the RMSNorm kernel followed by cuBLAS."""
    from flashtree.layers.norm import RMSNorm

    gen = torch.Generator("cuda").manual_seed(7)
    norm = RMSNorm(1536, 1e-6).cuda().to(torch.bfloat16)
    norm.weight.data = (1 + torch.rand(1536, generator=gen, device="cuda")).bfloat16()
    weight = (torch.randn(1536, 1536, generator=gen, device="cuda") / 1536**0.5).bfloat16()
    x = (3 * torch.randn(1, 1536, generator=gen, device="cuda")).bfloat16()
    x64 = x.double()
    reference = F.linear(x64 / (x64.square().mean() + 1e-6).sqrt() * norm.weight.double(),
                         weight.double())
    y, two_launches = dense(x, weight, norm=norm), F.linear(norm(x), weight)
    assert torch.equal(y, gemv(x, weight, norm=(norm.weight, norm.eps)))
    assert relative_error(y, reference) <= max(2 * relative_error(two_launches, reference), 4e-3)
