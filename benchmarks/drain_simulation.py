"""The drain rule (`flashtree/spec/drain.py`) against simulated draining batches: N requests
with equal tokens left speculate until the last one ends, or decode plain, on a machine whose
step costs the same at any batch size (a small model on a GPU: a speculative step 2.2 plain
ones). Each request accepts each next draft of a 7-deep chain with its own probability (drawn
around the case's mean), so requests commit at different paces, step to step and on average.

Per case: the gain a step-by-step forecast sees (mean committed tokens per step over the
speculative step's cost), the true ratio of plain to speculative time until the last request
ends (the mean over simulated batches), the rule's expected ratio (from the paces of 64
earlier requests of the same kind), and its verdict. No model runs; CPU only, a few seconds.

    python benchmarks/drain_simulation.py [--trials 400]"""

from __future__ import annotations

import argparse
import random

from flashtree.spec.drain import (
    DrainWatch,
    RequestPace,
    expected_finish_seconds,
    finish_seconds,
)

SPEC_OVER_PLAIN = 2.2  # a speculative step's time, in plain steps, at any batch size
DEPTH = 7
TOKENS_LEFT = 128
HISTORY = 64  # earlier requests whose paces the rule draws from
SPREAD = 0.1  # requests' acceptance probabilities: uniform within +- this of the mean


def finish_step(accept: float, tokens: int, rng: random.Random) -> int:
    """Speculative steps a request needs to commit `tokens` (accepted drafts + 1 per step)."""
    steps = done = 0
    while done < tokens:
        accepted = 0
        while accepted < DEPTH and rng.random() < accept:
            accepted += 1
        done += 1 + accepted
        steps += 1
    return steps


def case(mean_accept: float, requests: int, trials: int, rng: random.Random
         ) -> tuple[float, float, float, bool]:
    """(forecast's gain per step, simulated plain / speculative time, the rule's expected
    ratio, its verdict) for `requests` requests of this mean acceptance."""
    def draw() -> float:
        return rng.uniform(mean_accept - SPREAD, mean_accept + SPREAD)

    watch = DrainWatch()
    for seq_id in range(HISTORY):
        watch.live[seq_id] = RequestPace(finish_step(draw(), TOKENS_LEFT, rng), TOKENS_LEFT)
    watch.forget(set())
    paces = watch.samples()

    def step_s(n: int) -> float:
        return SPEC_OVER_PLAIN

    remaining = [TOKENS_LEFT] * requests
    plain = finish_seconds([float(r) for r in remaining], lambda n: 1.0)
    spec = sum(finish_seconds([float(finish_step(draw(), TOKENS_LEFT, rng))
                               for _ in range(requests)], step_s) for _ in range(trials)) / trials
    expected = expected_finish_seconds(remaining, paces, step_s)
    tokens_per_step = len(paces) / sum(paces)  # the history's, over all its steps
    verdict = watch.speculation_pays(remaining, step_s, lambda n: 1.0)
    return tokens_per_step / SPEC_OVER_PLAIN, plain / spec, plain / expected, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=400)
    args = ap.parse_args()
    if args.trials < 1:
        ap.error(f"--trials must be a positive integer, not {args.trials}")
    rng = random.Random(0)
    print(f"`python benchmarks/drain_simulation.py --trials {args.trials}`: {TOKENS_LEFT} tokens "
          f"left per request, a speculative step {SPEC_OVER_PLAIN}x a plain one at any batch "
          f"size\n")
    print("| mean acceptance | requests | forecast's gain per step | plain / speculative time "
          "(simulated) | the rule's expectation | the rule speculates | right |")
    print("|---:|---:|---:|---:|---:|---|---|")
    for mean_accept in (0.5, 0.55, 0.6, 0.65, 0.7):
        for requests in (2, 4, 8, 16):
            gain, true, expected, verdict = case(mean_accept, requests, args.trials, rng)
            right = verdict == (true >= 1.0)
            print(f"| {mean_accept:.2f} | {requests} | {gain:.3f} | {true:.3f} | {expected:.3f} | "
                  f"{'yes' if verdict else 'no'} | {'yes' if right else '**no**'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
