"""DFlash block drafter (z-lab `DFlashDraftModel` checkpoints).

Qwen3-style decoder layers without embedding or LM head: the block `[bonus, mask x (B-1)]` is
embedded with the TARGET's embedding and scored with the TARGET's LM head. Every draft layer
attends to context K/V built from the target's hidden states of committed tokens:
`ctx = hidden_norm(fc(concat(outputs of target layers target_layer_ids)))`, then per layer
`K = rope(k_norm(k_proj(ctx)))`, `V = v_proj(ctx)`, stored in the draft's paged KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.attention.backend import AttentionBackend
from flashtree.layers.norm import RMSNorm
from flashtree.layers.rotary import RotaryEmbedding, norm_rotary
from flashtree.models.config import ModelConfig
from flashtree.models.llama import STACKED, DecoderLayer
from flashtree.models.loader import iter_safetensors, safetensors_files

# Fields of later drafter families (DFlash2 conv/selector, speculators vocab maps) whose models
# this implementation does not run. A checkpoint carrying one is refused, never mis-run.
_UNSUPPORTED_FIELDS = (
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "draft_vocab_size",
    "attention_sink_bias", "attention_value_scale",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced taps from layer 1 to L-3 (the reference's rule when a config has none)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class ContextProjection:
    """The drafter's context K/V projection for all layers at once (`context_projection`):
    weight [layers * 2 * kv_heads * head_dim, hidden] (each layer's k rows then v rows), bias
    or None, the layers' key-norm weights [layers, head_dim] (None without) and their eps."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    key_norms: torch.Tensor | None = None
    eps: float = 0.0


@dataclass(frozen=True)
class DFlashConfig:
    layers: ModelConfig  # geometry of the Qwen3-style draft layers
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    layer_causal: tuple[bool, ...]  # causal inside the block per layer
    vocab_size: int | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> DFlashConfig:
        if "DFlashDraftModel" not in (cfg.get("architectures") or []):
            raise ValueError(
                f"draft architectures {cfg.get('architectures')} is not a DFlash drafter; "
                "allowed: ['DFlashDraftModel']"
            )
        dflash = cfg.get("dflash_config") or {}

        def value(name: str, default=None):
            return dflash.get(name, cfg.get(name, default))

        bad = [f for f in _UNSUPPORTED_FIELDS if value(f) is not None]
        if value("projector_type") not in (None, "linear"):
            bad.append(f"projector_type={value('projector_type')!r}")
        if bad:
            raise ValueError(
                f"drafter uses features flashtree does not implement: {bad}; supported: plain "
                "DFlash drafters (fc + hidden_norm projector, Qwen3 layers)"
            )
        num_layers = int(cfg["num_hidden_layers"])
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            if value("num_target_layers") is None:
                raise ValueError(
                    "drafter config has neither target_layer_ids nor num_target_layers"
                )
            layer_ids = default_target_layer_ids(int(value("num_target_layers")), num_layers)
        mask_id = value("mask_token_id")
        if mask_id is None:
            raise ValueError("drafter config has no mask_token_id (top level or in dflash_config)")
        layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
        if len(layer_types) != num_layers or any(
            t not in ("full_attention", "sliding_attention") for t in layer_types
        ):
            raise ValueError(
                f"layer_types {layer_types} must list {num_layers} entries of 'full_attention' "
                "or 'sliding_attention'"
            )
        window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise ValueError("drafter has sliding_attention layers but no sliding_window")
        causal_override = value("is_causal", value("causal"))
        layer_causal = tuple(
            (t == "sliding_attention") if causal_override is None else bool(causal_override)
            for t in layer_types
        )
        softcap = value("final_logit_softcapping")
        geometry = dict(cfg, architectures=["Qwen3ForCausalLM"])
        geometry.setdefault("vocab_size", 1)
        return DFlashConfig(
            layers=ModelConfig.from_hf(geometry),
            block_size=int(value("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            mask_token_id=int(mask_id),
            layer_windows=tuple(
                int(window) if t == "sliding_attention" else None for t in layer_types
            ),
            layer_causal=layer_causal,
            vocab_size=cfg.get("vocab_size"),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a drafter that cannot run against `target`, naming the mismatch."""
        if self.layers.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.layers.hidden_size} does not match the target's "
                f"{target.hidden_size}; a DFlash drafter must have the target's width"
            )
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter vocab_size {self.vocab_size} does not match the target's "
                f"{target.vocab_size}; the drafter scores with the target's LM head"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                f"[0, {target.vocab_size})"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {list(self.target_layer_ids)} include {bad}, beyond the "
                f"target's {target.num_layers} layers (allowed: 0..{target.num_layers - 1})"
            )


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        lc = cfg.layers
        self.layers = nn.ModuleList(DecoderLayer(lc, i) for i in range(lc.num_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size, bias=False)
        self.fc.weight.requires_grad_(False)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.rotary = RotaryEmbedding(lc.rope, lc.head_dim, self.norm.weight.device)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V of committed tokens.
        features: [n, len(target_layer_ids) * hidden]; positions: [n] ->
        [(k, v) per layer], each [n, kv_heads, head_dim]."""
        ctx = self.hidden_norm(self.fc(features))  # [n, hidden]
        cos, sin = self.rotary.cos_sin(positions)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            q_size = attn.qkv_proj.shard_sizes[0]
            bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[q_size:]
            kv = F.linear(ctx, attn.qkv_proj.weight[q_size:], bias)  # k/v rows only
            k, v = kv.view(ctx.shape[0], 2 * attn.num_kv_heads, attn.head_dim).chunk(2, dim=1)
            out.append((norm_rotary(k, cos, sin, attn.k_norm), v))
        return out

    def context_projection(self) -> ContextProjection:
        """Every layer's K/V rows of its QKV projection stacked, layer by layer (k then v), and
        the layers' key norms, for `write_context_kv`."""
        weights, biases, norms = [], [], []
        for layer in self.layers:
            attn = layer.self_attn
            q_size = attn.qkv_proj.shard_sizes[0]
            weights.append(attn.qkv_proj.weight[q_size:])
            biases.append(None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[q_size:])
            norms.append(attn.k_norm)
        bias = None if biases[0] is None else torch.cat(biases)
        if norms[0] is None:
            return ContextProjection(torch.cat(weights), bias)
        assert len({n.eps for n in norms}) == 1, "the drafter's key norms differ in eps"
        return ContextProjection(torch.cat(weights), bias,
                                 torch.stack([n.weight for n in norms]), norms[0].eps)

    def write_context_kv(
        self, features: torch.Tensor, positions: torch.Tensor, projection: ContextProjection,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    ) -> None:
        """`context_kv` written to rows `slots` of every layer's cache (CUDA): one projection
        for all layers (`context_projection()`) and one norm-rope-and-write kernel for all
        layers, where `context_kv` and the writes take four launches per layer.
        features: [n, F]; positions, slots: [n]; caches: [layers, cache slots, kv_heads, dim]."""
        from flashtree.layers.fused import norm_rope_to_layer_caches

        ctx = self.hidden_norm(self.fc(features))  # [n, hidden]
        cos, sin = self.rotary.cos_sin(positions)
        attn = self.layers[0].self_attn
        kv = F.linear(ctx, projection.weight, projection.bias).view(
            ctx.shape[0], len(self.layers), 2 * attn.num_kv_heads, attn.head_dim)
        k, v = kv.chunk(2, dim=2)  # [n, layers, kv_heads, head_dim] each
        norm_rope_to_layer_caches(k, v, cos, sin, k_cache, v_cache, slots,
                                  projection.key_norms, projection.eps)

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        backends: list[AttentionBackend],
    ) -> torch.Tensor:
        """block_embeds: [n, hidden] (target embedding of the blocks, all requests packed);
        positions: [n]; backends: one per layer, prepared with that layer's mask kind ->
        final-normed draft hidden [n, hidden]."""
        x = block_embeds * self.cfg.input_embedding_scale
        rope = self.rotary.cos_sin(positions)
        for layer, backend in zip(self.layers, backends, strict=True):
            x = layer(x, rope, backend)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module, gather: bool = True
               ) -> torch.Tensor:
        """Score draft hidden states with the target's LM head. -> [n, vocab] float32 (the TP
        rank's vocab slice unless `gather`; the transforms below are elementwise)."""
        logits = lm_head(hidden, gather).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights) -> None:
        """z-lab names (no `model.` prefix): layers.N.*, fc.weight, hidden_norm.weight,
        norm.weight. Unknown or missing tensors are errors that name them."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        # Checkpoint leaf name -> (stacked module leaf, part), from the target's own table.
        stacked = {src.rpartition(".")[2]: (dst.rpartition(".")[2], part)
                   for src, (dst, part) in STACKED.items()}
        expected = {n for n in params}
        expected_shards = {}
        loaded, unknown = set(), []
        for name, tensor in weights:
            key = name.removeprefix("model.")
            path, _, kind = key.rpartition(".")
            head, _, leaf = path.rpartition(".")
            shard = 0
            if leaf in stacked:
                leaf, shard = stacked[leaf]
                path = f"{head}.{leaf}"
            module = modules.get(path)
            if module is self.fc and kind == "weight":
                if tensor.shape != self.fc.weight.shape:
                    raise ValueError(
                        f"tensor fc.weight has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(self.fc.weight.shape)} (hidden x taps*hidden)"
                    )
                self.fc.weight.data.copy_(tensor)
            elif module is not None and hasattr(module, "load_shard") and getattr(
                module, kind, None
            ) is not None:
                module.load_shard(name, tensor, shard)
            else:
                unknown.append(name)
                continue
            loaded.add(f"{path}.{kind}")
            expected_shards.setdefault(f"{path}.{kind}", set()).add(shard)
        if unknown:
            raise ValueError(f"drafter checkpoint has tensors this model does not know: {unknown}")
        missing = sorted(expected - loaded)
        for full, shards in expected_shards.items():
            module = modules[full.rpartition(".")[0]]
            need = len(getattr(module, "shard_sizes", [0]))
            if len(shards) != need:
                missing.append(f"{full} (got {len(shards)} of {need} stacked parts)")
        if missing:
            raise ValueError(f"drafter checkpoint is missing tensors: {missing}")


class DFlashDrafter:
    """The drafter in the shape a ModelRunner drives, `DecoderModel`'s: token ids in through
    the target's embedding, logits out through the target's LM head. Its layers' mask kinds
    (`layer_kinds`) are its own: the runner's backend gives each layer its kind's."""

    def __init__(self, draft: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module
                 ) -> None:
        self.draft, self.embed_tokens, self.lm_head = draft, embed_tokens, lm_head
        cfg = draft.cfg
        self.layer_kinds = tuple(zip(cfg.layer_causal, cfg.layer_windows))

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        capture_layers: tuple[int, ...] = (),
        on_captured: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [n] (the blocks, all requests packed) -> (final-normed draft
        hidden [n, hidden], no captured layers)."""
        assert not capture_layers and on_captured is None, "the drafter's layers are not read"
        embeds = self.embed_tokens(input_ids)  # [n, hidden]
        return self.draft(embeds, positions, [backend] * len(self.draft.layers)), []

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        return self.draft.logits(hidden, self.lm_head, gather)


def load_dflash_drafter(
    path: str | Path, dtype: torch.dtype, device: torch.device
) -> DFlashDraftModel:
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter {str(path)!r} has no config.json; pass a DFlash dir")
    cfg = DFlashConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device(device):
        model = DFlashDraftModel(cfg)
    model.to(dtype)
    model.load_weights(iter_safetensors(safetensors_files(path)))
    return model.eval()
