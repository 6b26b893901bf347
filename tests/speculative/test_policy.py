"""The speculation policies, driven with synthetic step outcomes (no model): the adaptive rule
speculates where speculative steps commit more tokens per second than plain ones, backs off
exponentially where they do not, and probes again after each back-off."""

from __future__ import annotations

import random

import pytest

from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy, StepResult, size_class_of

BUDGET = 15


def drive(policy, steps: int, requests: int, spec_seconds: float, accepted: float,
          plain_seconds: float = 1.0) -> list[bool]:
    """Run `steps` decode steps of `requests` requests; a speculative step takes
    `spec_seconds` and commits `accepted` tokens per request, a plain one `plain_seconds` and
    one token. Returns which steps speculated."""
    chosen = []
    for _ in range(steps):
        budget = policy.plan(requests)
        seconds, per_request = (spec_seconds, accepted) if budget else (plain_seconds, 1)
        policy.observe(StepResult(budget, requests, round(per_request * requests), seconds))
        chosen.append(budget > 0)
    return chosen


def plain_runs(chosen: list[bool]) -> list[int]:
    """Lengths of the runs of plain steps that follow a speculative step."""
    runs, current, seen_spec = [], 0, False
    for speculate in chosen:
        if speculate:
            if seen_spec and current:
                runs.append(current)
            current, seen_spec = 0, True
        else:
            current += 1
    return runs


def test_fixed_policy_always_drafts_its_budget():
    policy = FixedPolicy(BUDGET)
    assert drive(policy, 50, 4, spec_seconds=9.0, accepted=1.0) == [True] * 50


def test_speculation_that_pays_keeps_running_with_periodic_plain_retimes():
    chosen = drive(AdaptivePolicy(BUDGET), 1000, 1, spec_seconds=1.5, accepted=3.0)
    assert chosen[:5] == [False] * 5  # plain decoding is timed first
    assert sum(chosen) > 0.95 * len(chosen)
    # Plain decoding is re-timed (two steps) between long speculative stretches.
    assert set(plain_runs(chosen)) == {2}


def test_speculation_that_loses_backs_off_exponentially_with_probes():
    """A speculative step costs 1.5 plain ones, so a probe (5 of them) costs 7.5: the first
    back-off is 32 times that, then it doubles up to 1024."""
    chosen = drive(AdaptivePolicy(BUDGET), 8000, 1, spec_seconds=1.5, accepted=1.2)
    runs = plain_runs(chosen)
    assert runs[:4] == [240, 480, 960, 1024]
    assert set(runs[4:]) == {1024}  # capped, yet still probing
    assert sum(chosen) < 0.01 * len(chosen)


def test_probes_where_speculation_costs_much_take_a_small_share_of_the_time():
    """Speculative steps 8 times as long as plain ones (a small model on a CPU at a large
    batch): after the first verdict the probes take at most 1/32 of the time."""
    chosen = drive(AdaptivePolicy(BUDGET), 5000, 64, spec_seconds=8.0, accepted=1.5)
    first_verdict = chosen.index(True) + 5
    later = chosen[first_verdict:]
    spec_time = 8.0 * sum(later)
    assert spec_time / (spec_time + len(later) - sum(later)) < 1 / 32 + 0.01
    assert plain_runs(chosen)[0] == 1024


def test_a_probe_that_now_pays_resumes_speculation():
    policy = AdaptivePolicy(BUDGET)
    drive(policy, 200, 1, spec_seconds=1.5, accepted=1.2)  # backed off
    chosen = drive(policy, 1000, 1, spec_seconds=1.5, accepted=3.0)
    assert sum(chosen[-300:]) > 0.95 * 300
    assert policy.at(1).backoff == 0  # reset once speculation held a whole stretch


def test_size_classes_are_judged_separately():
    policy = AdaptivePolicy(BUDGET)
    small, large = [], []
    for _ in range(300):  # interleaved, as a server's batch sizes come and go
        small += drive(policy, 1, 2, spec_seconds=1.5, accepted=3.0)
        large += drive(policy, 1, 60, spec_seconds=1.5, accepted=1.2)
    assert sum(small[-100:]) > 90
    assert sum(large[-100:]) < 10
    assert size_class_of(60) == 64 and size_class_of(2) == 2 and size_class_of(1) == 1


