"""Checks of a drafter written by `flashtree train-drafter` on the default model, against
results it does not compute itself: z-lab's reference package (`dflash`) reading the saved files
on transformers' reading of the same GGUF, and the run's own held-out loss before training."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from flashtree import LLM, SamplingParams

# Two float32 implementations of the 30-layer target and of the drafter agree to about 1e-4 on
# logits of size up to 40 (test_gguf: 4e-5 on the target's own); a wrong weight, norm, layer or
# position moves drafter logits by far more.
LOGIT_ATOL = 1e-4


def held_out_losses(log: str) -> list[float]:
    """The validation losses a training log reports, in order (the first before any step)."""
    return [float(x) for x in re.findall(r"\| val loss (\d+\.\d+)", log)]


def assert_reference_gives_our_block_logits(drafter_dir: Path, hf_target,
                                            prompt: list[int]) -> None:
    """The block logits of `prompt`'s first draft: `dflash` on `hf_target` equals flashtree."""
    dflash_model = pytest.importorskip("dflash.model")
    dflash_model._cuda_time = time.perf_counter  # it times itself with CUDA events otherwise
    reference = dflash_model.DFlashDraftModel.from_pretrained(
        str(drafter_dir), dtype=torch.float32).eval()
    block, n = reference.block_size, len(prompt)
    with torch.no_grad():
        out = hf_target(torch.tensor([prompt]), output_hidden_states=True)
        features = dflash_model.extract_context_feature(out.hidden_states,
                                                        reference.target_layer_ids)
        bonus = int(out.logits[0, -1].argmax())
        ids = torch.tensor([[bonus] + [reference.mask_token_id] * (block - 1)])
        hidden = reference(target_hidden=features,
                           noise_embedding=hf_target.get_input_embeddings()(ids),
                           position_ids=torch.arange(n + block)[None])
        expected = reference.compute_logits(hidden[:, 1:], hf_target.lm_head)[0]

    llm = LLM(model="default", draft=str(drafter_dir), spec="dflash", spec_policy="fixed",
              device="cpu", dtype="float32", max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=block + 1))
    engine.step()  # prefill: the target's KV and the prompt's context features
    assert seq.output_ids == [bonus]
    engine.proposer.flush()  # as a speculative step does before drafting
    engine.pages.reserve(seq.seq_id, n + block)
    got = engine.proposer.draft_logits([(seq.seq_id, n, bonus, block)])
    assert got.shape == expected.shape == (block - 1, llm.model_config.vocab_size)
    torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)
