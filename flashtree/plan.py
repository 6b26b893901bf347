"""`flashtree plan`: parameter counts and per-GPU memory of a target (and drafter) under
tensor / expert parallelism, from config.json alone (no weights read).

The layout counted is the one flashtree builds (see layers/moe.py, models/deepseek_v3.py):
vocab-parallel embedding and LM head; attention heads split over TP (MLA: q_a / kv_a and their
norms replicated, so is the one-head latent cache); dense MLPs and shared experts sliced over TP;
routed experts split into `ep` groups, each expert sliced over tp / ep ranks, so every GPU holds
1 / tp of the routed-expert weights whatever `ep` is (EP changes how each expert is cut, and thus
the GEMM shapes and the load balance, not the bytes); routers and norms replicated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


@dataclass(frozen=True)
class Part:
    name: str
    params: int  # whole model
    per_gpu: int  # on one rank
    active: int  # used by one token (routed experts: top_k of them)
    kind: str = "linear"  # "linear" | "expert" | "embedding" | "plain": for stored precision


def _read(path: str | Path) -> dict:
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{path} is neither a config.json nor a directory holding one")
    return json.loads(p.read_text())


def _check_layout(cfg: ModelConfig, tp: int, ep: int) -> None:
    if tp < 1 or ep < 1 or tp % ep:
        raise ValueError(f"--ep {ep} must be >= 1 and divide --tp {tp}")
    if cfg.num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide {cfg.num_heads} attention heads")
    if cfg.moe is not None:
        if cfg.moe.num_experts % ep:
            raise ValueError(f"--ep {ep} does not divide {cfg.moe.num_experts} routed experts")
        if cfg.moe.intermediate_size % (tp // ep):
            raise ValueError(f"moe_intermediate_size {cfg.moe.intermediate_size} does not split "
                             f"into tp / ep = {tp // ep} parts")


def _attention(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(params, params per GPU) of one attention block."""
    h, heads = cfg.hidden_size, cfg.num_heads
    m = cfg.mla
    if m is not None:
        split = heads * m.qk_head_dim * (m.q_lora_rank or h)  # q_b or q_proj
        split += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b
        split += heads * m.v_head_dim * h  # o_proj
        replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        if m.q_lora_rank is not None:
            replicated += h * m.q_lora_rank + m.q_lora_rank
        return split + replicated, split // tp + replicated
    hd, kv = cfg.head_dim, cfg.num_kv_heads
    q_o = 2 * h * heads * hd
    k_v = 2 * h * kv * hd
    norms = 2 * hd if cfg.qk_norm else 0
    return q_o + k_v + norms, q_o // tp + 2 * h * max(1, kv // tp) * hd + norms


