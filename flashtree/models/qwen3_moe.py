"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (per-head q/k RMSNorm) with a softmax-routed
mixture of experts in the layers `decoder_sparse_step` / `mlp_only_layers` select."""

from __future__ import annotations

import re

from torch import nn

from flashtree.layers.moe import SparseMoE
from flashtree.models.config import ModelConfig
from flashtree.models.llama import MLP, STACKED, DecoderLayer, DecoderModel

# Experts and shared experts name their projections gate_proj / up_proj / down_proj too: match
# on the last path component.
MOE_STACKED = {
    **{k: v for k, v in STACKED.items() if k.startswith("self_attn.")},
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}

_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def skip_moe_tensor(model: DecoderModel, name: str) -> bool:
    """Routed experts another expert-parallel rank holds, and layers past the decoder stack
    (DeepSeek's multi-token-prediction layer `model.layers.{num_layers}`), are not loaded."""
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= model.cfg.num_layers:
        return True
    expert = _EXPERT.match(name)
    if expert:
        mlp = model.layers[int(expert.group(1))].mlp
        return isinstance(mlp, SparseMoE) and not mlp.owns(int(expert.group(2)))
    return False


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        assert cfg.moe is not None, "a MoE layer needs ModelConfig.moe"
        if cfg.moe.sparse_layers[layer]:
            return SparseMoE(cfg.moe, cfg.hidden_size)
        return MLP(cfg)


class Qwen3MoeModel(DecoderModel):
    layer_cls = MoEDecoderLayer
    stacked = MOE_STACKED

    def _skip_tensor(self, name: str) -> bool:
        return skip_moe_tensor(self, name)
