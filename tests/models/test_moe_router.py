"""flashtree's MoE router against transformers' own router modules, variant by variant: softmax
(Qwen3-MoE; DeepSeek-V2's greedy and group-limited greedy), sigmoid with the selection-only
correction bias and group-limited selection (DeepSeek-V3 / Kimi K2), renormalization on and
off, routed scaling. Same chosen experts, same weights, for many random tokens."""

from __future__ import annotations

import pytest
import torch

from flashtree.layers.config import MoEConfig
from flashtree.layers.moe import Router

HIDDEN, EXPERTS, TOKENS = 16, 16, 256


def _hf_router(kind: str, **cfg):
    import transformers as tf

    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
                  num_experts_per_tok=cfg.pop("top_k"))
    if kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(num_experts=EXPERTS, **common, **cfg)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R
    elif kind == "deepseek_v2":
        config = tf.DeepseekV2Config(n_routed_experts=EXPERTS, **common, **cfg)
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as R
    else:
        config = tf.DeepseekV3Config(n_routed_experts=EXPERTS, **common, **cfg)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R
    return R(config)


# name -> (transformers family, its config, flashtree's MoEConfig fields)
VARIANTS = {
    "softmax-norm": ("qwen3_moe", dict(top_k=4, norm_topk_prob=True),
                     dict(scoring_func="softmax", norm_topk_prob=True)),
    "softmax-raw": ("qwen3_moe", dict(top_k=4, norm_topk_prob=False),
                    dict(scoring_func="softmax", norm_topk_prob=False)),
    "softmax-greedy-scaled": (
        "deepseek_v2", dict(top_k=3, topk_method="greedy", routed_scaling_factor=1.5),
        dict(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
             routed_scaling_factor=1.5, router_fp32=True)),
    "softmax-group-limited": (
        "deepseek_v2", dict(top_k=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            routed_scaling_factor=2.0),
        dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
             topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.0, router_fp32=True)),
    "sigmoid-noaux-groups-norm": (
        "deepseek_v3", dict(top_k=4, n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5),
        dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5, router_fp32=True)),
    "sigmoid-noaux-raw": (
        "deepseek_v3", dict(top_k=4, n_group=1, topk_group=1, norm_topk_prob=False,
                            routed_scaling_factor=2.827),
        dict(scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=False,
             routed_scaling_factor=2.827, router_fp32=True)),
}


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order).float(), ids.gather(-1, order)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_router_matches_transformers(variant):
    kind, hf_cfg, ours_cfg = VARIANTS[variant]
    torch.manual_seed(list(VARIANTS).index(variant))
    hf = _hf_router(kind, **dict(hf_cfg))
    cfg = MoEConfig(num_experts=EXPERTS, top_k=hf_cfg["top_k"], intermediate_size=8,
                    sparse_layers=(True,), **ours_cfg)
    ours = Router(cfg, HIDDEN)
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
        ours.weight.copy_(hf.weight)
        if cfg.topk_method == "noaux_tc":
            hf.e_score_correction_bias.normal_(0, 0.3)
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        _, ref_w, ref_ids = hf(x)
        w, ids = ours(x)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, ref_ids), f"{variant}: different experts chosen"
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    if cfg.norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.full((TOKENS,), cfg.routed_scaling_factor))
    if cfg.n_group > 1:  # grouping really constrained the choice for some tokens
        groups = ids // (EXPERTS // cfg.n_group)
        assert all(len(set(g)) <= cfg.topk_group for g in groups.tolist())
        free = Router(MoEConfig(**{**cfg.__dict__, "n_group": 1, "topk_group": 1}), HIDDEN)
        free.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert not torch.equal(_sorted(*free(x))[1], ids)


def test_bad_router_configs_name_what_is_allowed():
    base = dict(num_experts=8, top_k=2, intermediate_size=8, sparse_layers=(True,))
    with pytest.raises(ValueError, match=r"topk_method 'best' is not supported; allowed: "
                                         r"\['greedy', 'group_limited_greedy', 'noaux_tc'\]"):
        MoEConfig(**base, topk_method="best")
    with pytest.raises(ValueError, match="n_group 3 must divide n_routed_experts 8"):
        MoEConfig(**base, n_group=3)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be in"):
        MoEConfig(**{**base, "top_k": 9})