def target_parts(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> list[Part]:
    _check_layout(cfg, tp, ep)
    h, v, n_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    vocab_rows = -(-v // tp)
    parts = [Part("embedding", v * h, vocab_rows * h, v * h, "embedding")]
    if not cfg.tie_word_embeddings:
        parts.append(Part("lm_head", v * h, vocab_rows * h, v * h, "embedding"))
    attn, attn_gpu = _attention(cfg, tp)
    parts.append(Part("attention", attn * n_layers, attn_gpu * n_layers, attn * n_layers))
    sparse = cfg.moe.sparse_layers if cfg.moe else (False,) * n_layers
    n_sparse = sum(sparse)
    dense = 3 * h * cfg.intermediate_size * (n_layers - n_sparse)
    if dense:
        parts.append(Part("dense_mlp", dense, dense // tp, dense))
    moe = cfg.moe
    if moe is not None and n_sparse:
        expert = 3 * h * moe.intermediate_size
        routed = expert * moe.num_experts * n_sparse
        parts.append(Part("routed_experts", routed, routed // tp,
                          expert * moe.top_k * n_sparse, "expert"))
        if moe.num_shared_experts:
            shared = expert * moe.num_shared_experts * n_sparse
            parts.append(Part("shared_experts", shared, shared // tp, shared))
        router = (moe.num_experts * h + (moe.num_experts if moe.topk_method == "noaux_tc"
                                         else 0)) * n_sparse
        parts.append(Part("routers", router, router, router, "plain"))
    norms = (2 * n_layers + 1) * h
    parts.append(Part("norms", norms, norms, norms, "plain"))
    return parts


def drafter_parts(d: DFlashConfig, tp: int = 1) -> list[Part]:
    """A DFlash drafter: Qwen3 layers (sharded like the target's) + fc + norms; it borrows the
    target's embedding and LM head."""
    lc = d.layers
    if lc.num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide the drafter's {lc.num_heads} heads")
    attn, attn_gpu = _attention(lc, tp)
    mlp = 3 * lc.hidden_size * lc.intermediate_size
    layers = lc.num_layers
    fc = len(d.target_layer_ids) * lc.hidden_size * lc.hidden_size
    norms = (2 * layers + 2) * lc.hidden_size
    return [
        Part("draft_layers", (attn + mlp) * layers, (attn_gpu + mlp // tp) * layers,
             (attn + mlp) * layers),
        Part("draft_fc", fc, fc, fc),
        Part("draft_norms", norms, norms, norms, "plain"),
    ]


def kv_bytes_per_token(cfg: ModelConfig, tp: int, dtype_bytes: int) -> int:
    """Paged-cache bytes one token takes on ONE GPU over all layers."""
    if cfg.mla is not None:  # one latent head, replicated on every TP rank
        return cfg.num_layers * cfg.mla.latent_dim * dtype_bytes
    return 2 * cfg.num_layers * max(1, cfg.num_kv_heads // tp) * cfg.head_dim * dtype_bytes


def _loaded_bytes(part: Part, cfg: ModelConfig, dtype_bytes: int) -> float:
    """Bytes per parameter as flashtree holds it: routed experts at checkpoint precision (INT4
    or FP8 kept), everything else in the model dtype (FP8 dense weights dequantized at load)."""
    if cfg.quantization in ("compressed-tensors", "fp8") and part.kind == "expert":
        return _stored_bytes(part, cfg, dtype_bytes)
    return dtype_bytes


def _stored_bytes(part: Part, cfg: ModelConfig, dtype_bytes: int) -> float:
    """Bytes per parameter as the checkpoint stores it."""
    q = cfg.quantization
    if q == "compressed-tensors" and part.kind == "expert":
        return 0.5 + 2 / 32  # int4 + one bf16 scale per 32 (Kimi K2.5 / K2.6 experts)
    if q == "fp8" and part.kind in ("linear", "expert"):
        bo, bi = cfg.quant_block
        return 1 + 4 / (bo * bi)  # e4m3 + one fp32 scale per block
    return dtype_bytes


@dataclass(frozen=True)
class Plan:
    cfg: ModelConfig
    tp: int
    ep: int
    dtype: str
    parts: list[Part]
    kv_per_token: int  # target + drafter, per GPU
    gpu_bytes: int
    usable_fraction: float
    drafter: DFlashConfig | None = None

    @property
    def total_params(self) -> int:
        return sum(p.params for p in self.parts if not p.name.startswith("draft"))

    @property
    def active_params(self) -> int:
        return sum(p.active for p in self.parts if not p.name.startswith("draft"))

    @property
    def weight_bytes_per_gpu(self) -> int:
        b = DTYPE_BYTES[self.dtype]
        return int(sum(p.per_gpu * _loaded_bytes(p, self.cfg, b) for p in self.parts))

    @property
    def stored_bytes_per_gpu(self) -> int:
        b = DTYPE_BYTES[self.dtype]
        return int(sum(p.per_gpu * _stored_bytes(p, self.cfg, b) for p in self.parts))

    def kv_tokens(self, weight_bytes: int) -> int:
        budget = int(self.gpu_bytes * self.usable_fraction) - weight_bytes
        return max(0, budget // self.kv_per_token)


def make_plan(config: str | Path, draft: str | Path | None = None, tp: int = 1, ep: int = 1,
              dtype: str = "bfloat16", gpu_memory_gib: float = 139.0,
              usable_fraction: float = 0.9) -> Plan:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {list(DTYPE_BYTES)}")
    cfg = ModelConfig.from_hf(_read(config))
    parts = target_parts(cfg, tp, ep)
    b = DTYPE_BYTES[dtype]
    kv = kv_bytes_per_token(cfg, tp, b)
    dcfg = None
    if draft is not None:
        dcfg = DFlashConfig.from_hf(_read(draft))
        dcfg.check_target(cfg)
        parts += drafter_parts(dcfg, tp)
        kv += kv_bytes_per_token(dcfg.layers, tp, b)
    return Plan(cfg, tp, ep, dtype, parts, kv, int(gpu_memory_gib * GIB), usable_fraction, dcfg)


def format_plan(plan: Plan) -> str:
    cfg, b = plan.cfg, DTYPE_BYTES[plan.dtype]
    moe = cfg.moe
    lines = [
        f"model: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}"
        + (f", {moe.num_experts} experts top-{moe.top_k} + {moe.num_shared_experts} shared"
           if moe else "")
        + (f", MLA latent {cfg.mla.latent_dim}" if cfg.mla else ""),
        f"parameters: {plan.total_params / 1e9:,.1f}B total, {plan.active_params / 1e9:,.1f}B "
        "active per token",
        f"layout: --tp {plan.tp} --ep {plan.ep}"
        + (f" ({moe.num_experts // plan.ep} experts per GPU, each sliced over "
           f"{plan.tp // plan.ep} GPU(s))" if moe else ""),
        f"per GPU, weights as flashtree loads them ({plan.dtype}; quantized routed experts "
        "stay at checkpoint precision, other quantized weights are dequantized at load):",
    ]
    for p in plan.parts:
        loaded = p.per_gpu * _loaded_bytes(p, cfg, b)
        lines.append(f"  {p.name:<16} {p.per_gpu / 1e9:10.3f}B params {loaded / GIB:9.2f} GiB")
    w = plan.weight_bytes_per_gpu
    lines.append(f"  {'total':<16} {'':>17} {w / GIB:9.2f} GiB")
    at_checkpoint = plan.stored_bytes_per_gpu != w
    if at_checkpoint:
        lines.append(f"  at checkpoint precision ({cfg.quantization}): "
                     f"{plan.stored_bytes_per_gpu / GIB:.2f} GiB (needs quantized kernels for "
                     "the dense layers; not what flashtree loads today)")
    lines.append(f"KV cache per token per GPU: {plan.kv_per_token:,} B"
                 + (" (target MLA latent" if cfg.mla else " (target K/V")
                 + (" + drafter K/V)" if plan.drafter else ")"))
    budget = plan.gpu_bytes * plan.usable_fraction / GIB
    views = [("as loaded", w)]
    if at_checkpoint:
        views.append(("at checkpoint precision", plan.stored_bytes_per_gpu))
    for label, weights in views:
        tokens = plan.kv_tokens(weights)
        verdict = (f"KV budget {budget - weights / GIB:.1f} GiB = {tokens:,} tokens"
                   if tokens else "DOES NOT FIT: weights exceed the usable memory")
        lines.append(f"GPU {plan.gpu_bytes / GIB:.0f} GiB x {plan.usable_fraction:.0%} usable, "
                     f"{label}: {verdict}")
    return "\n".join(lines)
