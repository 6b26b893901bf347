"""The fused MoE router kernel compiled on CUDA against the eager `Router.select` at the real
models' shapes (DeepSeek-V3, Kimi K2.6, Qwen3-30B-A3B) over decode and prefill batch sizes,
and `Router.forward` taking the kernel under no_grad and the eager ops under autograd. Skips
without CUDA or triton."""

from __future__ import annotations

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from tests.layers.moe_router_cases import CONFIGS, REAL, by_id, check_route, router  # noqa: E402


@pytest.mark.parametrize("n", [1, 5, 33, 128])
@pytest.mark.parametrize("name", REAL)
def test_route_matches_eager_on_cuda(name, n):
    check_route(name, n, "cuda", seed=n)


@pytest.mark.parametrize("name", [k for k in CONFIGS if k not in REAL])
def test_small_routers_match_eager_on_cuda(name):
    check_route(name, 33, "cuda")


@pytest.mark.parametrize("name", REAL)
def test_router_forward_uses_the_kernel_without_grad(name):
    ours = router(name, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ours.weight.data.normal_(generator=gen)
    x = torch.randn(7, ours.weight.shape[1], device="cuda", generator=gen)
    with torch.no_grad():
        fused = by_id(*ours(x))
    eager = by_id(*ours(x))  # grad enabled: the eager ops
    assert torch.equal(fused[1], eager[1])
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=1e-9)
