"""The fused MoE router kernel against the eager `Router.select`, on CPU through Triton's
interpreter: the same experts and weights for DeepSeek-V3's, Kimi K2.6's and Qwen3-30B-A3B's
routers and small variants, and the correction bias selects experts but never weights them.
Skipped where triton is not installed (a failure under CI=true) and where CUDA exists: there
tests/gpu/test_moe_router_cuda.py runs the kernel compiled."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from flashtree.layers.moe_router import route  # noqa: E402
from tests.layers.moe_router_cases import CONFIGS, by_id, check_route, router  # noqa: E402


@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_matches_eager(name, n):
    check_route(name, n, "cpu", seed=n)


@pytest.mark.parametrize("name", ["kimi-k2.6", "deepseek-v3", "small-groups-noaux"])
def test_bias_selects_but_does_not_weight(name):
    ours = router(name, "cpu")
    cfg, n = ours.cfg, 9
    logits = torch.randn(n, cfg.num_experts, generator=torch.Generator().manual_seed(1)) * 2
    planted = int(logits.sum(0).argmin())  # low scores: chosen for its bias alone
    before = route(logits, ours.e_score_correction_bias, cfg)[1]
    assert (before == planted).any(dim=-1).sum() <= n // 4
    ours.e_score_correction_bias.data[planted] = 10.0
    weights, ids = route(logits, ours.e_score_correction_bias, cfg)
    assert (ids == planted).any(dim=-1).all(), "the biased expert is not chosen"
    scores = logits.sigmoid()
    want = scores.gather(1, ids)  # the UNBIASED scores of the chosen experts
    want = want / want.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-9)
    slot = (ids == planted).int().argmax(-1, keepdim=True)  # weighted by its biased score
    # (10 + s), it would take most of the renormalized weight
    assert (weights.gather(1, slot) < 0.5 * cfg.routed_scaling_factor).all()
    for a, b in zip(by_id(weights, ids), by_id(*ours.select(logits))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", [k for k, v in CONFIGS.items() if v.get("n_group", 1) > 1])
def test_groups_constrain_the_choice(name):
    """The chosen experts lie in topk_group groups, and without groups some choices differ
    (so the match with eager above covers the group selection)."""
    ours = router(name, "cpu")
    cfg, n = ours.cfg, 33
    logits = torch.randn(n, cfg.num_experts, generator=torch.Generator().manual_seed(2)) * 2
    ids = route(logits, ours.e_score_correction_bias, cfg)[1]
    groups = ids // (cfg.num_experts // cfg.n_group)
    assert all(len(set(g)) <= cfg.topk_group for g in groups.tolist())
    free = replace(cfg, n_group=1, topk_group=1)
    unconstrained = route(logits, ours.e_score_correction_bias, free)[1]
    assert not torch.equal(unconstrained.sort(-1).values, ids.sort(-1).values)


def test_no_tokens():
    ours = router("kimi-k2.6", "cpu")
    weights, ids = route(torch.empty(0, 384), ours.e_score_correction_bias, ours.cfg)
    assert weights.shape == ids.shape == (0, 8)
