"""Random-weight targets and DFlash drafters of real shapes, built directly on the device (no
checkpoint written), for benchmarks with the acceptance oracle.

The target is made decisive, so that plain decoding, chain verify and tree verify pick the
same greedy token although their kernels round differently. Scaling the LM head alone cannot
do that: rounding errors scale with the logits. Instead the residual stream stays close to the
current token's embedding (unit-variance embeddings, small output projections) and the LM head
is the embedding table in a random order: the next token is the permutation's image of the
current one, with a top-2 logit gap of about `hidden_size` against noise of a few units
(`top2_gaps` measures it). Every matrix keeps its real shape, so every kernel costs what it
costs on the real model; attention, MLPs and the drafter all run on real data."""

from __future__ import annotations

import torch

from flashtree.config import ModelConfig
from flashtree.models.dflash import DFlashConfig, DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.models.loader import model_class

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=1e4,
            max_position_embeddings=4096)
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
SHAPES = {"qwen3-8b": QWEN3_8B, "tiny": TINY, "qwen3-30b-a3b": QWEN3_30B_A3B,
          "tiny-moe": TINY_MOE}
_COMMON = dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
_INPUT_STD = 0.02
# Output projections (o_proj, down_proj) draw N(0, scale^2 / fan_in). The target's layers move
# its unit-variance residual by a few percent (it stays near the token's embedding); the
# drafter's overwrite theirs, so that its output is not the mask token's embedding, which is
# one row of the shared LM head and would otherwise win every slot.
_TARGET_RESIDUAL_SCALE = 0.05
_DRAFTER_RESIDUAL_SCALE = 20.0


def _fill(module: torch.nn.Module, gen: torch.Generator, residual_scale: float,
          skip: tuple[str, ...] = ()) -> None:
    """In place: norms 1, output projections N(0, residual_scale^2 / fan_in), every other
    matrix N(0, 0.02^2)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(skip):
                continue
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            std = _INPUT_STD
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = residual_scale / p.shape[1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)


def random_target(shape: dict, dtype: torch.dtype, device: torch.device | str, seed: int = 1
                  ) -> tuple[DecoderModel, ModelConfig]:
    """A decisive target of `shape` (a config dict, e.g. QWEN3_8B; Qwen3 unless it names its
    architecture), its MoE experts stacked as after a load."""
    cfg = ModelConfig.from_hf({**_COMMON, **shape})
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = model_class(cfg)(cfg)
    model.to(dtype)
    _fill(model, gen, _TARGET_RESIDUAL_SCALE, skip=("embed_tokens", "lm_head"))
    with torch.no_grad():
        emb = model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen, device=emb.device))
        order = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
        model.lm_head.weight.copy_(emb[order])  # token order[v] is followed by v
    model.weights_loaded()
    return model.eval(), cfg


def random_drafter(target_cfg: ModelConfig, shape: dict, dtype: torch.dtype,
                   device: torch.device | str, layers: int = 5, block_size: int = 16,
                   logit_std: float = 10.0, seed: int = 2) -> DFlashDraftModel:
    """A DFlash drafter for `target_cfg` with `layers` Qwen3 layers of `shape` and five tapped
    target layers, as the Qwen3-8B drafter has. Its final norm is set so that its logits over
    the target's LM head spread with standard deviation `logit_std` (10: over a 152k vocabulary
    its top token then holds 65-75% of the mass, a confident drafter's guess)."""
    n = target_cfg.num_layers
    taps = sorted({round(1 + i * (n - 3) / 4) for i in range(5)})
    cfg = DFlashConfig.from_hf({
        **shape, **_COMMON, "num_hidden_layers": layers, "architectures": ["DFlashDraftModel"],
        "block_size": block_size, "layer_types": ["full_attention"] * layers,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": shape["vocab_size"] - 1}})
    gen = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        drafter = DFlashDraftModel(cfg)
    drafter.to(dtype)
    _fill(drafter, gen, _DRAFTER_RESIDUAL_SCALE)
    with torch.no_grad():  # unit-variance LM head rows: logits ~ N(0, (norm * sqrt(hidden))^2)
        drafter.norm.weight.fill_(logit_std / target_cfg.hidden_size ** 0.5)
    return drafter.eval()


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the top-1 logit minus the top-2 logit ([N, V] -> [N])."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
