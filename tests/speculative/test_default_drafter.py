"""The DFlash drafter shipped for the default model: `LLM(model="default")` speculates with it
(DDTree unless told otherwise), and z-lab's reference `dflash` package loads the same files and,
on transformers' reading of the same GGUF, reproduces flashtree's greedy DFlash tokens and
acceptance lengths."""

from __future__ import annotations

import time

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.registry import DEFAULT_DRAFTER_DIR

dflash_model = pytest.importorskip("dflash.model")
# The reference times itself with CUDA events; on CPU a wall clock is enough.
dflash_model._cuda_time = time.perf_counter

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a list.",
             "Tom has 3 apples and buys 5 more. How many apples does he have?"]
MAX_NEW = 32


def test_default_model_speculates_with_the_shipped_drafter(default_llm):
    assert default_llm.spec == "ddtree"
    drafter = default_llm.drafter
    assert drafter is not None and drafter.cfg.block_size == 16
    assert 0 <= drafter.cfg.mask_token_id < default_llm.model_config.vocab_size
    plain = LLM(model="default", spec="none", device="cpu", dtype="float32", max_model_len=256)
    assert plain.drafter is None and plain.spec == "none"


def test_reference_dflash_reproduces_our_greedy_tokens(hf_gguf_model):
    reference = dflash_model.DFlashDraftModel.from_pretrained(
        str(DEFAULT_DRAFTER_DIR), dtype=torch.float32).eval()
    # Without prefix caching the three requests are admitted in one step and each steps as
    # the reference's solo run does; with it, the later ones would wait a step for the first's
    # chat-template page, so the first would commit a plain token in a mixed step first.
    llm = LLM(model="default", spec="dflash", spec_policy="fixed", device="cpu",
              dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in QUESTIONS]
    outs = llm.generate(prompts,
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    multi_token_steps = 0
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            r = dflash_model.dflash_generate(reference, hf_gguf_model, torch.tensor([p]), MAX_NEW,
                                             None, return_stats=True)
        got = out.outputs[0]
        assert got.token_ids == r.output_ids[0, len(p):].tolist()
        assert got.spec_accept_lengths == r.acceptance_lengths
        multi_token_steps += sum(n > 1 for n in got.spec_accept_lengths)
    assert multi_token_steps > 0, "the trained drafter never had a draft accepted"
