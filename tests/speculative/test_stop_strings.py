"""Stop strings that end inside a step that committed several tokens: speculative decoding
(the default model with its shipped drafter, DDTree at a fixed budget) stops at the same
character and token as plain decoding, with the same finish reason, streamed or not."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def pair():
    kw = dict(model="default", device="cpu", dtype="float32", max_model_len=256)
    return LLM(spec="none", **kw), LLM(spec="ddtree", spec_policy="fixed", **kw)


def test_stop_strings_inside_multi_token_commits(pair):
    plain, spec = pair
    tok = spec.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a cat."}])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full = spec.generate([ids], greedy)[0].outputs[0]
    assert full.token_ids == plain.generate([ids], greedy)[0].outputs[0].token_ids
    tokens, text = full.token_ids, full.text
    ends = [len(tok.decode(tokens[: i + 1])) for i in range(len(tokens))]  # text after token i
    # Stop strings of two characters across the boundary of tokens i and i + 1 committed by one
    # step (and met there first), so the stop falls inside that step's commit.
    cases, done = [], 1  # the prefill committed token 0
    for length in full.spec_accept_lengths:
        for i in range(done, done + length - 1):
            cut = ends[i]
            stop = text[cut - 1 : cut + 1]
            if len(stop) == 2 and text.find(stop) == cut - 1 and 0 < ends[i - 1] < cut:
                cases.append((stop, cut - 1))
        done += length
    assert len(cases) >= 3, "too few multi-token commits to cut inside"
    for stop, at in cases[:: max(1, len(cases) // 3)][:3]:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                stop=[stop])
        want, got = (llm.generate([ids], params)[0].outputs[0] for llm in (plain, spec))
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text, want.token_ids, want.finish_reason), stop
        assert got.text == text[:at] and got.finish_reason == "stop"
        assert "".join(spec.stream(ids, params)) == want.text
    for llm in pair:
        assert llm.engine.pages.num_free == llm.engine.pages.num_pages