@pytest.mark.parametrize("accepted", [1.4, 1.6])
def test_the_verdict_compares_tokens_per_second(accepted):
    """A speculative step 1.5x as long as a plain one pays exactly when it commits more than
    1.5 tokens per request."""
    chosen = drive(AdaptivePolicy(BUDGET), 400, 1, spec_seconds=1.5, accepted=accepted)
    assert (sum(chosen[-200:]) > 150) == (accepted > 1.5)


def test_a_larger_batch_starts_backed_off_where_a_smaller_one_lost():
    policy = AdaptivePolicy(BUDGET)
    drive(policy, 300, 4, spec_seconds=1.5, accepted=1.2)  # loses at 4 requests: backed off
    backoff = policy.at(4).backoff
    assert backoff > 0
    larger = drive(policy, backoff, 16, spec_seconds=1.5, accepted=1.2)
    assert not any(larger)  # no first probe of its own: the back-off carried over
    probe = drive(policy, 6, 16, spec_seconds=1.5, accepted=1.2)
    assert probe == [True] * 5 + [False]  # then one probe, lost again: backed off


def test_a_larger_batch_measures_afresh_where_a_smaller_one_won():
    policy = AdaptivePolicy(BUDGET)
    drive(policy, 300, 4, spec_seconds=1.5, accepted=3.0)  # pays at 4 requests
    larger = drive(policy, 40, 16, spec_seconds=1.5, accepted=3.0)
    assert larger[:5] == [False] * 5 and all(larger[10:])  # times plain first, then speculates


def test_a_smaller_batch_starts_speculating_where_a_larger_one_won():
    """A batch that drains (requests finishing) meets smaller size classes for the first time:
    they take the larger class's win instead of timing plain decoding first, and time it later."""
    policy = AdaptivePolicy(BUDGET)
    drive(policy, 300, 64, spec_seconds=1.5, accepted=3.0)  # pays at 64 requests
    smaller = drive(policy, 300, 16, spec_seconds=1.5, accepted=3.0)
    assert smaller[:64] == [True] * 64
    assert policy.at(16).speculation_loses() is False  # plain decoding timed by then
    assert sum(smaller) > 0.95 * len(smaller)


def test_a_smaller_batch_that_took_a_win_still_backs_off_where_it_loses():
    policy = AdaptivePolicy(BUDGET)
    drive(policy, 300, 64, spec_seconds=1.5, accepted=3.0)
    smaller = drive(policy, 600, 16, spec_seconds=1.5, accepted=1.2)
    assert smaller[0] and policy.at(16).backoff > 0
    assert sum(smaller[-300:]) < 10


LADDER = (63, 15, 3)


def drive_ladder(policy, steps: int, requests: int, costs: dict[int, tuple[float, float]]
                 ) -> list[int]:
    """Decode steps where a step at budget b takes costs[b][0] plain steps and commits
    costs[b][1] tokens per request, and tells what each smaller budget would have committed
    (as a best-first tree's step does). Returns the budgets run (0: plain)."""
    chosen = []
    for _ in range(steps):
        budget = policy.plan(requests)
        seconds, per_request = costs[budget] if budget else (1.0, 1.0)
        told = {b: round(costs[b][1] * requests) for b in LADDER if b <= budget} or None
        policy.observe(StepResult(budget, requests, round(per_request * requests), seconds,
                                  told))
        chosen.append(budget)
    return chosen


@pytest.mark.parametrize("costs, best, never", [
    ({63: (2.0, 8.0), 15: (1.5, 5.0), 3: (1.2, 2.5)}, 63, {3}),  # a lone request: a big tree
    ({63: (6.0, 8.0), 15: (2.0, 5.0), 3: (1.3, 2.5)}, 15, set()),  # a large batch: a small one
    ({63: (6.0, 8.0), 15: (3.0, 5.0), 3: (1.1, 2.5)}, 3, set()),
])
def test_each_size_class_runs_the_budget_with_the_most_tokens_per_second(costs, best, never):
    """Plain decoding is timed, then the largest budget (its first step runs cold), then the
    best one's untimed neighbours: a budget below one that lost to the budget above is never
    run."""
    chosen = drive_ladder(AdaptivePolicy(LADDER), 1000, 8, costs)
    explored = [b for b in LADDER if b not in never]
    assert chosen[:5 + 5 + 4 * (len(explored) - 1)] == [0] * 5 + [63] * 5 + [
        b for b in explored[1:] for _ in range(4)]
    assert chosen[-500:].count(best) > 0.9 * 500
    # Its neighbours are re-timed once per stretch, with plain decoding.
    neighbours = {LADDER[i] for i in (LADDER.index(best) - 1, LADDER.index(best) + 1)
                  if 0 <= i < len(LADDER)}
    assert set(chosen[-500:]) == {0, best} | neighbours
    assert never.isdisjoint(chosen)


