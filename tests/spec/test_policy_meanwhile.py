"""The adaptive policy's host work done while the device runs a speculative step's target
forward (`SpecPolicy.meanwhile`): a steady step's outcome taken in by the next speculative step
or by a verdict, and the next decision's forecast and tree budgets worked out ahead; a
prepared choice is the choice made on the spot, a prepared forecast serves one decision."""

from __future__ import annotations

import pytest

from flashtree.spec.policy import SpecPolicy, StepOutcome
from tests.spec.test_policy import (
    LEVELS,
    PROMPTS,
    _chain_gains,
    _cost,
    _forecast_gain,
    _plain_tokens_and_adaptive_engine,
)


def _steady(requests: int = 4, gain: float = 1.3) -> SpecPolicy:
    """A policy whose forecast expects speculation at `requests` to pay `gain`, and which has
    just let a step speculate on the forecast's word."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests, gain)
    assert policy.should_draft(requests) and policy.steady and not policy.probing
    return policy


def _outcome(seq_id: int, accepted: int) -> StepOutcome:
    """One request's step, verifying 8 drafts and accepting `accepted`, of a step that chose
    its tree."""
    return StepOutcome(1, 8, accepted, [(seq_id, accepted)], [(seq_id, accepted, 2.0)],
                       {seq_id: _chain_gains(0.5)})


def _took_in(policy: SpecPolicy, seq_id: int) -> bool:
    return seq_id in policy.requests and seq_id in policy.reach and seq_id in policy.drain.live


def test_a_steady_step_s_outcome_is_taken_in_while_the_next_step_runs():
    policy = _steady()
    accepted = policy.recent.accepted
    policy.hand_over(_outcome(1, 0))
    assert not _took_in(policy, 1) and policy.recent.accepted == accepted  # it waits
    assert policy.should_draft(4) and policy.steady
    policy.meanwhile(4)
    assert _took_in(policy, 1) and policy.recent.accepted < accepted
    assert policy.drain.live[1].steps == 1  # once


def test_a_probe_s_outcome_is_taken_in_at_once():
    policy = _steady()
    policy.steady, policy.probing = False, True  # as should_draft leaves them for a probe
    policy.hand_over(_outcome(1, 3))
    assert _took_in(policy, 1)


def test_a_verdict_against_speculation_takes_the_waiting_outcome_in_first():
    """The waiting outcome is the last of the run: the back-off's probe restarts the
    acceptance averages, and must not count it as its own."""
    policy = _steady()
    policy.hand_over(_outcome(1, 0))
    for _ in range(32):  # speculative steps now take 3x their profile: the forecast says no
        policy.observe_step(True, 4, 3 * policy.predicted_s)
    assert not policy.should_draft(4)  # a recheck begins
    assert _took_in(policy, 1)


def test_a_prepared_forecast_serves_the_next_decision_of_its_batch_size_alone():
    policy = _steady()
    policy.meanwhile(4)  # prepared while the device would verify
    for _ in range(32):  # steps now timed 3x: worked out afresh, the forecast says no
        policy.observe_step(True, 4, 3 * policy.predicted_s)
    assert not policy.forecast_pays(4)
    assert policy.should_draft(4) and policy.steady  # the prepared one, one step old
    assert not policy.should_draft(4)  # the next decision works it out afresh

    policy = _steady()
    policy.meanwhile(4)
    for _ in range(32):
        policy.observe_step(True, 3, 3 * policy.predicted_s)
    assert not policy.should_draft(3)  # 3 requests: the forecast prepared for 4 is not theirs


def test_a_prepared_choice_is_the_choice_made_on_the_spot():
    policy = SpecPolicy(_cost(per_token=0.05, base=1.0, draft=0.2), LEVELS)
    policy.note_reach({7: _chain_gains(0.3), 8: _chain_gains(0.9)})
    policy.observe(8, 6, 5.0)

    def on_the_spot(ids: list[int]) -> tuple[list[int], float]:
        budgets = policy.choose(ids, [policy.expected_gains(i) for i in ids])
        return budgets, policy.predicted_s

    fresh = on_the_spot([7, 8])
    policy.prepare_choice([7, 8])
    policy.predicted_s = 0.0
    assert (policy.choose_next([7, 8]), policy.predicted_s) == fresh
    assert fresh[0][1] > 0  # request 8's tree verifies drafts

    policy.prepare_choice([7, 8])
    policy.note_reach({8: _chain_gains(0.02)})  # its inputs change: it is made afresh
    assert (policy.choose_next([7, 8]), policy.predicted_s) == on_the_spot([7, 8])
    assert policy.choose_next([7, 8])[1] == 0  # request 8 now decodes plain

    policy.prepare_choice([7, 8])
    policy.observe(7, 0, 4.0)  # a calibration changes: made afresh as well
    assert (policy.choose_next([7, 8]), policy.predicted_s) == on_the_spot([7, 8])
    policy.prepare_choice([7])
    assert policy.choose_next([7, 8]) == on_the_spot([7, 8])[0]  # other requests


@pytest.mark.parametrize("spec", ["ddtree", "dflash"])
def test_steady_speculation_is_lossless_and_hands_each_outcome_to_the_next_step(
        small_pair, tmp_path, monkeypatch, spec):
    """Steps that speculate on the forecast's word (untimed, on a flat cost profile) give
    plain decoding's greedy tokens; each one's outcome is taken in by the next speculative
    step, the last one's waits."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    expected, sp, llm = _plain_tokens_and_adaptive_engine(small_pair, spec, max_tokens=40)
    policy = llm.engine.speculative.policy
    policy.timed = False  # no step times: the forecast is the profile's
    policy.cost = _cost(per_token=0.0, draft=0.0)  # verify as cheap as a plain step
    steady = []
    decide = policy.should_draft

    def counted(requests, remaining=None):
        drafts = decide(requests, remaining)
        steady.append(policy.steady)
        return drafts

    policy.should_draft = counted
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert steady[0] and all(steady), steady  # every decode step speculated steadily
    assert policy.recent.steps == len(steady) - 1  # every outcome but the last taken in
    assert policy._pending is not None
