"""benchmarks/sweep_summary.py on synthetic sweep folders: per concurrency and spec, each run's
ratio to `none`, their mean, minimum and 95% interval, the mean budget, and the plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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


def _write_run(root: Path, run: str, rows: list[dict], part: str = "low") -> None:
    folder = root / run / f"{part}_concurrency"
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_table_and_plot(tmp_path):
    runs = {  # run -> part -> rows
        "run1": {"low": [_row("none", 1, 100, 100), _row("ddtree", 1, 90, 100, {"0": 3, "4": 1})],
                 "high": [_row("none", 64, 1000, 1000), _row("ddtree", 64, 1100, 1000)]},
        "run2": {"low": [_row("none", 1, 200, 200), _row("ddtree", 1, 220, 200, {"0": 1})],
                 "high": [_row("none", 64, 800, 800), _row("ddtree", 64, 400, 800)]},
    }
    for run, parts in runs.items():
        for part, rows in parts.items():
            _write_run(tmp_path, run, rows, part)
    summary, plot = _module().summarize(tmp_path)
    lines = summary.read_text().splitlines()
    # Two runs: t(0.975, 1 degree of freedom) = 12.706 standard errors either side.
    assert "| 1 | ddtree | 0.90 | 1.10 | **1.00** | 0.90 | -0.27 to 2.27 | 0.5 |" in lines
    assert "| 64 | ddtree | 1.10 | 0.50 | **0.80** | 0.50 | -3.01 to 4.61 | - |" in lines
    assert not any(line.startswith("| 1 | none") for line in lines)
    assert plot.stat().st_size > 0


def test_runs_of_several_rounds_are_summed_up_round_by_round(tmp_path):
    rows = [dict(_row("none", 4, 100, 100), round=1), dict(_row("ddtree", 4, 80, 100), round=1),
            dict(_row("ddtree", 4, 130, 100), round=2), dict(_row("none", 4, 100, 100), round=2)]
    _write_run(tmp_path, "run1", rows)
    summary, _ = _module().summarize(tmp_path)
    text = summary.read_text()
    assert "Runs: run1.1, run1.2." in text
    assert "| 4 | ddtree | 0.80 | 1.30 | **1.05** | 0.80 | -2.13 to 4.23 | - |" in text.splitlines()


def test_the_interval_narrows_with_runs_and_holds_none_only_within_noise():
    """Student's t interval of the mean ratio against tabulated quantiles: 8 runs of a spec
    2% below `none` with 1% spread exclude 1.0; 4 runs of 0.90-1.10 do not."""
    interval = _module().mean_interval
    assert interval([1.0]) is None
    lo, hi = interval([0.97, 0.99] * 4)  # sd 0.010690, t(0.975, 7) = 2.3646
    assert (lo, hi) == (pytest.approx(0.98 - 0.008937, abs=1e-5),
                        pytest.approx(0.98 + 0.008937, abs=1e-5))
    assert hi < 1.0
    lo, hi = interval([0.9, 1.1, 0.95, 1.05])  # sd 0.091287, t(0.975, 3) = 3.1824
    assert lo < 1.0 < hi and hi - 1.0 == pytest.approx(3.1824 * 0.091287 / 2, abs=1e-4)


def test_adaptive_is_summed_up_over_each_fixed_budget_run_by_run(tmp_path):
    """Each run's ratio of `ddtree` to `ddtree:fixed` and to `ddtree:fixed:7`; a run without
    the fixed spec is left out of that pair's mean."""
    runs = {
        "run1": [_row("none", 1, 100, 100), _row("ddtree", 1, 110, 100),
                 _row("ddtree:fixed", 1, 100, 100), _row("ddtree:fixed:7", 1, 88, 100)],
        "run2": [_row("none", 1, 50, 50), _row("ddtree", 1, 57, 50),
                 _row("ddtree:fixed", 1, 60, 50)],
    }
    for run, rows in runs.items():
        _write_run(tmp_path, run, rows)
    lines = _module().summarize(tmp_path)[0].read_text().splitlines()
    # 1.1 and 0.95: mean 1.025, sd 0.106066, t(0.975, 1) = 12.706 -> +-0.953
    assert ("| 1 | ddtree / ddtree:fixed | 1.100 | 0.950 | **1.025** | 0.950 | 0.072 to 1.978 |"
            in lines)
    assert "| 1 | ddtree / ddtree:fixed:7 | 1.250 | - | **1.250** | 1.250 | - |" in lines


def test_no_adaptive_over_fixed_table_without_a_fixed_spec(tmp_path):
    _write_run(tmp_path, "run1", [_row("none", 1, 100, 100), _row("ddtree", 1, 90, 100)])
    assert "Adaptive over fixed" not in _module().summarize(tmp_path)[0].read_text()
