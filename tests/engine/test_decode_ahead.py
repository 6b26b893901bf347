"""Overlapped plain decoding (`flashtree/engine/decode_ahead.py`): each greedy decode step queued
before the step before it reads its tokens commits exactly what the same engine commits without
the overlap (and, on a CPU, one request at a time), through preemption, chunked prefill,
arrivals, stop tokens, an abort of a request a queued step holds and a full `max_num_seqs`; a
step takes the rows of the requests that go on; a queued step nothing takes is counted and let
go; every KV page comes back."""

from __future__ import annotations

import random
from types import SimpleNamespace

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


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_pages_back(llm: LLM) -> None:
    pages, scheduler = llm.engine.pages, llm.engine.scheduler
    assert pages.num_free == pages.num_pages
    assert not scheduler.running and not scheduler.waiting
    assert llm.engine._queued is None  # let go once every request ended


def test_overlapped_decoding_commits_one_at_a_time_tokens_under_pressure(tiny_dir):
    prompts, params = _prompts(24), [_greedy(i) for i in range(24)]
    solo = _llm(tiny_dir, overlap=False, max_num_seqs=1)
    assert check_under_pressure(tiny_dir, "cpu") == _tokens(solo, prompts, params)


def check_under_pressure(tiny_dir, device: str) -> list[list[int]]:
    """24 requests in 40 pages of 4 tokens, 8 at a time (preemption), prompts prefilled 16
    tokens a step (chunks): the same tokens with and without the overlap; those tokens."""
    prompts, params = _prompts(24), [_greedy(i) for i in range(24)]
    kw = dict(device=device, max_num_seqs=8, page_size=4, kv_cache_pages=40,
              max_num_batched_tokens=16)
    expected = _tokens(_llm(tiny_dir, overlap=False, **kw), prompts, params)
    crowded = _llm(tiny_dir, overlap=True, **kw)
    assert _tokens(crowded, prompts, params) == expected
    assert crowded.engine.scheduler.num_preemptions > 0
    assert crowded.engine.overlapped_decode_steps >= 5  # where no admission was due
    _assert_pages_back(crowded)
    return expected


def _drive(llm: LLM, prompts, params, abort_at: int | None) -> tuple[list[list[int]], int]:
    """Requests arriving one every three steps; the second aborted at step `abort_at`, or
    (None) at the first step from 7 on where a queued forward holds it. -> (outputs, the
    abort's step)."""
    engine, seqs, step = llm.engine, [], 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        if step % 3 == 0 and len(seqs) < len(prompts):
            seqs.append(engine.add_request(prompts[len(seqs)], params[len(seqs)]))
        held = (len(seqs) > 1 and engine._queued is not None
                and seqs[1].seq_id in engine._queued.seq_ids)
        if step == abort_at or (abort_at is None and step >= 7 and held):
            abort_at = step
            engine.abort(seqs[1])
        if engine.has_unfinished():
            engine.step()
        step += 1
    return [list(s.output_ids) for s in seqs], abort_at


def test_stop_tokens_arrivals_and_an_abort_end_queued_steps_without_a_trace(tiny_dir):
    """Requests end at a stop token the host sees only after the next step is queued; others
    arrive between steps, and one is aborted while a queued step holds it: the same tokens as
    without the overlap."""
    prompts = _prompts(6)
    free_run, _ = _drive(_llm(tiny_dir, overlap=False, max_num_seqs=4), prompts,
                         [_greedy(i, max_tokens=24) for i in range(6)], abort_at=10**9)
    # Each request but the one to abort stops at its fourth token's id where that one is not
    # among the first three.
    stops = [[out[3]] if i != 1 and len(out) > 3 and out[3] not in out[:3] else None
             for i, out in enumerate(free_run)]
    assert sum(s is not None for s in stops) >= 2
    params = [_greedy(i, max_tokens=24, stop_token_ids=s) for i, s in enumerate(stops)]
    overlapped = _llm(tiny_dir, overlap=True, max_num_seqs=4)
    got, aborted_at = _drive(overlapped, prompts, params, abort_at=None)
    assert aborted_at is not None, "no queued step held the request to abort"
    expected, _ = _drive(_llm(tiny_dir, overlap=False, max_num_seqs=4), prompts, params,
                         abort_at=aborted_at)
    assert got == expected and any(len(out) == 4 for out in expected)  # a stop ended one
    assert overlapped.engine.overlapped_decode_steps > 5
    _assert_pages_back(overlapped)


