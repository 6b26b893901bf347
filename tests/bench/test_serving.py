"""benchmarks/serving.py: the prefix study small (every request after the first finds the shared
prefix cached, the answers equal those computed without caching); the structured study's answers
equal plain decoding's in every spec mode; and the sweep summary on synthetic sweep folders and
on a committed sweep, whose summary it reproduces byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.serving import summarize
from flashtree.bench.results import mean_interval
from tests.bench.scripts import REPO, check_goals, run_script


def test_prefix_study_runs_small(tmp_path):
    out = tmp_path / "prefix.md"
    data = run_script("serving", out, "prefix", "--prefix-tokens", "40", "--conversations",
                      "2", "--turns", "2", "--user-tokens", "5", "--max-tokens", "4")
    assert data["same_answers"] is True and data["divergences"] == []
    on, off = data["runs"]["on"], data["runs"]["off"]
    assert all(r["cached_tokens"] == 0 for r in off) and on[0]["cached_tokens"] == 0
    # Later requests: the system prompt's full pages (32 of 40 tokens) at least.
    assert all(r["cached_tokens"] >= 32 for r in on[1:])
    check_goals(out, data, ("ttft_off_over_on",))


def test_structured_answers_equal_plain_decoding(tmp_path):
    out = tmp_path / "structured.md"
    data = run_script("serving", out, "structured", "--requests", "2", "--max-tokens", "16")
    runs = data["runs"]
    assert set(runs) == {f"{s}/{o}" for s in ("none", "dflash", "ddtree")
                         for o in ("free", "schema")}
    assert all(r["equals_none"] is True and r["tokens_per_step"] >= 1 for r in runs.values())
    # Plain decoding: one token from each prompt's prefill, then one per decode step.
    assert all(runs[f"none/{o}"]["tokens"] - runs[f"none/{o}"]["decode_steps"] == 2
               for o in ("free", "schema"))


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
    summary, plot = summarize(tmp_path)
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
    text = summarize(tmp_path)[0].read_text()
    assert "Runs: run1.1, run1.2." in text
    assert "| 4 | ddtree | 0.80 | 1.30 | **1.05** | 0.80 | -2.13 to 4.23 | - |" in text.splitlines()


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
    lines = summarize(tmp_path)[0].read_text().splitlines()
    # 1.1 and 0.95: mean 1.025, sd 0.106066, t(0.975, 1) = 12.706 -> +-0.953
    assert ("| 1 | ddtree / ddtree:fixed | 1.100 | 0.950 | **1.025** | 0.950 | 0.072 to 1.978 |"
            in lines)
    assert "| 1 | ddtree / ddtree:fixed:7 | 1.250 | - | **1.250** | 1.250 | - |" in lines


def test_the_committed_sweep_summary_is_reproduced(tmp_path):
    committed = REPO / "benchmarks/results/policy_sweep_2026-12-04/gpu_shipped"
    shutil.copytree(committed, tmp_path / "sweep")
    summary, _ = summarize(tmp_path / "sweep")
    assert summary.read_text() == (committed / "summary.md").read_text()


def test_the_interval_narrows_with_runs_and_holds_none_only_within_noise():
    """Student's t interval of the mean ratio against tabulated quantiles: 8 runs of a spec
    2% below `none` with 1% spread exclude 1.0; 4 runs of 0.90-1.10 do not."""
    assert mean_interval([1.0]) is None
    lo, hi = mean_interval([0.97, 0.99] * 4)  # sd 0.010690, t(0.975, 7) = 2.3646
    assert (lo, hi) == (pytest.approx(0.98 - 0.008937, abs=1e-5),
                        pytest.approx(0.98 + 0.008937, abs=1e-5))
    assert hi < 1.0
    lo, hi = mean_interval([0.9, 1.1, 0.95, 1.05])  # sd 0.091287, t(0.975, 3) = 3.1824
    assert lo < 1.0 < hi and hi - 1.0 == pytest.approx(3.1824 * 0.091287 / 2, abs=1e-4)
