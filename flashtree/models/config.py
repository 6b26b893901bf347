"""What a checkpoint's config.json says about the model: the architecture, the decoder's
geometry (`ModelConfig`), its latent attention (`MLAConfig`), routed experts and quantization,
parsed and validated once (`ModelConfig.from_hf`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashtree.layers.config import MoEConfig, RopeConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)
# fp8: dequantized to the model dtype at load; compressed-tensors: INT4 routed experts kept packed
QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention. Per token the cache holds the normed latent
    (kv_lora_rank) plus one roped key shared by all heads (qk_rope_head_dim)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of one decoder: dense (Llama / Qwen2 / Qwen3), with `moe` routed experts
    (Qwen3-MoE, DeepSeek-V3 / Kimi K2) and with `mla` latent attention (DeepSeek-V3). For MLA,
    `head_dim` is the rotary width (qk_rope_head_dim), as transformers sets it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    # "fp8" (block-quantized, weight_scale_inv per block), "compressed-tensors" (INT4 routed
    # experts, layers/int4.py) or None; other methods raise at load.
    quantization: str | None = None
    quant_block: tuple[int, int] = (128, 128)
    quant_config: str = ""  # the checkpoint's quantization_config as JSON (compressed-tensors)
    # Kimi K2.5/K2.6: a multimodal wrapper whose text weights are under `language_model.`.
    weight_prefix: str = ""

    def __post_init__(self) -> None:
        # The architecture is checked once, where config.json is read (`from_hf`).
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
        )

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        weight_prefix = ""
        if isinstance(cfg.get("text_config"), dict):
            # Multimodal wrapper (Kimi K2.5/K2.6): the text stack's config is `text_config`,
            # its weights live under `language_model.`; the vision tower is skipped.
            outer = cfg
            cfg = {**cfg["text_config"]}
            for key in ("eos_token_id", "bos_token_id", "quantization_config", "torch_dtype",
                        "dtype", "tie_word_embeddings"):
                if key in outer and key not in cfg:
                    cfg[key] = outer[key]
            cfg.pop("architectures", None)
            weight_prefix = "language_model."
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch or cfg.get('model_type')!r} in config.json is not supported; "
                f"allowed: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; allowed: silu")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        layers = int(cfg["num_hidden_layers"])
        mla = _mla_from_hf(cfg) if arch == "DeepseekV3ForCausalLM" else None
        quant, block = _quantization_from_hf(cfg.get("quantization_config"))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
            head_dim=mla.qk_rope_head_dim if mla else int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            moe=_moe_from_hf(arch, cfg, layers),
            mla=mla,
            quantization=quant,
            quant_block=block,
            quant_config=json.dumps(cfg["quantization_config"], sort_keys=True)
            if quant == "compressed-tensors" else "",
            weight_prefix=weight_prefix,
        )


def _moe_from_hf(arch: str, cfg: dict[str, Any], layers: int) -> MoEConfig | None:
    if arch == "Qwen3MoeForCausalLM":
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return MoEConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                for i in range(layers)),
            scoring_func="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    if arch == "DeepseekV3ForCausalLM":
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return MoEConfig(
            num_experts=int(cfg["n_routed_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)),
            scoring_func=str(cfg.get("scoring_func") or "sigmoid"),
            topk_method=str(cfg.get("topk_method") or "noaux_tc"),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            router_fp32=True,
        )
    return None


def _mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _quantization_from_hf(q: dict[str, Any] | None) -> tuple[str | None, tuple[int, int]]:
    """The checkpoint's quantization method (None: plain weights). Unsupported methods are kept
    by name so that config-only tools (`flashtree plan`) still work; the loader refuses them."""
    if not q:
        return None, (128, 128)
    method = str(q.get("quant_method") or q.get("format") or "unknown")
    block = q.get("weight_block_size") or [128, 128]
    return method, (int(block[0]), int(block[1]))


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