def test_each_decode_step_takes_its_queued_forward_as_requests_end(tiny_dir):
    """Requests admitted together that end one by one (six lengths, two at stop tokens the host
    sees a step late): every decode step takes the forward queued for it (the first, the one
    the prefill queued), its rows of the requests that go on; the tokens are those without
    the overlap."""
    prompts = _prompts(6)
    lengths = [_greedy(i, max_tokens=5 + 3 * i) for i in range(6)]
    free_run = _tokens(_llm(tiny_dir, overlap=False, max_num_seqs=8), prompts, lengths)
    stops = {i: out[2] for i, out in enumerate(free_run) if i in (3, 5) and out[2] not in out[:2]}
    assert stops, "no request has a fresh third token to stop at"
    params = [_greedy(i, max_tokens=5 + 3 * i,
                      stop_token_ids=[stops[i]] if i in stops else None) for i in range(6)]
    expected = _tokens(_llm(tiny_dir, overlap=False, max_num_seqs=8), prompts, params)
    llm = _llm(tiny_dir, overlap=True, max_num_seqs=8)
    got = _tokens(llm, prompts, params)
    assert got == expected and any(len(t) == 3 for t in got)
    # The prefill samples each first token; every decode step after it took a queued forward.
    assert llm.engine.overlapped_decode_steps == max(len(t) for t in got) - 1
    assert llm.engine.dropped_decode_steps == 0  # a stop leaves its row untaken, no more
    _assert_pages_back(llm)


def test_a_full_max_num_seqs_with_requests_waiting_still_overlaps(tiny_dir):
    """Two running, four waiting: no admission is due until a request reaches its length
    limit, which the host knows a step ahead, so no queued step is dropped."""
    prompts, params = _prompts(6), [_greedy(i, max_tokens=8 + 2 * i) for i in range(6)]
    expected = _tokens(_llm(tiny_dir, overlap=False, max_num_seqs=2), prompts, params)
    llm = _llm(tiny_dir, overlap=True, max_num_seqs=2)
    assert _tokens(llm, prompts, params) == expected
    decode_steps = sum(p.max_tokens - 1 for p in params)  # an upper bound: batches of two
    assert llm.engine.overlapped_decode_steps > 0.3 * decode_steps
    assert llm.engine.dropped_decode_steps == 0
    _assert_pages_back(llm)


def test_arrivals_mix_their_prompts_with_the_queued_decode_rows(tiny_dir):
    """A request arriving every third step: each mixed step takes the queued decode rows of
    the running requests and runs the new prompt alone, and queues the next decode of all of
    them; nothing queued is dropped, and the tokens are those without the overlap."""
    prompts, params = _prompts(6), [_greedy(i, max_tokens=16) for i in range(6)]

    def run(overlap: bool) -> tuple[list[list[int]], LLM, int]:
        llm = _llm(tiny_dir, overlap, max_num_seqs=8)
        engine, seqs, step = llm.engine, [], 0
        while len(seqs) < len(prompts) or engine.has_unfinished():
            if step % 3 == 0 and len(seqs) < len(prompts):
                seqs.append(engine.add_request(prompts[len(seqs)], params[len(seqs)]))
            engine.step()
            step += 1
        return [list(s.output_ids) for s in seqs], llm, step

    expected, _, _ = run(False)
    got, llm, steps = run(True)
    assert got == expected
    # The requests overlap in time: every step after the first prefill decodes some, and
    # took their rows from the queue.
    assert llm.engine.overlapped_decode_steps == steps - 1
    assert llm.engine.dropped_decode_steps == 0
    _assert_pages_back(llm)


def test_a_queued_step_nothing_takes_is_let_go(tiny_dir):
    """The last request ends at a stop token: the step queued behind its last token is
    counted dropped and not kept alive by the idle engine."""
    prompt = _prompts(1)
    free_run = _tokens(_llm(tiny_dir, overlap=False), prompt, [_greedy(0, max_tokens=12)])[0]
    stop = next(t for i, t in enumerate(free_run) if i >= 2 and t not in free_run[:i])
    llm = _llm(tiny_dir, overlap=True)
    got = _tokens(llm, prompt, [_greedy(0, max_tokens=12, stop_token_ids=[stop])])[0]
    assert got[-1] == stop and len(got) < 12
    assert llm.engine.dropped_decode_steps == 1
    _assert_pages_back(llm)


