"""Configs of the layers that a model config parametrizes per family: rotary embeddings
(parsed from the checkpoint's config.json here) and routed experts. They live below `models/`
so that `layers/` reads them without importing a higher layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
