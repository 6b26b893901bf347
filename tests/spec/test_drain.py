"""Speculation in a draining batch (`flashtree.spec.drain`): when the batch drains, the time
until its last request ends against brute-force stepping and exact enumeration of paces, and
the verdict the policy and the engine take from it."""

from __future__ import annotations

import itertools

import pytest

from flashtree import LLM, SamplingParams
from flashtree.spec.drain import (
    _MIN_PACES,
    _PACE_MIN_STEPS,
    DrainWatch,
    expected_finish_seconds,
    finish_seconds,
)
from flashtree.spec.policy import SpecPolicy
from tests.spec.test_policy import LEVELS, _cost, _forecast_gain
from tests.tiny import TINY_PROMPTS


def _stepped_seconds(finish_steps: list[int], step_s) -> float:
    """Brute force: one step at a time, each costing step_s(requests not yet done)."""
    return sum(step_s(sum(f > t for f in finish_steps)) for t in range(max(finish_steps)))


def test_finish_seconds_equals_stepping_through_the_batch():
    def step_s(n: int) -> float:
        return 1.0 + 0.3 * n + (0.5 if n > 4 else 0.0)

    for finish_steps in ([5, 5, 5], [1, 7, 3, 3, 12, 9], [4], [2, 9, 9, 30, 1, 1, 6, 6]):
        assert finish_seconds([float(f) for f in finish_steps], step_s) == pytest.approx(
            _stepped_seconds(finish_steps, step_s))


def test_expected_finish_time_matches_exact_enumeration_of_paces():
    """The fixed draws' mean against the exact expectation over every assignment of paces to
    four requests with different tokens left."""
    paces, remaining = [0.3, 0.4, 0.55], [40, 64, 64, 90]

    def step_s(n: int) -> float:
        return 2.0 + 0.1 * n

    exact = sum(finish_seconds([r * p for r, p in zip(remaining, assignment)], step_s)
                for assignment in itertools.product(paces, repeat=4)) / len(paces) ** 4
    assert expected_finish_seconds(remaining, paces, step_s) == pytest.approx(exact, rel=0.03)


def test_a_batch_drains_once_it_shrinks_with_nothing_waiting_until_it_grows():
    watch = DrainWatch()
    sizes = [(4, True), (2, True), (2, False), (1, False), (3, False), (2, False), (2, True)]
    draining = []
    for requests, others_wait in sizes:
        watch.note_batch(requests, others_wait)
        draining.append(watch.draining)
    assert draining == [False, False, False, True, False, True, False]


