"""A guard against slowdowns: this run's step times (AR at batch 1, draft, chain and tree
verify; on CUDA their graphs replayed alone decide) against the last committed results of the
same shape, depth, layout and GPU, run before a kernel change lands
(`benchmarks/speculative.py --sections steps --guard`). Times from another GPU or shape say
nothing, so only an exact match is compared."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MATCH = ("shape", "layers", "layout")  # what makes two runs' steps comparable, with the GPU


def step_times(steps: dict, device: bool = False) -> dict[str, float]:
    """The steps section's guarded times (ms): AR at batch 1, draft, chain and 64-node verify;
    with `device`, their graphs replayed alone (`timing.replay_ms`), where measured."""
    chain, key = steps.get("chain", 16), "replay_ms" if device else "ms"
    times = {"ar_b1_ms": steps["ar"].get("1", {}).get(key),
             "draft_ms": steps.get(f"draft_{key}"),
             f"verify{chain}_ms": steps.get(f"verify{chain}_{key}"),
             "verify64_ms": steps.get(f"verify64_{key}")}
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
    than before by more than `tolerance` (0.03: 3%). Where both runs timed the step's graph
    alone, that ratio (`replay_ratio`) decides: the whole step's carries the host's jitter."""
    old, new = step_times(before), step_times(now)
    old_device, new_device = step_times(before, device=True), step_times(now, device=True)
    rows = []
    for k in (k for k in new if k in old):
        row = {"step": k, "before_ms": old[k], "now_ms": new[k], "ratio": new[k] / old[k]}
        if k in old_device and k in new_device:
            row.update(before_replay_ms=old_device[k], now_replay_ms=new_device[k],
                       replay_ratio=new_device[k] / old_device[k])
        row["slower"] = row.get("replay_ratio", row["ratio"]) > 1 + tolerance
        rows.append(row)
    return rows
