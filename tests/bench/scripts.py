"""Running a benchmark script as a user does (`python -m benchmarks.NAME`), and the checks every
report must pass: the goals' keys at the JSON's top level, and a goals table that says what the
JSON says."""

from __future__ import annotations

import json
import math
import operator
import os
import subprocess
import sys
from pathlib import Path

from flashtree.bench.results import GOALS

REPO = Path(__file__).resolve().parents[2]
_OPS = {"<=": operator.le, ">=": operator.ge, ">": operator.gt}


def run_script(name: str, out: Path, *args: str, timeout: int = 1200) -> dict:
    """Run `python -m benchmarks.<name> ARGS --out OUT` from `out`'s folder; assert it succeeded
    and return the JSON it wrote beside the report."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args, "--out", str(out)],
                         capture_output=True, text=True, timeout=timeout, cwd=out.parent, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text())


def check_goals(out: Path, data: dict, keys: tuple[str, ...]) -> None:
    """Each goal of `keys` is at the JSON's top level and in the report's goals table with the
    same value, and both say met / not met as the registry's threshold does."""
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = cells
    assert set(data["goals"]) == set(keys) and set(keys) <= set(rows), (set(rows), keys)
    for key in keys:
        value, goal, (_, _, shown, target, verdict) = data[key], GOALS[key], rows[key]
        assert target == f"{goal.op} {goal.threshold}", (key, target)
        if value is None:
            assert (shown, verdict, data["goals"][key]["met"]) == ("n/a", "n/a", None), key
            continue
        assert math.isfinite(value) and shown == f"{value:.3f}", (key, value, shown)
        met = _OPS[goal.op](value, goal.threshold)
        assert data["goals"][key]["met"] is met and verdict == ("met" if met else "NOT met"), key
