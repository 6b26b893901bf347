"""The dense decoder family: Llama (incl. Llama-3 RoPE scaling), Qwen2 (qkv bias) and Qwen3
(per-head q/k RMSNorm, explicit head_dim), tied or untied embeddings. One implementation,
switched by ModelConfig flags."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from flashtree.attention.backend import AttentionBackend
from flashtree.distributed import get_tp_size
from flashtree.layers import fused_kernels_apply
from flashtree.layers.activation import silu_mul
from flashtree.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flashtree.layers.linear import ColumnParallelLinear, RowParallelLinear
from flashtree.layers.norm import RMSNorm
from flashtree.layers.rotary import RotaryEmbedding, norm_rotary, write_rotary_kv
from flashtree.models.config import ModelConfig

RopeTables = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        tp = get_tp_size()
        self.layer = layer
        self.head_dim = cfg.head_dim
        if cfg.num_heads % tp or (tp % cfg.num_kv_heads if cfg.num_kv_heads < tp
                                  else cfg.num_kv_heads % tp):
            raise ValueError(
                f"tensor parallel size {tp} does not fit {cfg.num_heads} attention heads and "
                f"{cfg.num_kv_heads} KV heads: heads must divide by it, and KV heads divide "
                "by it or it by them")
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp)
        kv_replicas = max(1, tp // cfg.num_kv_heads)  # ranks sharing one KV head
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.qkv_bias,
            replicas=[1, kv_replicas, kv_replicas],
        )
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeTables, backend: AttentionBackend) -> torch.Tensor:
        # x: [n, hidden]; rope: cos, sin [n, 1, head_dim]
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        # A paged backend takes k roped straight into its cache, v beside it (drafter training's
        # block attention has no cache: it takes k and v).
        if fused_kernels_apply(k) and isinstance(backend, AttentionBackend):
            q = norm_rotary(q, *rope, self.q_norm)
            write_rotary_kv(k, v, *rope, self.k_norm, backend, self.layer)
            out = backend.attend(self.layer, q)  # [n, heads, hd]
        elif self.q_norm is None:  # q and k are adjacent in qkv: rope both in one pass
            heads = self.num_heads + self.num_kv_heads
            qk = norm_rotary(qkv[:, : heads * self.head_dim].view(n, heads, self.head_dim), *rope)
            out = backend.forward(self.layer, qk[:, : self.num_heads], qk[:, self.num_heads :], v)
        else:
            out = backend.forward(self.layer, norm_rotary(q, *rope, self.q_norm),
                                  norm_rotary(k, *rope, self.k_norm), v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block. Subclasses pick other attention / MLP modules (MLA, MoE)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.make_attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer)

    def make_attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Attention(cfg, layer)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg)

    def forward(self, x: torch.Tensor, rope: RopeTables, backend: AttentionBackend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, backend)
        normed, x = self.post_attention_layernorm.add_forward(attn, x)  # x = x + attn
        return x + self.mlp(normed)


# HF checkpoint name suffix -> (module attribute path suffix, shard index) for stacked weights.
STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class DecoderModel(nn.Module):
    """Decoder stack + LM head. `forward` returns the final hidden states of the requested rows
    and, when asked, the outputs of chosen decoder layers (for DFlash context features).
    Other families subclass it with their own `layer_cls` and `stacked` name table."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    stacked: dict[str, tuple[str, int]] = STACKED

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, self.norm.weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        capture_layers: tuple[int, ...] = (),
        on_captured: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [n] -> (final-normed hidden [n, hidden],
        [output of layer i for i in capture_layers], each [n, hidden]). `on_captured` is
        called with that list as soon as the last of those layers has run (work on it can
        then overlap the layers after)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions)
        captured: dict[int, torch.Tensor] = {}
        last = max(capture_layers, default=-1)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, backend)
            if i in capture_layers:
                captured[i] = x
                if i == last and on_captured is not None:
                    on_captured([captured[j] for j in capture_layers])
        return self.norm(x), [captured[i] for i in capture_layers]

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(KV heads on this rank, key width, value width) of one layer's paged cache entry."""
        return self.layers[0].self_attn.num_kv_heads, self.cfg.head_dim, self.cfg.head_dim

    def _skip_tensor(self, name: str) -> bool:
        """Checkpoint tensors (names without `model.`) this rank deliberately does not load."""
        return False

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        # hidden: [n, hidden] -> [n, vocab] in float32 (this rank's vocab slice if not gather)
        return self.lm_head(hidden, gather).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors. Unknown names and tensors left unloaded are errors that name
        them (in checkpoint naming); the LM head may be absent when embeddings are tied."""
        modules = dict(self.named_modules())
        expected = set(self._hf_parameter_names())
        loaded: set[str] = set()
        unknown: list[str] = []
        prefix = self.cfg.weight_prefix
        for hf_name, tensor in weights:
            if prefix and not hf_name.startswith(prefix):
                continue  # a multimodal wrapper's vision tower / projector
            name = hf_name.removeprefix(prefix).removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if self._skip_tensor(name):
                continue
            module_path, _, kind = name.rpartition(".")
            shard = 0
            for suffix, (target, index) in self.stacked.items():
                if module_path.endswith(suffix):
                    module_path, shard = module_path[: -len(suffix)] + target, index
                    break
            module = modules.get(module_path)
            if (
                not hasattr(module, "load_shard")
                or not isinstance(getattr(module, kind, None), nn.Parameter)
            ):
                unknown.append(hf_name)
                continue
            module.load_shard(hf_name, tensor, shard)
            loaded.add(name)
        packed = sorted(n for n in unknown if n.endswith(".weight_packed"))
        if packed:
            raise ValueError(f"INT4 (compressed-tensors) weights are supported for routed "
                             f"experts only; quantized here: {packed[:5]}")
        if unknown:
            raise ValueError(f"checkpoint has tensors this model does not know: {sorted(unknown)}")
        missing = sorted(n if n == "lm_head.weight" else f"model.{n}" for n in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing}")
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """Let layers lay out what they loaded for their kernels (MoE experts stacked)."""
        for module in self.modules():
            if module is not self and hasattr(module, "weights_loaded"):
                module.weights_loaded()

    def _hf_parameter_names(self) -> list[str]:
        """Checkpoint names (without the `model.` prefix) this model needs, stacked weights
        listed under their separate HF names."""
        unstack: dict[str, list[str]] = {}
        for hf_suffix, (target, _) in self.stacked.items():
            unstack.setdefault(target, []).append(hf_suffix)
        names = []
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            module_path, _, kind = name.rpartition(".")
            for target, sources in unstack.items():
                if module_path.endswith(target):
                    prefix = module_path[: -len(target)]
                    names.extend(f"{prefix}{src}.{kind}" for src in sources)
                    break
            else:
                names.append(name)
        return names
