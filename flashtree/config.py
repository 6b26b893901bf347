"""Frozen, validated configuration objects shared by every layer of the engine."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Resolve a user dtype name; the default is bf16 on GPU and fp32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; allowed: {list(_DTYPES)}")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; allowed: {list(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (rope_type "yarn"); names and defaults as in transformers' _compute_yarn_parameters.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older files write
        # `rope_theta` plus an optional `rope_scaling` dict.
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; allowed: {list(SUPPORTED_ROPE_TYPES)}"
            )
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        if factor is None and rope_type == "yarn" and original:
            # transformers: YaRN without a factor scales max / original positions.
            factor = cfg["max_position_embeddings"] / original

        def opt(name: str) -> float | None:
            return None if params.get(name) is None else float(params[name])

        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            attention_factor=opt("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# fp8: dequantized to the model dtype at load; compressed-tensors: INT4 routed experts kept packed
QUANT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (top-k of `num_experts` per token) plus optional shared experts.

    Routing: scores = softmax or sigmoid of the router logits; with groups, only experts of the
    `topk_group` best of `n_group` groups compete (a group's score is its best expert, or the sum
    of its two best with `noaux_tc`, where `e_score_correction_bias` is added for SELECTION only);
    the chosen scores are renormalized to sum 1 when `norm_topk_prob`, then multiplied by
    `routed_scaling_factor`. Output = sum(weight * expert(x)) + shared_experts(x)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    sparse_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense MLP
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # fused into one MLP of num_shared * intermediate_size
    router_fp32: bool = False  # router weight kept and applied in float32 (DeepSeek)
    int4_group: int = 0  # routed experts held as packed INT4 with a scale per this many inputs
    fp8_block: tuple[int, int] | None = None  # routed experts held as FP8 with block scales

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; "
                             f"allowed: {list(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; "
                             f"allowed: {list(TOPK_METHODS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts "
                             f"{self.num_experts}]")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide n_routed_experts "
                             f"{self.num_experts} and topk_group {self.topk_group} must be in "
                             f"[1, n_group]")
        per_group = self.num_experts // self.n_group
        if self.topk_group * per_group < self.top_k:
            raise ValueError(f"topk_group {self.topk_group} groups of {per_group} experts "
                             f"cannot hold num_experts_per_tok {self.top_k}")


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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"allowed: {list(SUPPORTED_ARCHITECTURES)}"
            )
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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_pages=None` sizes the pool to hold `max_num_seqs` x
    `max_model_len` tokens, capped by `memory_bytes` (default: 256 MiB on CPU, half the free
    memory on GPU) and never below one `max_model_len` sequence. `prefix_caching`: requests
    reuse the full pages of prompts computed before (`kv/prefix_cache.py`)."""

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {self.num_pages}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0, got {self.memory_bytes}")

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def resolve_num_pages(
        self, max_num_seqs: int, max_model_len: int, bytes_per_token: int, device: torch.device
    ) -> int:
        if self.num_pages is not None:
            return self.num_pages
        budget = self.memory_bytes
        if budget is None:
            budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 1 << 28
        affordable = budget // (bytes_per_token * self.page_size)
        wanted = max_num_seqs * self.pages_for(max_model_len)
        return max(self.pages_for(max_model_len), min(wanted, affordable))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Prompt tokens prefilled per step; longer prompts are prefilled in chunks of this size.
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


SPEC_METHODS = ("none", "dflash", "ddtree")  # none: plain autoregressive decoding
SPEC_POLICIES = ("adaptive", "fixed")
TREE_SAMPLING_MODES = ("match", "rrs")


# Children a DDTree considers per node unless topk_cap says otherwise: large trees accept as
# much with 16 as uncapped and run faster (smaller top-k selections; measured in
# benchmarks/results/2026-12-04-oracle-gpu.md).
DEFAULT_TOPK_CAP = 16


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding with a DFlash drafter: a chain (`dflash`) or a DDTree per step."""

    method: str  # "dflash" (chain) | "ddtree" (tree)
    block_size: int
    tree_budget: int  # DDTree non-root nodes
    topk_cap: int | None = None  # DDTree: children considered per node (None: DEFAULT_TOPK_CAP)
    tree_sampling: str = "match"  # temperature > 0: sample-and-match | "rrs"
    policy: str = "adaptive"  # "adaptive": speculate where it is faster | "fixed": always

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS[1:]:
            raise ValueError(f"spec method {self.method!r}; allowed: {list(SPEC_METHODS[1:])}")
        if self.tree_sampling not in TREE_SAMPLING_MODES:
            raise ValueError(f"tree_sampling={self.tree_sampling!r}; allowed: "
                             f"{list(TREE_SAMPLING_MODES)}")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy={self.policy!r}; allowed: {list(SPEC_POLICIES)}")
        if self.block_size < 2 or self.tree_budget < 1:
            raise ValueError(f"block_size must be >= 2 and tree_budget >= 1, got "
                             f"{self.block_size} and {self.tree_budget}")

    @property
    def max_budget(self) -> int:
        """Draft candidates verified per request: tree nodes or chain drafts."""
        return self.tree_budget if self.method == "ddtree" else self.block_size - 1

    @property
    def lookahead(self) -> int:
        """Tokens a step writes past the committed ones: the draft block, and the candidates
        (a chain of block_size, or a tree of tree_budget + 1 nodes)."""
        verified = self.tree_budget + 1 if self.method == "ddtree" else self.block_size
        return max(self.block_size, verified) - 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine needs besides its models and tokenizer."""

    device: torch.device
    dtype: torch.dtype
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    spec: SpecConfig | None = None  # None: plain decoding
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (debugging)
