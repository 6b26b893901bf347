"""Frozen, validated configuration objects shared by every layer of the engine."""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_name(device: torch.device) -> str:
    """What the device is, for keys of machine-specific caches (e.g. cost profiles)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} {platform.processor()} x{torch.get_num_threads()} threads"


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
        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of one dense decoder (Llama / Qwen2 / Qwen3 family)."""

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
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_pages=None` sizes the pool to hold `max_num_seqs` x
    `max_model_len` tokens, capped by `memory_bytes` (default: 256 MiB on CPU, half the free
    memory on GPU) and never below one `max_model_len` sequence."""

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int | None = None

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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
