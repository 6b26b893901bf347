"""Cases for the fused MoE router (`layers/moe_router.py`), shared by the CPU interpreter test
and tests/gpu/: the kernel's (weights, ids) against the eager `Router.select` on the same
seeded random logits (continuous, so no ties), compared as a set of experts per token."""

from __future__ import annotations

import torch

from flashtree.layers.config import MoEConfig
from flashtree.layers.moe import Router

_NOAUX = dict(scoring_func="sigmoid", topk_method="noaux_tc", router_fp32=True)
# name -> MoEConfig fields; the first three are the real models' routers.
CONFIGS = {
    "deepseek-v3": dict(num_experts=256, top_k=8, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, **_NOAUX),
    "kimi-k2.6": dict(num_experts=384, top_k=8, routed_scaling_factor=2.827, **_NOAUX),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8),
    "small-groups-noaux": dict(num_experts=8, top_k=2, n_group=4, topk_group=2,
                               routed_scaling_factor=1.5, **_NOAUX),
    "small-softmax-greedy-raw": dict(num_experts=8, top_k=3, norm_topk_prob=False,
                                     routed_scaling_factor=1.5),
    "small-group-limited-softmax": dict(num_experts=16, top_k=3, n_group=4, topk_group=2,
                                        topk_method="group_limited_greedy",
                                        norm_topk_prob=False, routed_scaling_factor=2.0),
    # Nothing a power of two: experts, groups, top_k (the kernel pads all three).
    "odd-sizes-noaux-raw": dict(num_experts=12, top_k=5, n_group=3, topk_group=2,
                                norm_topk_prob=False, **_NOAUX),
    "top16-of-64-softmax": dict(num_experts=64, top_k=16),
}
REAL = ("deepseek-v3", "kimi-k2.6", "qwen3-30b-a3b")


def router(name: str, device: str, seed: int = 0) -> Router:
    """The eager router of `name`, with a seeded random correction bias where it has one."""
    cfg = MoEConfig(intermediate_size=8, sparse_layers=(True,), **CONFIGS[name])
    ours = Router(cfg, hidden=4).to(device)
    if ours.e_score_correction_bias is not None:
        gen = torch.Generator().manual_seed(seed + 100)
        bias = torch.randn(cfg.num_experts, generator=gen) * 0.1
        ours.e_score_correction_bias.data.copy_(bias)
    return ours


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order).cpu(), ids.gather(-1, order).cpu()


def check_route(name: str, n: int, device: str, seed: int = 0) -> None:
    from flashtree.layers.moe_router import route

    ours = router(name, device, seed)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, ours.cfg.num_experts, generator=gen) * 2).to(device)
    weights, ids = route(logits, ours.e_score_correction_bias, ours.cfg)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (n, ours.cfg.top_k)
    want_w, want_ids = by_id(*ours.select(logits))
    weights, ids = by_id(weights, ids)
    assert torch.equal(ids, want_ids), f"{name}: different experts chosen"
    # Both sides are float32 with the same formulas, but exp/sigmoid come from different
    # libraries and the softmax and renormalization sums add in a different order: a few ulp
    # apart (at most 3 x 2^-23 relative measured over these cases), so rtol 1e-6 (~8 ulp);
    # atol only for scores that underflow to tiny values.
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-9)
