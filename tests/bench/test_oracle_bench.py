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
