"""Overlapped plain decoding (`flashtree/engine/decode_ahead.py`): each greedy decode step queued
before the step before it reads its tokens commits exactly what the same engine commits without
the overlap, one request at a time, through preemption, chunked prefill, arrivals, stop tokens
and aborts; a queued step some other batch replaces wastes its work and nothing else, and every
KV page comes back."""

from __future__ import annotations

import random

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.speculative.agreeing_pair import save_agreeing_pair
from tests.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), seed=1, initializer_range=0.3)


def _llm(path, overlap: bool, device: str = "cpu", **kw) -> LLM:
    llm = LLM(model=str(path), device=device, dtype="float32", skip_tokenizer_init=True, **kw)
    assert llm.engine.overlap_decode is (device == "cuda")  # off on a CPU unless asked
    llm.engine.overlap_decode = overlap
    return llm


def _prompts(n: int, vocab: int = 64) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _greedy(i: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 6 + i % 13, "ignore_eos": True,
                             **kw})


def _assert_pages_back(llm: LLM) -> None:
    pages, scheduler = llm.engine.pages, llm.engine.scheduler
    assert pages.num_free == pages.num_pages
    assert not scheduler.running and not scheduler.waiting


def test_overlapped_decoding_commits_one_at_a_time_tokens_under_pressure(tiny_dir):
    check_under_pressure(tiny_dir, "cpu")