def test_the_server_exports_taken_and_dropped_queued_steps(tiny_dir):
    """`/metrics` reads the engine's counts: `flashtree:decode_overlap_steps_total` by
    outcome."""
    from prometheus_client import generate_latest

    from flashtree.server.metrics import ServerMetrics

    prompt = _prompts(1)
    free_run = _tokens(_llm(tiny_dir, overlap=False), prompt, [_greedy(0, max_tokens=12)])[0]
    stop = next(t for i, t in enumerate(free_run) if i >= 2 and t not in free_run[:i])
    llm = _llm(tiny_dir, overlap=True)
    _tokens(llm, prompt, [_greedy(0, max_tokens=12, stop_token_ids=[stop])])
    metrics = ServerMetrics()
    metrics.refresh(llm.engine)
    text = generate_latest(metrics.registry).decode()
    taken = llm.engine.overlapped_decode_steps
    assert taken > 0
    assert f'flashtree:decode_overlap_steps_total{{outcome="taken"}} {taken}.0' in text
    assert 'flashtree:decode_overlap_steps_total{outcome="dropped"} 1.0' in text


def test_sampled_requests_are_not_overlapped(tiny_dir):
    """A batch with a sampled request reads its logits on the host: nothing is queued."""
    llm = _llm(tiny_dir, overlap=True, max_num_seqs=4)
    params = [_greedy(0, max_tokens=12), SamplingParams(temperature=0.8, max_tokens=12, seed=1)]
    llm.generate(_prompts(2), params)
    assert llm.engine.overlapped_decode_steps == llm.engine.dropped_decode_steps == 0


class _ThreePlainThenOne:
    """Plain steps, every fourth step speculative: queued plain steps meet speculative ones."""

    def __init__(self, budget: int) -> None:
        self.budget, self.steps = budget, 0

    def plan(self, requests: int) -> int:
        self.steps += 1
        return self.budget if self.steps % 4 == 0 else 0

    def observe(self, result) -> None:
        pass

    def decisions(self):
        upcoming = self.budget if (self.steps + 1) % 4 == 0 else 0
        return SimpleNamespace(plan=lambda requests: upcoming)


def test_a_drafters_plain_steps_overlap_without_changing_its_drafts(tmp_path):
    check_drafter_steps(tmp_path, "cpu")


def check_drafter_steps(tmp_path, device: str) -> None:
    """A DDTree engine whose policy mixes plain and speculative steps: its queued plain steps
    also wrote the drafter's context. The tokens are plain decoding's, and every draft's logits
    are those without the overlap (the drafter read the same context); no queued step is
    dropped, since none is queued before a speculative step."""
    target, drafter = save_agreeing_pair(tmp_path, 4)
    prompts = _prompts(5, vocab=5)

    def run(spec: str, overlap: bool):
        llm = _llm(target, overlap, device, draft=str(drafter) if spec != "none" else None,
                   spec=spec, tree_budget=6 if spec != "none" else None, max_num_seqs=4)
        drafts = []
        if spec != "none":
            llm.engine.policy = _ThreePlainThenOne(6)
            runner = llm.engine.proposer.runner  # the drafter's forwards, replayed or not
            forward = runner.run
            runner.run = lambda *a, **kw: drafts.append(forward(*a, **kw)) or drafts[-1]
        outs = llm.generate(prompts, [_greedy(i, max_tokens=20) for i in range(5)])
        return llm, [(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths) for o in outs
                     ], [d[0] for d in drafts if d[0].numel()]

    overlapped, with_overlap, drafts = run("ddtree", True)
    _, without, expected_drafts = run("ddtree", False)
    assert with_overlap == without
    assert len(drafts) == len(expected_drafts) > 3
    assert all(torch.equal(a, b) for a, b in zip(drafts, expected_drafts))  # the same context
    assert [t for t, _ in with_overlap] == [t for t, _ in run("none", False)[1]]
    assert max(n for _, lengths in with_overlap for n in lengths) > 1  # speculation accepted
    assert overlapped.engine.overlapped_decode_steps > 5
    assert overlapped.engine.dropped_decode_steps == 0
    _assert_pages_back(overlapped)


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["chat"]])
def test_the_overlap_can_be_switched_off(tiny_dir, command):
    """`overlap_decode=False` (`--no-overlap-decode`) reads each step's tokens before the next
    launch, on CUDA too; by default (None) it is on where the device is CUDA; True forces it
    on anywhere."""
    from flashtree.cli import build_parser

    assert build_parser().parse_args(command).overlap_decode is None
    assert build_parser().parse_args([*command, "--no-overlap-decode"]).overlap_decode is False
    llm = LLM(model=str(tiny_dir), device="cpu", skip_tokenizer_init=True, overlap_decode=False)
    assert llm.engine.args.overlap_decode is False and llm.engine.overlap_decode is False
    llm = LLM(model=str(tiny_dir), device="cpu", skip_tokenizer_init=True, overlap_decode=True)
    assert llm.engine.overlap_decode is True
