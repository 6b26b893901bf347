"""Tiny random checkpoints written by transformers itself, in the real on-disk format."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(path: Path, seed: int = 0, vocab_size: int = 64, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
