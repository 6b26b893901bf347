"""Host time of the adaptive policy's calls in one speculative decode step, as the engine makes
them (should_draft, choose, observe per request, observe_speculation, note_reach,
forget, observe_step), with the GPU-like cost profile of `flashtree/spec/simulate.py` and one
budget per step (the CUDA-graph path). The steps accept 3 drafts per request, so that the
forecast says speculation pays: all but the plain steps that re-measure plain decoding speculate.

    python benchmarks/policy_host_time.py [--requests 1] [--steps 20000]

Prints microseconds per step (the best of five timings)."""

from __future__ import annotations

import argparse
import timeit

from flashtree.spec.policy import SpecPolicy, budget_levels
from flashtree.spec.simulate import GPU_LIKE, chain_gains


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    if min(args.requests, args.steps) < 1:
        parser.error(f"--requests and --steps must be >= 1 (got {args.requests}, {args.steps})")
    policy = SpecPolicy(GPU_LIKE, budget_levels(15), one_budget=True)
    ids = list(range(args.requests))
    gains = chain_gains(0.7, policy.levels)

    def step() -> None:
        n = len(ids)
        if not policy.should_draft(n):  # one step in _PLAIN_PROBE + 1 re-measures plain
            policy.observe_step(False, n, 1e-3)
            return
        budgets = policy.choose(ids, [policy.expected_gains(i) for i in ids])
        for i, b in zip(ids, budgets):
            policy.observe(i, 3, gains[policy.levels.index(b)])
        policy.note_reach({i: gains for i in ids})
        policy.observe_speculation(n, sum(budgets), 3 * n)
        policy.forget(set(ids))
        policy.observe_step(True, n, 3e-3)

    best = min(timeit.repeat(step, number=args.steps, repeat=5))
    print(f"{1e6 * best / args.steps:.1f} us of policy calls per decode step of "
          f"{args.requests} request(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
