"""benchmarks/sweep_summary.py on synthetic sweep folders: per concurrency and spec, each run's
ratio to `none`, their mean and minimum, the mean budget, and the plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("sweep_summary",
                                                  ROOT / "benchmarks" / "sweep_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(spec: str, concurrency: int, throughput: float, none: float, budgets=None) -> dict:
    return {"spec": spec, "concurrency": concurrency, "output_throughput": throughput,
            "speedup_vs_none": throughput / none, "budget_histogram": budgets or {}}


def test_summary_table_and_plot(tmp_path):
    runs = {  # run -> part -> rows
        "run1": {"low": [_row("none", 1, 100, 100), _row("ddtree", 1, 90, 100, {"0": 3, "4": 1})],
                 "high": [_row("none", 64, 1000, 1000), _row("ddtree", 64, 1100, 1000)]},
        "run2": {"low": [_row("none", 1, 200, 200), _row("ddtree", 1, 220, 200, {"0": 1})],
                 "high": [_row("none", 64, 800, 800), _row("ddtree", 64, 400, 800)]},
    }
    for run, parts in runs.items():
        for part, rows in parts.items():
            folder = tmp_path / run / f"{part}_concurrency"
            folder.mkdir(parents=True)
            (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, plot = _module().summarize(tmp_path)
    lines = summary.read_text().splitlines()
    assert "| 1 | ddtree | 0.90 | 1.10 | **1.00** | 0.90 | 0.5 |" in lines
    assert "| 64 | ddtree | 1.10 | 0.50 | **0.80** | 0.50 | - |" in lines
    assert not any(line.startswith("| 1 | none") for line in lines)
    assert plot.stat().st_size > 0


def test_runs_of_several_rounds_are_summed_up_round_by_round(tmp_path):
    rows = [dict(_row("none", 4, 100, 100), round=1), dict(_row("ddtree", 4, 80, 100), round=1),
            dict(_row("ddtree", 4, 130, 100), round=2), dict(_row("none", 4, 100, 100), round=2)]
    folder = tmp_path / "run1" / "low_concurrency"
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, _ = _module().summarize(tmp_path)
    text = summary.read_text()
    assert "Runs: run1.1, run1.2." in text
    assert "| 4 | ddtree | 0.80 | 1.30 | **1.05** | 0.80 | - |" in text.splitlines()
