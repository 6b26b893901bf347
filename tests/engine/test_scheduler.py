"""Continuous batching under pressure: the results of a crowded, preempting, chunk-prefilling
engine equal one-request-at-a-time runs, and every KV page comes back."""

from __future__ import annotations

import random

import pytest

from flashtree import LLM, SamplingParams
from tests.helpers import ran_mixed_steps, record_schedules
from tests.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), seed=1, initializer_range=0.3)


def _prompts(n: int, vocab: int = 64) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _params(i: int) -> SamplingParams:
    # Mix greedy and seeded sampling, and several lengths, across requests.
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=8 + i % 13, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8 + i % 11, seed=i,
                          ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, **kw)


def test_crowded_batch_matches_one_at_a_time(tiny_dir):
    prompts = _prompts(64)
    params = [_params(i) for i in range(64)]

    solo = _llm(tiny_dir, max_num_seqs=1)
    expected = [solo.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]

    # 12 pages of 4 tokens cannot hold 8 sequences of up to ~60 tokens: preemption must happen;
    # a prefill budget of 16 tokens forces chunked prefill of the longer prompts.
    crowded = _llm(tiny_dir, max_num_seqs=8, page_size=4, kv_cache_pages=40,
                   max_num_batched_tokens=16)
    schedules = record_schedules(crowded.engine)
    outs = crowded.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in outs] == expected
    assert ran_mixed_steps(schedules)  # admissions rode on running requests' decode steps
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o, sp in zip(outs, params))
    assert crowded.engine.scheduler.num_preemptions > 0
    pages = crowded.engine.pages
    assert pages.num_free == pages.num_pages
    assert not crowded.engine.scheduler.running and not crowded.engine.scheduler.waiting


def test_max_num_seqs_bounds_running(tiny_dir):
    llm = _llm(tiny_dir, max_num_seqs=3)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
            for p in _prompts(10)]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert all(len(s.output_ids) == 5 for s in seqs)


def _step_chunks(engine) -> list[list[tuple[int, bool]]]:
    """(seq_id, decode) of every chunk of every step until the engine is done."""
    steps = record_schedules(engine)
    while engine.has_unfinished():
        engine.step()
    return [[(c.seq.seq_id, c.decode) for c in chunks] for chunks in steps]


@pytest.mark.parametrize("mixes", [True, False])
def test_an_admission_carries_the_running_requests_decode_tokens_where_allowed(tiny_dir, mixes):
    engine = _llm(tiny_dir, max_num_seqs=2).engine
    if not mixes:
        engine.scheduler.mixes = lambda prompt_chunks, decode_tokens, longest: False
    short, long, late = (engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                              ignore_eos=True))
                         for p, n in zip(_prompts(3), (3, 8, 4)))
    steps = _step_chunks(engine)
    # Both admitted together; `late` comes in once `short` ends, two tokens into `long`'s.
    assert steps[0] == [(short.seq_id, False), (long.seq_id, False)]
    assert steps[1] == [(short.seq_id, True), (long.seq_id, True)]
    assert steps[2] == [(short.seq_id, True), (long.seq_id, True)]
    if mixes:
        assert steps[3] == [(long.seq_id, True), (late.seq_id, False)]
    else:
        assert steps[3:5] == [[(late.seq_id, False)], [(long.seq_id, True), (late.seq_id, True)]]
    assert [len(s.output_ids) for s in (short, long, late)] == [3, 8, 4]
    assert len(steps) == (8 if mixes else 9)


def test_plain_decoding_accept_lengths_are_one(tiny_dir):
    out = _llm(tiny_dir).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6,
                                                              ignore_eos=True))[0].outputs[0]
    assert out.spec_accept_lengths == [1] * 5
    assert out.finish_reason == "length"


def test_an_exception_in_one_request_fails_only_that_request(tiny_dir, monkeypatch):
    import flashtree.engine.llm_engine as llm_engine

    llm = _llm(tiny_dir)
    real = llm_engine.sample_tokens

    def flaky(logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise RuntimeError("boom")
        return real(logits, rows)

    monkeypatch.setattr(llm_engine, "sample_tokens", flaky)
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s, ignore_eos=True)
              for s in (12, 13, 14)]
    outs = llm.generate(_prompts(3), params)
    assert outs[1].outputs[0].finish_reason == "error"
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [6, 6]
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages
