"""benchmarks/oracle_bench.py on a tiny random pair on the CPU: every speculative run commits
exactly the plain run's tokens, `none` never speculates, the DFlash chain accepts what the
oracle's P predicts, the acceptance curve rises with P, and the report carries the issue's
keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_oracle_bench_concurrency_one_on_a_tiny_pair(tmp_path):
    out = tmp_path / "oracle.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "oracle_bench.py"), "--shape", "tiny",
         "--device", "cpu", "--dtype", "float32", "--ctx", "32", "--tokens", "160", "--skip",
         "8", "--prompts", "3", "--trials", "16", "--sections", "calibrate,c1", "--out",
         str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    c1 = res["c1"]
    rows = [c1["dflash"], c1["dflash_adaptive"], c1["ddtree_topk_cap"],
            *c1["ddtree_budgets"].values(), *c1["curve_dflash"], *c1["curve_ddtree"]]
    assert all(r["equal_to_plain"] == 1.0 for r in rows)
    # `none` is plain decoding throughout (an engine without the drafter), fixed DFlash never.
    assert c1["none"]["speculative_share"] == 0.0 and c1["dflash"]["speculative_share"] == 1.0
    p = res["calibrate"]["p"]
    assert abs(1 + sum(p**i for i in range(1, 16)) - 6.6) < 1e-6
    # About 70 steps: the chain's per-step acceptance has a standard deviation near 4.5.
    assert abs(c1["dflash"]["tau"] - 6.6) < 4 * 4.5 / math.sqrt(70)
    taus = [point["tau"] for point in c1["curve_dflash"]]
    assert taus[-1] > taus[0] + 5  # the plot's chain points span the acceptance range
    for key in ("dflash_over_none_c1", "ddtree_over_none_c1", "ddtree_over_dflash_c1",
                "measured_tau_dflash", "measured_tau_ddtree"):
        assert res[key] > 0
    report = out.with_suffix(".md").read_text()
    assert "| `dflash_over_none_c1` |" in report and "paper-DDTree" in report


def test_sweep_report_pairs_rounds_and_gives_intervals():
    """Each method's tokens/s over `none` is taken round by round; the report gives the mean and
    its 95% interval, and the summary the lowest lower bound of the adaptive methods."""
    from benchmarks.oracle_report import report, summary

    def runs(*rates):
        return [{"concurrency": 1, "runs": [{"tokens_per_s": r} for r in rates]}]
    sw = {"levels": [1], "ddtree_budget": 15, "tokens": 128, "rounds": 3, "rows": {
        "none": runs(100, 200, 100), "dflash:fixed": runs(300, 600, 300),
        "dflash": runs(110, 180, 120)}}
    keys = summary({"sweep": sw})
    assert math.isclose(keys["min_spec_over_none"], (110 + 180 + 120) / 400)
    ratios = [1.1, 0.9, 1.2]  # round j over round j, not means over means
    mean = sum(ratios) / 3
    half = 4.302653 * (sum((r - mean) ** 2 for r in ratios) / 2) ** 0.5 / 3 ** 0.5  # t(0.975, 2)
    assert math.isclose(keys["min_spec_over_none_low"], mean - half, rel_tol=1e-5)
    text = report({"sweep": sw})
    assert f"| 1 | 3.00 (3.00-3.00) | {mean:.2f} ({mean - half:.2f}-{mean + half:.2f}) |" in text