def _watch_with_paces(paces: list[float]) -> DrainWatch:
    """Finished requests that speculated at these paces (steps per committed token)."""
    watch, steps = DrainWatch(), 10 * _PACE_MIN_STEPS
    for seq_id, pace in enumerate(paces):
        tokens = round(steps / pace)
        for step in range(steps):
            watch.count(seq_id, tokens // steps + (step < tokens % steps))
    watch.forget(set())
    assert watch.samples() == pytest.approx(paces, rel=0.01)
    return watch


def _gpu_like_pays(watch: DrainWatch, remaining: list[int]) -> bool:
    """The verdict where a speculative step costs 2.2 plain ones at any batch size."""
    return watch.speculation_pays(remaining, lambda n: 2.2, lambda n: 1.0)


def test_aligned_requests_that_would_end_apart_decode_plain():
    """Eight requests with 128 tokens left; a speculative step costs 2.2 plain ones whatever
    the batch (a small model on a GPU). Half of recent requests committed 2 tokens per
    speculative step, half 4: on the mean pace, speculation commits a fifth faster, but the
    batch waits for its slowest request, which almost surely went at 2 and ends after 64
    speculative steps (141 plain steps' time, against 128). Where every request goes at the
    mean pace, speculation ends it sooner; and one request alone never ends apart."""
    assert not _gpu_like_pays(_watch_with_paces([0.5, 0.25] * 4), [128] * 8)
    assert _gpu_like_pays(_watch_with_paces([1 / 3] * 8), [128] * 8)
    assert _gpu_like_pays(_watch_with_paces([0.5, 0.25] * 4), [128])


def _verdict_against_then_alike_paces() -> DrainWatch:
    """A batch drained from 16 to 8 requests whose verdict, on paces far apart, is against
    speculation; the paces then become alike (a fresh verdict would be for it)."""
    watch = _watch_with_paces([0.5, 0.25] * 4)
    watch.note_batch(16, others_wait=False)
    watch.note_batch(8, others_wait=False)
    assert not _gpu_like_pays(watch, [128] * 8)
    watch.paces = _watch_with_paces([1 / 3] * 8).paces
    return watch


def test_a_new_drain_takes_a_new_verdict():
    """A verdict is kept for a few steps of one drain, not into the next one."""
    watch = _verdict_against_then_alike_paces()
    assert not _gpu_like_pays(watch, [127] * 8)  # kept
    watch.note_batch(16, others_wait=True)
    watch.note_batch(8, others_wait=False)
    assert watch.draining
    assert _gpu_like_pays(watch, [128] * 8)


def test_a_verdict_is_kept_for_eight_decode_steps_of_one_batch_size():
    watch = _verdict_against_then_alike_paces()
    verdicts = []
    for step in range(8):
        watch.note_batch(8, others_wait=False)
        verdicts.append(_gpu_like_pays(watch, [127 - step] * 8))
    assert verdicts == [False] * 7 + [True]
    assert _gpu_like_pays(watch, [120] * 7)  # another size


def test_too_few_paces_do_not_hold_speculation_off():
    watch = _watch_with_paces([0.5, 0.25] * 4)
    watch.paces.popleft()
    assert len(watch.samples()) < _MIN_PACES
    assert _gpu_like_pays(watch, [128] * 8)


def test_a_draining_batch_decodes_plain_where_the_forecast_alone_would_speculate():
    """The forecast favours speculation at 8 requests by 8%; the batch shrank from 16 with
    nothing waiting, and recent requests' paces are far apart: the step runs plain. It
    speculates where others wait (a finished request is replaced at once), and where the
    paces are alike."""
    for paces, others_wait, speculates in (([0.7, 0.35] * 4, False, False),
                                           ([0.7, 0.35] * 4, True, True),
                                           ([0.52] * 8, False, True)):
        policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
        _forecast_gain(policy, requests=8, gain=1.08)
        policy.drain = _watch_with_paces(paces)
        policy.drain.note_batch(16, others_wait=False)
        assert policy.forecast_pays(8)
        assert policy.should_draft(8, None if others_wait else lambda: [128] * 8) is speculates


def test_the_engine_passes_tokens_left_once_no_request_waits(small_pair, tmp_path,
                                                             monkeypatch):
    """Three requests, room for two: while the third waits, the policy is told others wait;
    after, each step's requests' tokens left (max_tokens minus those generated, in the
    running order); and the speculative steps' paces are counted."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    should_draft, told, waited = SpecPolicy.should_draft, [], []

    def checking(policy, requests, remaining=None):
        scheduler = llm.engine.scheduler
        if remaining is None:
            waited.append(bool(scheduler.waiting))
        else:
            told.append(remaining())
            assert told[-1] == [24 - len(s.output_ids) for s in scheduler.running]
        return should_draft(policy, requests, remaining)

    monkeypatch.setattr(SpecPolicy, "should_draft", checking)
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4, max_num_seqs=2)
    llm.engine.speculative.policy.timed = False  # no plain steps of timing: it speculates
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(TINY_PROMPTS[:3], sp)
    assert waited and all(waited) and told
    watch = llm.engine.speculative.policy.drain
    assert watch.samples() or any(p.steps for p in watch.live.values())