def test_a_new_size_class_climbs_from_its_neighbours_best():
    policy = AdaptivePolicy(LADDER)
    small_batch = {63: (6.0, 8.0), 15: (2.0, 5.0), 3: (1.3, 2.5)}
    drive_ladder(policy, 300, 8, small_batch)
    assert policy.at(8).best() == 15
    larger = drive_ladder(policy, 100, 16, small_batch)
    # It starts at 15 (not at 63, whose steps cost most), then times 15's neighbours.
    assert larger[:18] == [0] * 5 + [15] * 5 + [3] * 4 + [63] * 4
    assert larger[18:].count(15) > 0.95 * len(larger[18:])


def test_smaller_budgets_learn_their_acceptance_from_larger_steps():
    policy = AdaptivePolicy(LADDER)
    costs = {63: (2.0, 8.0), 15: (1.5, 5.0), 3: (1.2, 2.5)}
    chosen = drive_ladder(policy, 300, 2, costs)
    measured = policy.at(2).budgets
    assert chosen.count(3) < 20  # run only to be timed ...
    assert measured[3].steps > 250  # ... yet its acceptance followed every speculative step
    assert {b: m.accepted for b, m in measured.items()} == pytest.approx(
        {b: c[1] for b, c in costs.items()})


def test_where_every_budget_loses_the_class_backs_off():
    costs = {63: (9.0, 3.0), 15: (4.0, 2.0), 3: (2.0, 1.5)}
    chosen = drive_ladder(AdaptivePolicy(LADDER), 3000, 32, costs)
    assert chosen[5:10] == [63] * 5  # the largest first, then each smaller one is timed
    assert sum(b > 0 for b in chosen[-2000:]) < 0.02 * 2000


def test_followers_plan_what_the_policy_plans():
    """Tensor-parallel ranks follow rank 0's `decisions()`: every step, at every batch size,
    they must plan the budget rank 0's policy then plans."""
    rng = random.Random(0)
    policy = AdaptivePolicy(LADDER)
    for _ in range(3000):
        requests = rng.choice([1, 2, 3, 7, 30, 64])
        scale = requests ** 0.5
        costs = {63: (2.0 * scale, 8.0), 15: (1.5 * scale ** 0.5, 5.0), 3: (1.2, 2.5)}
        followed = policy.decisions().plan(requests)
        assert followed == drive_ladder(policy, 1, requests, costs)[0]


def test_a_costly_neighbour_is_retimed_as_often_as_it_costs():
    """At a large batch the big tree's step costs 3 of the best budget's: re-timing it every
    stretch would cost 3 steps in 64, so it is re-timed every third stretch; the cheap
    neighbour every stretch."""
    costs = {63: (6.0, 8.0), 15: (2.0, 5.0), 3: (1.3, 2.5)}
    chosen = drive_ladder(AdaptivePolicy(LADDER), 3000, 8, costs)
    late = chosen[500:]
    assert late.count(3) > 2.5 * late.count(63) > 0


def test_a_larger_budget_is_never_judged_to_accept_less_than_a_smaller_one():
    """The big tree is timed first, while acceptance happens to be low; the smaller budgets
    learn theirs later, when it is high. A larger tree holds the smaller one's nodes, so its
    estimate is raised to theirs instead of staying at its unlucky reading."""
    policy = AdaptivePolicy(LADDER)
    drive_ladder(policy, 10, 4, {63: (2.0, 3.0), 15: (1.5, 2.5), 3: (1.2, 1.5)})
    drive_ladder(policy, 40, 4, {63: (2.0, 8.0), 15: (1.5, 6.0), 3: (1.2, 2.5)})
    measured = policy.at(4)
    assert measured.budgets[63].accepted < measured.budgets[15].accepted  # its own reading
    accepted = measured.accepted()
    assert accepted[63] == accepted[15] == measured.budgets[15].accepted > accepted[3]
