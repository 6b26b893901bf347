"""The adaptive policy's settings compared on a synthetic machine (`flashtree/spec/simulate.py`):
committed tokens per second over plain decoding's, where speculation pays 11% and where it
loses, with and without step-time jitter, where acceptance moves with the text (stretches
the drafter drafts badly, then well), and where speculative steps slow down in stretches. No
model runs; CPU only, about 40 s per setting.

    python benchmarks/policy_simulation.py [--seeds 32] [--steps 6000] [--cold-plain 1.0]

`--cold-plain F`: the first plain step after speculative ones takes F x a plain step (on an
H200, 1.11x in step censuses at 16 and 64 requests, up to 1.3x after long runs of
speculation).

Settings are the policy module's constants (the step-time median window, the probes' share of
a back-off, the acceptance's weight when a probe begins, how many steps its standard error
counts as one sample, how far apart plain steps re-measure plain decoding), set here one
setting at a time; the
first row is the code as it stands, the last the full tree every step (`fixed`)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from flashtree.spec import policy as policy_module
from flashtree.spec.budgets import budget_levels
from flashtree.spec.policy import SpecPolicy
from flashtree.spec.simulate import (
    GPU_LIKE,
    GPU_LIKE_PLAIN_S,
    SyntheticMachine,
    fixed_policy,
    run_steps,
)

# Text whose drafts are accepted with probability 0.3 for 300 steps, then 0.7 for 900, and so
# on; or 0.35 for 150, then 0.65 for 450 (steady text: 0.58, `SyntheticMachine.accept`).
BAD_THEN_GOOD = ((300, 0.3), (900, 0.7))
SHORTER_STRETCHES = ((150, 0.35), (450, 0.65))
# Speculative steps at their usual time for 400 steps, then at 1.25x for 100 (a host's slow
# stretch), and so on.
SLOW_STRETCHES = ((400, 1.0), (100, 1.25))
# (speculative steps' time over their profile, jitter, acceptance stretches, slow stretches):
# at 0.58, 1.9 pays 11% per committed token, 2.4 loses 11%, 4 and 8 lose by 2x and 4x.
CASES = [(1.9, 0.0, (), ()), (1.9, 0.1, (), ()), (1.9, 0.2, (), ()), (2.4, 0.1, (), ()),
         (4.0, 0.1, (), ()), (8.0, 0.1, (), ()), (1.9, 0.1, BAD_THEN_GOOD, ()),
         (2.4, 0.1, BAD_THEN_GOOD, ()), (1.9, 0.1, SHORTER_STRETCHES, ()),
         (2.4, 0.1, SHORTER_STRETCHES, ()), (1.9, 0.1, (), SLOW_STRETCHES),
         (2.4, 0.1, (), SLOW_STRETCHES)]
SETTINGS = [  # (label, {constant: value}); the first row is the code as it stands
    ("as committed", {}),
    ("median window 8", {"_SCALE_SAMPLES": 8}),
    ("probe share 1/64", {"_PROBE_SHARE": 1 / 64}),
    ("probe share 1/128", {"_PROBE_SHARE": 1 / 128}),
    ("acceptance weighs 8 steps when a probe begins", {"_PROBE_PRIOR_STEPS": 8}),
    ("acceptance kept whole when a probe begins", {"_PROBE_PRIOR_STEPS": 10**9}),
    ("probes of two timed steps", {"_PROBE_STEPS": 3}),
    ("a young acceptance average's steps counted as independent", {"_CORRELATED_STEPS": 1}),
    ("a plain step every 64 speculative ones, never fewer", {"_PLAIN_PROBE_DOUBLINGS": 0}),
    ("every plain step timed (the first after speculative ones too)",
     {"_COLD_PLAIN_STEPS": 0, "_MIN_BACKOFF": 8}),
]
FIXED = "fixed (full tree every step)"


@contextlib.contextmanager
def policy_constants(values: dict[str, float]):
    saved = {name: getattr(policy_module, name) for name in values}
    for name, value in values.items():
        setattr(policy_module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(policy_module, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--cold-plain", type=float, default=1.0)
    args = parser.parse_args()
    if args.seeds < 1 or args.steps < 1:
        parser.error(f"--seeds and --steps must be >= 1, got {args.seeds} and {args.steps}")
    if args.cold_plain < 1.0:
        parser.error(f"--cold-plain is a slowdown, >= 1.0, got {args.cold_plain}")
    levels = budget_levels(15)
    print(f"`python {' '.join(sys.argv)}`: {args.seeds} seeds x {args.steps} steps per cell; "
          "tokens/s over plain decoding's (mean over seeds)\n")
    print("| setting | " + " | ".join(
        f"x{f} jitter {j}" + (f" {'/'.join(f'{n}@{a}' for n, a in st)}" if st else "")
        + (f" slow {'/'.join(f'{n}@x{k}' for n, k in slow)}" if slow else "")
        for f, j, st, slow in CASES) + " |")
    print("|---|" + "---:|" * len(CASES))
    for label, values in [*SETTINGS, (FIXED, {})]:
        with policy_constants(values):
            cells = []
            for factor, jitter, stretches, slowdowns in CASES:
                machine = SyntheticMachine(GPU_LIKE_PLAIN_S, factor, jitter=jitter,
                                           stretches=stretches, slowdowns=slowdowns,
                                           cold_plain=args.cold_plain)
                rates = [run_steps(fixed_policy(GPU_LIKE, levels) if label == FIXED
                                   else SpecPolicy(GPU_LIKE, levels),
                                   machine, args.steps, seed)[1] for seed in range(args.seeds)]
                plain_rate = 1 / (GPU_LIKE_PLAIN_S * machine.mean_slowdown)
                cells.append(f"{sum(rates) / len(rates) / plain_rate:.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
