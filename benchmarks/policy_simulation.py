"""The adaptive policy's settings compared on a synthetic machine (`flashtree/spec/simulate.py`):
committed tokens per second over plain decoding's, where speculation pays 11% and where it
loses, with and without step-time jitter. No model runs; CPU only, about 20 s per setting.

    python benchmarks/policy_simulation.py [--seeds 32] [--steps 3000]

Settings are the policy module's constants (the step-time median window, the probes' share of
a back-off), set here one setting at a time; the first row is the code as it stands."""

from __future__ import annotations

import argparse
import contextlib
import sys

from flashtree.spec import policy as policy_module
from flashtree.spec.policy import SpecPolicy, budget_levels
from flashtree.spec.simulate import GPU_LIKE, GPU_LIKE_PLAIN_S, SyntheticMachine, run_steps

# (speculative steps' time over their profile, jitter): 1.9 pays 11% per committed token, 2.4
# loses 11%, 4 and 8 lose by 2x and 4x.
CASES = [(1.9, 0.0), (1.9, 0.1), (1.9, 0.2), (2.4, 0.1), (4.0, 0.1), (8.0, 0.1)]
SETTINGS = [  # (label, {constant: value}); the first row is the code as it stands
    ("as committed", {}),
    ("median window 8", {"_SCALE_SAMPLES": 8}),
    ("probe share 1/64", {"_PROBE_SHARE": 1 / 64}),
    ("probe share 1/128", {"_PROBE_SHARE": 1 / 128}),
]


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
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    if args.seeds < 1 or args.steps < 1:
        parser.error(f"--seeds and --steps must be >= 1, got {args.seeds} and {args.steps}")
    levels = budget_levels(15)
    print(f"`python {' '.join(sys.argv)}`: {args.seeds} seeds x {args.steps} steps per cell; "
          "tokens/s over plain decoding's (mean over seeds)\n")
    print("| setting | " + " | ".join(f"x{f} jitter {j}" for f, j in CASES) + " |")
    print("|---|" + "---:|" * len(CASES))
    for label, values in SETTINGS:
        with policy_constants(values):
            cells = []
            for factor, jitter in CASES:
                machine = SyntheticMachine(GPU_LIKE_PLAIN_S, factor, jitter=jitter)
                rates = [run_steps(SpecPolicy(GPU_LIKE, levels), machine, args.steps, seed)[1]
                         for seed in range(args.seeds)]
                plain_rate = 1 / (GPU_LIKE_PLAIN_S * machine.mean_slowdown)
                cells.append(f"{sum(rates) / len(rates) / plain_rate:.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
