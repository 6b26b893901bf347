"""The engine's frozen, validated configuration: scheduler, KV cache, speculative decoding.
What a checkpoint says about its model is in `models/config.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
class CacheConfig:
    """Paged KV cache geometry and size (`runner/kv_pool.py`). `num_pages` given is the pool;
    else it holds `max_num_seqs` x `max_model_len` tokens within a memory budget, never below
    one `max_model_len` sequence. The budget: `memory_bytes`; or on a GPU
    `gpu_memory_utilization`, vLLM's share of the GPU's total memory for the whole engine
    (weights, activations and the pool); by default half the free GPU memory, or on a CPU a
    share of the memory available. At most one of the three is given.
    `prefix_caching`: requests reuse the full pages of prompts computed before
    (`kv/prefix_cache.py`)."""

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int | None = None
    prefix_caching: bool = True
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {self.num_pages}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0, got {self.memory_bytes}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:  # NaN fails too
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share}")
        sizes = [name for name in ("num_pages", "memory_bytes", "gpu_memory_utilization")
                 if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"{' and '.join(sizes)} each size the KV pool; give one")

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)


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
# benchmarks/results/archive/2026-12-04-oracle-gpu.md).
DEFAULT_TOPK_CAP = 16
# The smallest DDTree budget an engine keeps graphs for below its own (`SpecConfig.budgets`).
MIN_LADDER_BUDGET = 3


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
    def budgets(self) -> tuple[int, ...]:
        """The draft budgets a step may verify, largest first: a chain's drafts, or DDTree's
        budget and each quarter below it down to 3 nodes (255, 63, 15, 3), among which the
        adaptive policy picks per batch size (each costs a set of captured graphs)."""
        if self.method != "ddtree":
            return (self.max_budget,)
        ladder = [self.tree_budget]
        while (ladder[-1] + 1) // 4 - 1 >= MIN_LADDER_BUDGET:
            ladder.append((ladder[-1] + 1) // 4 - 1)
        return tuple(ladder)

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
    # Queue each greedy plain decode step before the step before it reads its tokens
    # (`engine/decode_ahead.py`). None: on CUDA only (on a CPU nothing runs meanwhile, so it
    # gains nothing there); True forces it on (tests on a CPU).
    overlap_decode: bool | None = None

    @property
    def overlaps_decode(self) -> bool:
        """`overlap_decode` resolved on this device."""
        return self.device.type == "cuda" if self.overlap_decode is None else self.overlap_decode
