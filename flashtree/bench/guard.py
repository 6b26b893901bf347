"""A guard against slowdowns: this run's step times (AR at batch 1, draft, chain and tree
verify) against the last committed results of the same shape, depth, layout and GPU, run
before a kernel change lands (`benchmarks/speculative.py --sections steps --guard`). Times
from another GPU or shape say nothing, so only an exact match is compared."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MATCH = ("shape", "layers", "layout")  # what makes two runs' steps comparable, with the GPU


def step_times(steps: dict) -> dict[str, float]:
    """The steps section's guarded times (ms): AR at batch 1, draft, chain and 64-node verify."""
    chain = steps.get("chain", 16)
    times = {"ar_b1_ms": steps["ar"].get("1", {}).get("ms"), "draft_ms": steps.get("draft_ms"),
             f"verify{chain}_ms": steps.get(f"verify{chain}_ms"),
             "verify64_ms": steps.get("verify64_ms")}
    return {k: v for k, v in times.items() if v is not None}


def _gpu(run: dict) -> str | None:
    machine = run.get("machine")
    return machine.get("gpu") if isinstance(machine, dict) else None


def last_results(run: dict, results: Path = RESULTS, exclude: Path | None = None
                 ) -> Path | None:
    """The newest JSON under `results` (names start with their date) measuring steps of `run`'s
    shape, depth and layout on its GPU, or None."""
    found = []
    for path in results.rglob("*.json"):
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(old, dict) and "ar" in old.get("steps", {}) and _gpu(old) == _gpu(run)
                and all(old.get(k) == run.get(k) for k in MATCH)):
            found.append((path.name, path))
    return max(found)[1] if found else None


def compare(now: dict, before: dict, tolerance: float) -> list[dict]:
    """Per guarded step in both: before and now (ms), their ratio, and whether now is slower
    than before by more than `tolerance` (0.03: 3%)."""
    old, new = step_times(before), step_times(now)
    return [{"step": k, "before_ms": old[k], "now_ms": new[k], "ratio": new[k] / old[k],
             "slower": new[k] > old[k] * (1 + tolerance)} for k in new if k in old]
