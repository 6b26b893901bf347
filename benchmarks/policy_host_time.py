"""Host time of the adaptive policy's calls in one speculative decode step, as the engine makes
them (should_draft; choose_next every _CHOICE_STEPS drafting steps; meanwhile, and
prepare_choice before a step that chooses; hand_over, forget, observe_step), with the GPU-like
cost profile of `flashtree/spec/simulate.py` and one budget per step (the CUDA-graph path).
The policy has first timed steps at every batch size of `--seen` (as a serving engine has); the
steps accept 3 drafts per request, so that the forecast says speculation pays: all but the
plain steps that re-measure plain decoding speculate, steadily.

    python benchmarks/policy_host_time.py [--requests 1] [--steps 20000]

Prints microseconds per step: all of the calls, and those the engine makes while the device
runs the step's target forward (`SpeculativeDecoder._policy_meanwhile`), where the host would
wait for the device anyway (the best of five timings, over three rounds). Older revisions'
copies of this script time the calls their engines made."""

from __future__ import annotations

import argparse
import time
import timeit

from flashtree.engine.candidates import _CHOICE_STEPS
from flashtree.spec.budgets import budget_levels
from flashtree.spec.policy import (
    _COLD_PLAIN_STEPS,
    _TRUSTED_PLAIN,
    _WARM_STEPS,
    SpecPolicy,
    StepOutcome,
)
from flashtree.spec.simulate import GPU_LIKE, chain_gains


def time_steps(requests: int, seen: list[int], steps: int) -> tuple[float, float]:
    """Microseconds per engine step of all the policy's calls, and of those made while the
    device would verify (the best of five timings)."""
    policy = SpecPolicy(GPU_LIKE, budget_levels(15), one_budget=True)
    for size in seen:  # plain and speculative steps timed at this batch size
        for _ in range(_COLD_PLAIN_STEPS + _TRUSTED_PLAIN):  # the first after speculation
            policy.observe_step(False, size, 1e-3)  # (the last size's) is not timed
        policy.run_length = _WARM_STEPS  # past the untimed steps of a run
        policy.observe_step(True, size, 3e-3)
    ids = list(range(requests))
    gains = chain_gains(0.7, policy.levels)
    drafting, budgets = [0], [policy.levels[-1]] * requests
    meanwhile = [0.0]  # seconds of the calls made while the device would verify

    def step() -> None:
        n = len(ids)
        if not policy.should_draft(n):  # one step in _PLAIN_PROBE + 1 re-measures plain
            policy.observe_step(False, n, 1e-3)
            return
        chooses = drafting[0] % _CHOICE_STEPS == 0
        if chooses:
            budgets[:] = policy.choose_next(ids)
        drafting[0] += 1
        start = time.perf_counter()
        policy.meanwhile(n)
        if policy.steady and drafting[0] % _CHOICE_STEPS == 0:  # the next step chooses
            policy.prepare_choice(ids)
        meanwhile[0] += time.perf_counter() - start
        predicted = gains[policy.levels.index(budgets[0])]
        policy.hand_over(StepOutcome(
            n, sum(budgets), 3 * n, [(i, 3) for i in ids],
            [(i, 3, predicted) for i in ids] if chooses else [],
            {i: gains for i in ids} if chooses else {}))
        policy.forget(set(ids))
        policy.observe_step(True, n, 3e-3)

    best = (float("inf"), 0.0)
    for _ in range(5):
        meanwhile[0] = 0.0
        seconds = timeit.timeit(step, number=steps)
        best = min(best, (seconds, meanwhile[0]))
    return 1e6 * best[0] / steps, 1e6 * best[1] / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seen", default="1,2,4,8,16",
                        help="batch sizes whose steps the policy has timed before")
    args = parser.parse_args()
    seen = [int(x) for x in args.seen.split(",") if x]
    if min(args.requests, args.steps, *seen) < 1:
        parser.error(f"--requests, --steps and --seen must be >= 1 (got {args.requests}, "
                     f"{args.steps}, {args.seen!r})")
    total, meanwhile = min(time_steps(args.requests, seen, args.steps) for _ in range(3))
    print(f"{total:.1f} us of policy calls per decode step of {args.requests} request(s), "
          f"{meanwhile:.1f} of them while the device would verify, {total - meanwhile:.1f} on "
          f"the step's path")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
