"""benchmarks/moe_predict.py's pieces against independent answers: the fit recovers a known
line, the busiest of one expert group is the closed-form expected count of touched experts, the
busiest of several groups is at least their mean share; and the script runs on the committed
one-GPU measurements, its EP prediction never below its TP one (a busiest rank only adds)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from tests.helpers import run_benchmark

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.moe_predict import (  # noqa: E402
    busiest_rank_experts,
    expected_touched,
    fit_layer,
)


def test_fit_recovers_a_line():
    rows = [{"experts_touched": x, "fused_graph_ms": 0.2 + 0.03 * x} for x in (8, 60, 190, 356)]
    a, c = fit_layer(rows)
    assert a == pytest.approx(0.2) and c == pytest.approx(0.03)


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_one_group_touches_the_expected_experts(tokens):
    got = busiest_rank_experts(tokens, 64, 4, 1, 2000, random.Random(1))
    assert got == pytest.approx(expected_touched(tokens, 64, 4), rel=0.03)


def test_busiest_of_several_groups_holds_at_least_the_mean():
    got = busiest_rank_experts(2, 64, 4, 8, 2000, random.Random(2))
    assert got >= expected_touched(2, 64, 4) / 8 + 0.5


def test_script_predicts_from_the_committed_measurements(tmp_path):
    out = tmp_path / "pred.md"
    moe = ROOT / "benchmarks" / "results" / "2026-12-04-moe-gpu.json"
    res = run_benchmark("moe_predict.py", out, "--moe", str(moe), "--trials", "50")
    assert res["prediction"] is True and "PREDICTION" in out.read_text()
    tp, ep = res["layouts"]["tp8"], res["layouts"]["ep8"]
    for t, e in zip(tp, ep):
        assert t["step"] == e["step"] and e["moe_ms"] >= t["moe_ms"] > 0
