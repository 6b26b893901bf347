"""The grouped-GEMM MoE kernels compiled on CUDA: the interpreter cases of tests/layers/ (fp32,
bf16, dense, INT4 and FP8 experts), and a CUDA graph captured over routing A and replayed on routing
B (other experts, other weights, the same batch size) gives B's result, so nothing about the
routing is baked in and no host sync sits in the forward. Skips without CUDA or triton."""

from __future__ import annotations

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree.layers.fused_moe import fused_experts  # noqa: E402
from flashtree.layers.stacked_experts import StackedExperts  # noqa: E402
from tests.layers.moe_cases import CASES, check_fused_experts, eager_experts  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[4] % 16 == 0])
def test_int4_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda", group=16)


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])  # per pair, EP, grouped
def test_shared_experts_added_on_cuda(case, group):
    check_fused_experts(case, torch.bfloat16, "cuda", group=group, shared=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[3] % 16 == 0 and c[4] % 16 == 0])
def test_fp8_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda", fp8_block=16)


def test_graph_replay_follows_new_routing():
    n, experts, top_k, hidden, inter = 6, 8, 2, 64, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 8
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / 6

    def routing():
        ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k]
                           for _ in range(n)])
        return ids, torch.rand(n, top_k, device="cuda", generator=gen)

    ids, weights = routing()
    stacked = StackedExperts(w13, w2)
    fused_experts(x, stacked, weights, ids, 0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, stacked, weights, ids, 0)
    new_ids, new_weights = routing()
    assert not torch.equal(new_ids, ids)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    want = eager_experts(x, w13, w2, weights, ids, 0)
    assert (out - want).abs().max().item() < 1e-4
