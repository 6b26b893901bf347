"""The fused Triton kernels against transformers' modules, on CPU through Triton's interpreter.
Skipped where triton is not installed (a failure under CI=true) and where CUDA exists: there
tests/gpu/test_fused_cuda.py runs the same cases compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from tests.layers.fused_cases import (  # noqa: E402
    DTYPES,
    check_mla_prologue,
    check_norm_rope,
    check_norm_rope_to_cache,
    check_rms_norm,
    check_silu_mul,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,residual,heads", [(96, False, 0), (96, True, 0), (64, False, 3)])
def test_rms_norm(dtype, dim, residual, heads):
    check_rms_norm(dtype, "cpu", dim, residual, heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1100])  # 1100: two column blocks of 1024, one partial
def test_silu_mul(dtype, inter):
    check_silu_mul(dtype, "cpu", inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,with_norm", [(64, False), (64, True), (12, True)])
def test_norm_rope(dtype, head_dim, with_norm):
    check_norm_rope(dtype, "cpu", head_dim, with_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,with_norm", [(64, False), (12, True)])
@pytest.mark.parametrize("layers", [0, 3])
def test_norm_rope_to_cache(dtype, head_dim, with_norm, layers):
    check_norm_rope_to_cache(dtype, "cpu", head_dim, with_norm, layers)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_prologue(dtype, interleaved):
    check_mla_prologue(dtype, "cpu", interleaved)