def check_under_pressure(tiny_dir, device: str) -> None:
    prompts, params = _prompts(24), [_greedy(i) for i in range(24)]
    solo = _llm(tiny_dir, overlap=False, device=device, max_num_seqs=1)
    expected = [solo.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    # 40 pages of 4 tokens hold a few of 8 requests of up to ~58 tokens: preemption; a prefill
    # budget of 16 tokens chunks the longer prompts.
    crowded = _llm(tiny_dir, overlap=True, device=device, max_num_seqs=8, page_size=4,
                   kv_cache_pages=40, max_num_batched_tokens=16)
    outs = crowded.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert crowded.engine.scheduler.num_preemptions > 0
    assert crowded.engine.overlapped_decode_steps >= 5  # where no admission was due
    _assert_pages_back(crowded)


def _drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Requests arriving one every three steps; the second aborted at step 7."""
    engine, seqs, step = llm.engine, [], 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        if step % 3 == 0 and len(seqs) < len(prompts):
            seqs.append(engine.add_request(prompts[len(seqs)], params[len(seqs)]))
        if step == 7:
            engine.abort(seqs[1])
        if engine.has_unfinished():
            engine.step()
        step += 1
    return [list(s.output_ids) for s in seqs]


def test_stop_tokens_arrivals_and_aborts_end_queued_steps_without_a_trace(tiny_dir):
    """Requests end at a stop token the host sees only after the next step is queued; others
    arrive and one is aborted between steps: the same tokens as without the overlap."""
    prompts = _prompts(6)
    plain = _llm(tiny_dir, overlap=False, max_num_seqs=4)
    free_run = _drive(plain, prompts, [_greedy(i, max_tokens=24) for i in range(6)])
    # Each request stops at its fourth token's id where that one is not among the first three.
    stops = [[out[3]] if len(out) > 3 and out[3] not in out[:3] else None for out in free_run]
    assert sum(s is not None for s in stops) >= 2
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=s)
              for s in stops]
    expected = _drive(_llm(tiny_dir, overlap=False, max_num_seqs=4), prompts, params)
    overlapped = _llm(tiny_dir, overlap=True, max_num_seqs=4)
    assert _drive(overlapped, prompts, params) == expected
    assert any(len(out) == 4 for out in expected)  # a stop token ended a request
    assert overlapped.engine.overlapped_decode_steps > 5
    _assert_pages_back(overlapped)


def test_sampled_requests_are_not_overlapped(tiny_dir):
    """A batch with a sampled request reads its logits on the host: nothing is queued."""
    llm = _llm(tiny_dir, overlap=True, max_num_seqs=4)
    params = [_greedy(0, max_tokens=12), SamplingParams(temperature=0.8, max_tokens=12, seed=1)]
    llm.generate(_prompts(2), params)
    assert llm.engine.overlapped_decode_steps == 0


class _ThreePlainThenOne:
    """Plain steps, every fourth step speculative: queued plain steps meet speculative ones."""

    def __init__(self, budget: int) -> None:
        self.budget, self.steps = budget, 0

    def plan(self, requests: int) -> int:
        self.steps += 1
        return self.budget if self.steps % 4 == 0 else 0

    def observe(self, result) -> None:
        pass


def test_a_drafters_plain_steps_overlap_without_changing_its_drafts(tmp_path):
    """A DDTree engine whose policy mixes plain and speculative steps: its queued plain steps
    also wrote the drafter's context, and a speculative step may follow one it queued. The
    tokens are plain decoding's, and every draft's logits are those without the overlap: the
    drafter read the same context."""
    check_drafter_steps(tmp_path, "cpu")


def check_drafter_steps(tmp_path, device: str) -> None:
    target, drafter = save_agreeing_pair(tmp_path, 4)
    prompts = _prompts(5, vocab=5)

    def run(spec: str, overlap: bool):
        llm = _llm(target, overlap, device, draft=str(drafter) if spec != "none" else None,
                   spec=spec, tree_budget=6 if spec != "none" else None, max_num_seqs=4)
        drafts = []
        if spec != "none":
            llm.engine.policy = _ThreePlainThenOne(6)
            draft = llm.engine.proposer.draft
            logits = draft.logits
            draft.logits = lambda *a, **kw: drafts.append(logits(*a, **kw)) or drafts[-1]
        outs = llm.generate(prompts, [_greedy(i, max_tokens=20) for i in range(5)])
        return llm, [(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths) for o in outs
                     ], drafts

    overlapped, with_overlap, drafts = run("ddtree", True)
    _, without, expected_drafts = run("ddtree", False)
    assert with_overlap == without
    assert len(drafts) == len(expected_drafts) > 3
    assert all(torch.equal(a, b) for a, b in zip(drafts, expected_drafts))  # the same context
    assert [t for t, _ in with_overlap] == [t for t, _ in run("none", False)[1]]
    assert max(n for _, lengths in with_overlap for n in lengths) > 1  # speculation accepted
    assert overlapped.engine.overlapped_decode_steps > 5
    _assert_pages_back(overlapped)


def test_each_decode_step_but_the_first_takes_its_queued_forward_as_requests_end(tiny_dir):
    """Requests admitted together that end one by one (six lengths, two at stop tokens the host
    sees a step late): every decode step after the first takes the forward queued for it, its
    rows of the requests that go on, and the tokens are those without the overlap."""
    prompts = _prompts(6)
    lengths = [_greedy(i, max_tokens=5 + 3 * i) for i in range(6)]
    free_run = [o.outputs[0].token_ids
                for o in _llm(tiny_dir, overlap=False, max_num_seqs=8).generate(prompts, lengths)]
    stops = {i: out[2] for i, out in enumerate(free_run) if i in (3, 5) and out[2] not in out[:2]}
    assert stops, "no request has a fresh third token to stop at"
    params = [_greedy(i, max_tokens=5 + 3 * i,
                      stop_token_ids=[stops[i]] if i in stops else None) for i in range(6)]
    expected = [o.outputs[0].token_ids
                for o in _llm(tiny_dir, overlap=False, max_num_seqs=8).generate(prompts, params)]
    llm = _llm(tiny_dir, overlap=True, max_num_seqs=8)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected and any(len(t) == 3 for t in got)
    # The prefill samples each first token; of the decode steps after it, all but the first.
    assert llm.engine.overlapped_decode_steps == max(len(t) for t in got) - 2
    _assert_pages_back(llm)
