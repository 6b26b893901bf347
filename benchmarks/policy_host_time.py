"""Host time of the adaptive policy's calls in one speculative decode step, as the engine makes
them (should_draft; choose and note_reach every _CHOICE_STEPS drafting steps, with observe per
request; observe_pace, observe_speculation, forget, observe_step), with the GPU-like cost
profile of `flashtree/spec/simulate.py` and one budget per step (the CUDA-graph path). The
policy has first timed steps at every batch size of `--seen` (as a serving engine has); the
steps accept 3 drafts per request, so that the forecast says speculation pays: all but the
plain steps that re-measure plain decoding speculate.

    python benchmarks/policy_host_time.py [--requests 1] [--steps 20000] [--against REV]

`--against REV` also times the policy module of git revision REV (`git show`), the two in
turn, so that a change's effect is measured side by side. Prints microseconds per step (the
best of five timings per module and round, over three rounds)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import ModuleType

from flashtree.engine.candidates import _CHOICE_STEPS
from flashtree.spec import policy as current
from flashtree.spec.simulate import GPU_LIKE, chain_gains


def policy_at(revision: str) -> ModuleType:
    """flashtree/spec/policy.py as of `revision`, loaded as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{revision}:flashtree/spec/policy.py"], cwd=root,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise ValueError(f"--against {revision!r}: git has no flashtree/spec/policy.py there "
                         f"({shown.stderr.strip()})")
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "policy.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"policy_{revision}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def time_steps(module: ModuleType, requests: int, seen: list[int], steps: int) -> float:
    """Microseconds of policy calls per engine step (the best of five timings)."""
    policy = module.SpecPolicy(GPU_LIKE, module.budget_levels(15), one_budget=True)
    for size in seen:  # plain and speculative steps timed at this batch size
        for _ in range(module._TRUSTED_PLAIN):
            policy.observe_step(False, size, 1e-3)
        policy.run_length = module._WARM_STEPS  # past the untimed steps of a run
        policy.observe_step(True, size, 3e-3)
    ids = list(range(requests))
    gains = chain_gains(0.7, policy.levels)
    drafting, budgets = [0], [policy.levels[-1]] * requests

    def step() -> None:
        n = len(ids)
        if not policy.should_draft(n):  # one step in _PLAIN_PROBE + 1 re-measures plain
            policy.observe_step(False, n, 1e-3)
            return
        if drafting[0] % _CHOICE_STEPS == 0:
            budgets[:] = policy.choose(ids, [policy.expected_gains(i) for i in ids])
            policy.note_reach({i: gains for i in ids})
            for i, b in zip(ids, budgets):
                policy.observe(i, 3, gains[policy.levels.index(b)])
        drafting[0] += 1
        for i in ids:
            policy.observe_pace(i, 3)
        policy.observe_speculation(n, sum(budgets), 3 * n)
        policy.forget(set(ids))
        policy.observe_step(True, n, 3e-3)

    return 1e6 * min(timeit.repeat(step, number=steps, repeat=5)) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seen", default="1,2,4,8,16",
                        help="batch sizes whose steps the policy has timed before")
    parser.add_argument("--against", default=None, help="a git revision to compare with")
    args = parser.parse_args()
    seen = [int(x) for x in args.seen.split(",") if x]
    if min(args.requests, args.steps, *seen) < 1:
        parser.error(f"--requests, --steps and --seen must be >= 1 (got {args.requests}, "
                     f"{args.steps}, {args.seen!r})")
    modules = {"this tree": current}
    if args.against:
        try:
            modules[args.against] = policy_at(args.against)
        except ValueError as e:
            parser.error(str(e))
    best = dict.fromkeys(modules, float("inf"))
    for _ in range(3):  # in turn, so that the machine's drift reaches every module
        for name, module in modules.items():
            best[name] = min(best[name], time_steps(module, args.requests, seen, args.steps))
    for name, us in best.items():
        print(f"{name}: {us:.1f} us of policy calls per decode step of {args.requests} "
              f"request(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
