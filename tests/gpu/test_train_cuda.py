"""Drafter training on CUDA: validation (no autograd, where the fused Triton kernels replace the
eager ops in the target and the drafter) computes the same block loss as a training step (eager,
with autograd) on the same batch and anchors. Skips without CUDA or triton."""

from __future__ import annotations

import random

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree import LLM  # noqa: E402
from flashtree.train.drafter import (  # noqa: E402
    Example,
    TrainConfig,
    batch_loss,
    captured_layers,
    drafter_hf_config,
    new_drafter,
    training_runner,
)
from tests.helpers import save_checkpoint  # noqa: E402


@pytest.mark.parametrize("labels", ["target", "tokens"])
def test_validation_and_training_losses_agree(tmp_path, labels):
    save_checkpoint(tmp_path / "target", "qwen3")  # q/k norms: the fused norm-RoPE kernels
    llm = LLM(model=str(tmp_path / "target"), device="cuda", dtype="float32",
              skip_tokenizer_init=True, enforce_eager=True)
    cfg = TrainConfig(block_size=4, num_layers=2, target_layer_ids=(0, 2), mask_token_id=95,
                      anchors=6, labels=labels)
    hf_cfg = drafter_hf_config(llm.model_config, cfg, 95)
    draft = new_drafter(llm.model, hf_cfg, cfg)
    rng = random.Random(0)
    batch = [Example([rng.randrange(90) for _ in range(n)], 3) for n in (20, 33, 12)]
    runner = training_runner(llm.model, captured_layers(draft, llm.model, cfg), len(batch), 33)
    with torch.no_grad():
        val_loss, val_acc = batch_loss(draft, llm.model, runner, batch, cfg, random.Random(1))
    loss, acc = batch_loss(draft, llm.model, runner, batch, cfg, random.Random(1))
    torch.testing.assert_close(val_loss, loss.detach(), rtol=2e-2, atol=2e-2)
    assert loss.requires_grad and val_acc == pytest.approx(acc, abs=0.2)
