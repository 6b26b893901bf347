"""Tiny random checkpoints written by transformers itself, in the real on-disk format."""

from __future__ import annotations

from pathlib import Path

import torch

# Prompts over a 5-token vocabulary for the tiny target/drafter pairs: ragged lengths, one token.
TINY_PROMPTS = [[1, 2, 3, 4, 0, 1, 2], [3, 3, 1], [0, 4, 2, 2, 1, 3, 0, 1, 4, 2, 3, 1, 0], [2]]

_TINY = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
    eos_token_id=None, pad_token_id=None,
)


def _save_tiny(family: str, path: Path, seed: int, **cfg) -> Path:
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**_TINY, **cfg})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_llama(path: Path, seed: int = 0, vocab_size: int = 64, **overrides) -> Path:
    return _save_tiny("Llama", path, seed,
                      **{"vocab_size": vocab_size, "num_hidden_layers": 2, **overrides})


def save_tiny_qwen3(path: Path, seed: int = 0, vocab_size: int = 64, **overrides) -> Path:
    return _save_tiny("Qwen3", path, seed, **{"vocab_size": vocab_size,
                                               "num_hidden_layers": 4, "head_dim": 8,
                                               **overrides})


def save_reference_drafter(
    path: Path, target_dir: Path, seed: int = 0, block_size: int = 8,
    layer_types: list[str] | None = None, sliding_window: int | None = None,
    target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
    **overrides,
) -> Path:
    """A random DFlash drafter built and saved by z-lab's reference package (`dflash`)."""
    import json

    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    target = json.loads((Path(target_dir) / "config.json").read_text())
    layers = len(layer_types) if layer_types else 2
    cfg = Qwen3Config(
        vocab_size=target["vocab_size"], hidden_size=target["hidden_size"], intermediate_size=48,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, rms_norm_eps=1e-6,
        layer_types=layer_types or ["full_attention"] * layers, sliding_window=sliding_window,
        use_sliding_window=sliding_window is not None, **overrides,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = block_size
    cfg.num_target_layers = target["num_hidden_layers"]
    cfg.dflash_config = {
        "target_layer_ids": target_layer_ids or [0, target["num_hidden_layers"] - 2],
        "mask_token_id": target["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
    }
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


_TINY_MOE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=512,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)


def _save_moe(family: str, path: Path, seed: int, cfg: dict) -> Path:
    """Norm weights and DeepSeek's selection bias are re-drawn (transformers initializes them to
    ones and zeros), so a loader that drops or misplaces them changes the logits."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_qwen3_moe(path: Path, seed: int = 0, **overrides) -> Path:
    """Qwen3-MoE: softmax router over 8 experts, top-2, q/k norm."""
    return _save_moe("Qwen3Moe", path, seed, {
        **_TINY_MOE, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, **overrides})


def save_tiny_deepseek_v3(path: Path, seed: int = 0, **overrides) -> Path:
    """DeepSeek-V3 / Kimi K2 geometry in miniature: MLA (q and kv LoRA, split nope/rope head
    dims, v_head_dim != qk dims), one dense first layer, sigmoid routing over 8 experts in 4
    groups with a shared expert."""
    return _save_moe("DeepseekV3", path, seed, {
        **_TINY_MOE, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 12, "routed_scaling_factor": 2.5, "norm_topk_prob": True, **overrides})
