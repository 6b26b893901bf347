"""Config-only checks on a Kimi-K2.6-shaped config (DeepSeek-V3 text stack in the K2.5/K2.6
multimodal wrapper) and a Kimi DFlash drafter config (6 taps, block 8, hidden 7168): parsed
shapes, parameter counts against the published ~1T total / ~32B active, per-GPU memory under
TP8 and EP8, and the `flashtree plan` command. No weights exist or are read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flashtree.cli import build_parser, main
from flashtree.layers.rotary import rope_attention_scaling, softmax_mscale
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashConfig
from flashtree.plan import kv_bytes_per_token, make_plan, target_parts

FIXTURES = Path(__file__).parent / "fixtures"
KIMI = FIXTURES / "kimi_k26"
DRAFT = FIXTURES / "kimi_k26_dflash"


def _cfg() -> ModelConfig:
    return ModelConfig.from_hf(json.loads((KIMI / "config.json").read_text()))


def test_kimi_config_parsed_into_the_right_shapes():
    cfg = _cfg()
    assert cfg.architecture == "DeepseekV3ForCausalLM"
    assert cfg.weight_prefix == "language_model."  # K2.5/K2.6 wrapper
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_heads) == (
        61, 7168, 163840, 64)
    assert cfg.eos_token_ids == (163585,) and not cfg.tie_word_embeddings
    moe = cfg.moe
    assert moe is not None
    assert moe.sparse_layers == (False,) + (True,) * 60  # first_k_dense_replace 1
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size) == (
        384, 8, 1, 2048)
    assert (moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group) == (
        "sigmoid", "noaux_tc", 1, 1)
    assert moe.norm_topk_prob and moe.routed_scaling_factor == 2.827 and moe.router_fp32
    mla = cfg.mla
    assert mla is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (1536, 512, 128, 64, 128)
    assert mla.qk_head_dim == 192 and mla.latent_dim == 576 and cfg.head_dim == 64
    rope = cfg.rope
    assert (rope.rope_type, rope.factor, rope.theta, rope.original_max_position_embeddings) == (
        "yarn", 64.0, 50000.0, 4096)
    assert rope_attention_scaling(rope) == 1.0  # mscale == mscale_all_dim
    # DeepSeek's softmax scale: 1/sqrt(192) x (0.1 ln 64 + 1)^2.
    assert softmax_mscale(rope) == pytest.approx(0.1 * math.log(64) + 1)
    assert cfg.quantization == "compressed-tensors"  # INT4 routed experts, kept packed


def test_kimi_drafter_config_parsed_and_fits_the_target():
    d = DFlashConfig.from_hf(json.loads((DRAFT / "config.json").read_text()))
    assert d.block_size == 8 and d.mask_token_id == 163838
    assert d.target_layer_ids == (1, 12, 24, 35, 47, 58)
    lc = d.layers
    assert (lc.hidden_size, lc.num_layers, lc.num_heads, lc.num_kv_heads, lc.head_dim) == (
        7168, 6, 64, 8, 128)
    assert lc.rope.rope_type == "yarn" and lc.rope.factor == 64.0
    d.check_target(_cfg())  # width, vocabulary, mask id and taps all fit Kimi


def test_parameter_counts_match_the_published_size():
    parts = {p.name: p for p in target_parts(_cfg())}
    total = sum(p.params for p in parts.values())
    active = sum(p.active for p in parts.values())
    # ~1.03T by config arithmetic (models.md: 1.026T; Moonshot: "1T total, 32B activated").
    assert abs(total - 1.026e12) / 1.026e12 < 0.01, total
    assert 31e9 < active < 34e9, active
    # Experts: 384 x 60 layers x 3 x 7168 x 2048.
    assert parts["routed_experts"].params == 384 * 60 * 3 * 7168 * 2048
    assert parts["routed_experts"].params / total > 0.98
    # MLA per layer: q_a, q_b, kv_a, kv_b, o_proj + the two latent norms.
    per_layer = (7168 * 1536 + 1536 + 1536 * 64 * 192 + 7168 * 576 + 512
                 + 512 * 64 * 256 + 64 * 128 * 7168)
    assert parts["attention"].params == 61 * per_layer


def test_per_gpu_memory_tp8_vs_ep8():
    tp8 = make_plan(KIMI, DRAFT, tp=8, ep=1)
    ep8 = make_plan(KIMI, DRAFT, tp=8, ep=8)
    one = make_plan(KIMI, DRAFT, tp=1, ep=1)
    by = {p.name: p for p in tp8.parts}
    # Every GPU holds 1/8 of the routed-expert weights either way: TP8 slices all 384 experts
    # to 256 of 2048 intermediate rows, EP8 holds 48 whole experts.
    assert tp8.weight_bytes_per_gpu == ep8.weight_bytes_per_gpu
    assert by["routed_experts"].per_gpu == by["routed_experts"].params // 8
    # q_a / kv_a (and the latent cache) are replicated: attention per GPU > 1/8 of it.
    assert by["attention"].per_gpu > by["attention"].params / 8 * 1.5
    assert one.weight_bytes_per_gpu / tp8.weight_bytes_per_gpu > 7.5
    # K2.6's routed experts stay INT4 as loaded (the rest is bf16 in the checkpoint too):
    # ~72 GiB per GPU, where bf16 experts would take ~2 TB / 8 = ~242 GiB, more than an H200.
    assert tp8.weight_bytes_per_gpu == tp8.stored_bytes_per_gpu
    assert 65 < tp8.weight_bytes_per_gpu / 2**30 < 80
    assert tp8.kv_tokens(tp8.weight_bytes_per_gpu) > 500_000
    bf16 = sum(p.per_gpu for p in tp8.parts) * 2
    assert 230 < bf16 / 2**30 < 250 and tp8.kv_tokens(bf16) == 0
    # Latent KV: 61 layers x 576 x 2 B; the drafter adds 6 x 2 x 1 KV head x 128 x 2 B (8 KV
    # heads over 8 ranks).
    assert kv_bytes_per_token(tp8.cfg, 8, 2) == 61 * 576 * 2 == 70272
    assert tp8.kv_per_token == 70272 + 6 * 2 * 128 * 2


def test_plan_command_prints_the_estimate(capsys):
    assert main(["plan", "--config", str(KIMI / "config.json"), "--draft", str(DRAFT),
                 "--tp", "8", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "1,026.4B total, 32.9B active" in out
    assert "48 experts per GPU" in out and "routed_experts" in out
    assert "KV cache per token per GPU: 73,344 B" in out
    assert "as loaded: KV budget" in out and "DOES NOT FIT" not in out
    assert "at checkpoint precision (" not in out  # INT4 experts are loaded as stored


def test_plan_refuses_layouts_that_do_not_split(capsys):
    assert main(["plan", "--config", str(KIMI), "--tp", "8", "--ep", "3"]) == 2
    assert "--ep 3 must be >= 1 and divide --tp 8" in capsys.readouterr().err
    assert main(["plan", "--config", str(KIMI), "--tp", "6", "--ep", "6"]) == 2
    assert "--tp 6 does not divide 64 attention heads" in capsys.readouterr().err


def test_serve_accepts_ep():
    args = build_parser().parse_args(["serve", "m", "--tp", "4", "--ep", "2"])
    assert (args.tp, args.ep) == (4, 2)


def test_qwen3_30b_a3b_shaped_config(tmp_path):
    """GQA + softmax MoE without shared experts: Qwen3-30B-A3B's published 30.5B total / 3.3B
    active, and its 4 KV heads copied (not split) under TP8."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
           "tie_word_embeddings": False, "max_position_embeddings": 40960}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = make_plan(tmp_path, tp=8, ep=4)
    assert abs(plan.total_params - 30.5e9) / 30.5e9 < 0.01, plan.total_params
    assert abs(plan.active_params - 3.3e9) / 3.3e9 < 0.03, plan.active_params
    assert "dense_mlp" not in {p.name for p in plan.parts}
    assert plan.kv_per_token == 2 * 48 * 1 * 128 * 2  # one (copied) KV head per rank
