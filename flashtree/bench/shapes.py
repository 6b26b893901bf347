"""Every model shape the benchmarks build, defined once: Hugging Face config dicts (Qwen3 unless
they name their architecture) for random-weight targets, the dense Qwen3 layers of each
target's DFlash drafter beside them, and the MoE layer of a shape as one routed-expert layer.
Benchmarks keep a shape's widths and may cut its depth (`with_layers`)."""

from __future__ import annotations

from dataclasses import replace

from flashtree.layers.config import MoEConfig
from flashtree.models.config import ModelConfig

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=1e4,
            max_position_embeddings=4096)
# SmolLM2-135M, the default model's geometry (Llama, tied embeddings).
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, rope_theta=1e5, max_position_embeddings=8192,
                    tie_word_embeddings=True)
# Qwen3-30B-A3B: 48 layers, all of them 128 experts of 768, top-8.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960,
                     architectures=["Qwen3MoeForCausalLM"], num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])
TINY_MOE = dict(TINY, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])
# DeepSeek-V3: MLA (128 heads, latent 512 + rope 64), 3 dense layers, then 256 experts, top-8.
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
    n_shared_experts=1, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3, rope_theta=1e4,
    max_position_embeddings=163840)
TINY_MLA = dict(
    DEEPSEEK_V3, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, vocab_size=512, q_lora_rank=24,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
    first_k_dense_replace=1, max_position_embeddings=4096)
# Kimi K2.6's text stack (DeepSeek-V3 architecture), as tests/fixtures/kimi_k26/config.json
# states it; its routed experts ship as INT4 in groups of 32 (INT4_GROUPS).
KIMI_K26 = dict(
    DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
    n_routed_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827,
    first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=50000.0,
    max_position_embeddings=262144,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))

SHAPES = {"qwen3-8b": QWEN3_8B, "tiny": TINY, "smollm2-135m": SMOLLM2_135M,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny-moe": TINY_MOE, "deepseek-v3": DEEPSEEK_V3,
          "tiny-mla": TINY_MLA, "kimi-k2.6": KIMI_K26}

# Each target's drafter layers (dense Qwen3; the drafter shares the target's embedding and LM
# head). Dense targets draft with their own layer shape; MLA targets with GQA layers of theirs.
_MLA_DRAFTER = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=56,
                    num_key_value_heads=8, head_dim=128, vocab_size=129280, rope_theta=1e4,
                    max_position_embeddings=163840)
DRAFTERS = {
    "qwen3-8b": QWEN3_8B, "tiny": TINY, "tiny-moe": TINY, "tiny-mla": TINY,
    "smollm2-135m": {k: v for k, v in SMOLLM2_135M.items() if k != "tie_word_embeddings"},
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1e6, max_position_embeddings=40960),
    "deepseek-v3": _MLA_DRAFTER,
    "kimi-k2.6": dict(_MLA_DRAFTER, vocab_size=163840, rope_theta=50000.0,
                      max_position_embeddings=262144),
}
# Routed experts held as packed INT4 with a scale per this many inputs (0: the model dtype).
INT4_GROUPS = {"kimi-k2.6": 32, "tiny-moe": 16}


def with_layers(shape: dict, layers: int | None, first_dense: int | None = None) -> dict:
    """`shape` cut to `layers` decoder layers; `first_dense` sets how many of them are dense
    before the MoE ones (DeepSeek's first_k_dense_replace)."""
    out = dict(shape)
    if layers is not None:
        out["num_hidden_layers"] = layers
    if first_dense is not None:
        out["first_k_dense_replace"] = first_dense
    return out


def moe_layer(name: str) -> tuple[int, MoEConfig]:
    """(hidden size, config of one routed-expert layer) of the MoE shape `name`, its experts
    held as the released checkpoint holds them."""
    cfg = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], **SHAPES[name]})
    if cfg.moe is None:
        raise ValueError(f"shape {name!r} has no MoE layers; MoE shapes: "
                         f"{[k for k in SHAPES if 'num_experts_per_tok' in SHAPES[k]]}")
    return cfg.hidden_size, replace(cfg.moe, sparse_layers=(True,),
                                    int4_group=INT4_GROUPS.get(name, 0))
