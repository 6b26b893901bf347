"""A tiny target/drafter pair that agrees often enough for speculation to accept whole blocks.

Both models get a bias channel: hidden dimension 0 is 1 in every token's embedding, and no
layer of either model writes to it, so the final norm always passes a positive multiple of it
to the LM head, whose column 0 is `PREFERENCE`. The target's logits are PREFERENCE plus the
context-dependent rest of a random model; the drafter's rest is damped, so its proposals follow
PREFERENCE too (q(0) between 0.5 and 0.75), and whole blocks of drafts are often accepted."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny import save_reference_drafter, save_tiny_qwen3

PREFERENCE = [1.5, 0.5, 0.0, -0.5, -1.0]  # LM head column 0: token 0 first, then 1, 2, 3, 4
# Drafter final-norm gains: its residual's rms is 14 to 36 (initializer range 0.5), so a gain of
# 25 on the bias channel gives draft logits about the size of the target's; the other channels
# keep a tenth of their gain, so drafts still depend a little on the context.
DRAFT_BIAS_GAIN, DRAFT_REST_GAIN = 25.0, 0.1


def _edit(path: Path, edit) -> None:
    file = path / "model.safetensors"
    weights = load_file(file)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[0] = 0  # no layer writes to the bias channel
    edit(weights)
    save_file(weights, file, metadata={"format": "pt"})


def _target(weights: dict[str, torch.Tensor]) -> None:
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["lm_head.weight"][:, 0] = torch.tensor(PREFERENCE)


def _drafter(weights: dict[str, torch.Tensor]) -> None:
    weights["norm.weight"][1:] *= DRAFT_REST_GAIN
    weights["norm.weight"][0] = DRAFT_BIAS_GAIN


def save_agreeing_pair(root: Path, block_size: int) -> tuple[Path, Path]:
    """A Qwen3 target over 5 tokens and a reference DFlash drafter (the `dflash` package's own
    format) of `block_size`, both edited as the module docstring says."""
    target = save_tiny_qwen3(root / "t", seed=11, vocab_size=5, initializer_range=0.15)
    drafter = save_reference_drafter(root / "d", target, seed=12, block_size=block_size,
                                     initializer_range=0.5)
    _edit(target, _target)
    _edit(drafter, _drafter)
    return target, drafter
