"""The grouped-GEMM MoE kernels against eager expert MLPs, on CPU through Triton's
interpreter. Skipped where triton is not installed (a failure under CI=true) and where CUDA
exists: there tests/gpu/test_fused_moe_cuda.py runs the same cases compiled."""

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
from tests.layers.moe_cases import CASES, check_fused_experts  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_experts_match_eager(case, dtype):
    check_fused_experts(case, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[4] % 16 == 0])
def test_int4_experts_match_eager_on_their_dequantized_weights(case, dtype):
    check_fused_experts(case, dtype, "cpu", group=16)


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])  # per pair, EP, grouped
def test_shared_experts_added_after_the_routed_sum(case, group):
    check_fused_experts(case, torch.bfloat16, "cpu", group=group, shared=True)


@pytest.mark.parametrize("group", [32, 128, 256])  # groups within, as long as, over a tile
def test_int4_groups_of_any_size_against_tiles(group):
    check_fused_experts((2, 8, 2, 512, 256, 0, 8), torch.bfloat16, "cpu", group=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[3] % 16 == 0 and c[4] % 16 == 0])
def test_fp8_experts_match_eager_on_their_dequantized_weights(case, dtype):
    check_fused_experts(case, dtype, "cpu", fp8_block=16)
