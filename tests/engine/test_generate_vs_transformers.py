"""End to end: greedy `LLM.generate` / `LLM.chat` (several prompts of different lengths batched
through the engine) return exactly the tokens of transformers' greedy `generate`, on tiny random
checkpoints and on the embedded default GGUF model."""

from __future__ import annotations

import random

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.helpers import LLAMA3_ROPE, load_reference, save_checkpoint

MAX_NEW = 12
PROMPT_LENGTHS = [3, 17, 40, 9, 1]

CASES = {
    "llama3-rope": ("llama", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=12)),
}

ENGINE_SETTINGS = {
    "page4": dict(page_size=4),
    # An 8-token prefill budget prefills the longer prompts in several chunks.
    "chunked-prefill": dict(page_size=16, max_num_batched_tokens=8),
}


def _hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], float]:
    """transformers' greedy continuation of one unpadded prompt, with EOS disabled, and the
    smallest top-1/top-2 logit gap along the way."""
    out = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    gaps = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), min(gaps)


@pytest.fixture(scope="module", params=list(CASES))
def reference(request, tmp_path_factory):
    """(checkpoint dir, prompts, transformers' greedy continuations)."""
    arch, overrides = CASES[request.param]
    path = save_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=11, **overrides)
    hf = load_reference(path, arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in PROMPT_LENGTHS]
    expected = []
    for p in prompts:
        tokens, gap = _hf_greedy(hf, p, MAX_NEW)
        # Near-ties would make the comparison depend on float rounding, not on correctness.
        assert gap > 1e-3, f"ill-conditioned checkpoint (top-2 gap {gap:.2g}); change the seed"
        expected.append(tokens)
    return path, prompts, expected


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
def test_batched_greedy_generate_matches_transformers(reference, settings):
    path, prompts, expected = reference
    llm = LLM(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
              **ENGINE_SETTINGS[settings])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    got = [o.outputs[0].token_ids for o in outs]
    for i, (mine, ref) in enumerate(zip(got, expected)):
        assert mine == ref, f"prompt {i} (len {len(prompts[i])}): {mine} != {ref}"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # Not a degenerate model that repeats one token whatever the context.
    assert len({t for toks in expected for t in toks}) > 5
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages


# --------------------------------------------------------------------- default GGUF model
GGUF_MAX_NEW = 16


def _hf_generate(hf, ids: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=GGUF_MAX_NEW, eos_token_id=None,
    )
    return out[0, len(ids):].tolist()


def test_default_model_greedy_chat_matches_transformers(default_llm, hf_gguf_model):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a poet."},
         {"role": "user", "content": "Write a haiku about the sea, then explain it."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=GGUF_MAX_NEW, ignore_eos=True)
    outs = default_llm.chat(conversations, params)
    prompts = [default_llm.tokenizer.apply_chat_template(c) for c in conversations]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert len(prompts[0]) != len(prompts[1])
    for o, ids in zip(outs, prompts):
        assert o.outputs[0].token_ids == _hf_generate(hf_gguf_model, ids)
        assert len(o.outputs[0].token_ids) == GGUF_MAX_NEW
    assert "Paris" in outs[0].outputs[0].text


def test_default_model_greedy_generate_matches_transformers(default_llm, hf_gguf_model):
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th"]
    params = SamplingParams(temperature=0, max_tokens=GGUF_MAX_NEW, ignore_eos=True)
    outs = default_llm.generate(prompts, params)
    for o, text in zip(outs, prompts):
        ids = default_llm.tokenizer.encode(text)
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == _hf_generate(hf_gguf_model, ids)
        assert o.outputs[0].finish_reason == "length"
