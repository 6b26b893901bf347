"""`n` choices per prompt: choice i of a request seeded s equals a single request seeded s + i,
in every speculative mode (the default model with its drafter, fixed policy), greedy choices
are identical, and the later choices reuse the prompt pages the first computed."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams

PROMPT = [(37 * i) % 9000 + 200 for i in range(41)]  # two full 16-token pages and a part


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_n_seeded_choices_equal_single_requests_and_share_the_prompt(spec):
    llm = LLM(model="default", spec=spec, spec_policy="fixed", skip_tokenizer_init=True,
              device="cpu", dtype="float32", max_model_len=128, page_size=16)
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True)
    hits = llm.engine.pages.prefix.hit_tokens
    out = llm.generate([PROMPT], SamplingParams(n=4, seed=7, **kw))[0].outputs
    assert llm.engine.pages.prefix.hit_tokens - hits == 3 * 32  # choices 1-3: both pages
    assert [o.index for o in out] == [0, 1, 2, 3]
    singles = [llm.generate([PROMPT], SamplingParams(seed=7 + i, **kw))[0].outputs[0]
               for i in range(4)]
    assert [o.token_ids for o in out] == [s.token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in out}) > 1  # the seeds differ, so do the choices
    greedy = llm.generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=10,
                                                   ignore_eos=True))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids


def test_the_engine_takes_one_choice_per_request():
    llm = LLM(model="default", spec="none", skip_tokenizer_init=True, device="cpu",
              max_model_len=64)
    with pytest.raises(ValueError, match="one choice per request"):
        llm.engine.add_request([1, 2, 3], SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
