"""benchmarks/moe.py: the layers section small on a CPU (the loop; the grouped GEMMs need CUDA),
its floors against the touched experts, and the prediction's pieces against independent
answers: the fit recovers a known line, the busiest of one expert group is the closed-form
expected count of touched experts, the busiest of several groups holds at least their mean
share; run on the committed one-GPU measurements, EP never predicts below TP."""

from __future__ import annotations

import random

import pytest

from benchmarks.moe import busiest_rank_experts, expected_touched, fit_layer
from tests.bench.scripts import REPO, run_script

MEASURED = REPO / "benchmarks/results/archive/2026-12-04-moe-gpu.json"


def test_layers_run_small_on_cpu(tmp_path):
    out = tmp_path / "moe.md"
    data = run_script("moe", out, "--shapes", "tiny-moe", "--device", "cpu", "--dtype",
                      "float32", "--reps", "2", "--profile")
    rows = data["shapes"]["tiny-moe"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 8, 32, 128, 16, 64]
    assert all(r["floor_ms"] > 0 and r["loop_ms"] > 0 and "fused_ms" not in r for r in rows)
    # One token routes to exactly top_k (2) of the 8 experts; more tokens to more, at most 8.
    assert rows[0]["experts_touched"] == 2 and all(2 <= r["experts_touched"] <= 8 for r in rows)
    floors = {r["experts_touched"]: r["floor_ms"] for r in rows}
    assert floors[2] < floors[8]  # the floor grows with the experts touched
    assert data["shapes"]["tiny-moe"]["profile"]["top"]
    assert "| 128 |" in out.read_text()


def test_fit_recovers_a_line():
    rows = [{"experts_touched": x, "fused_graph_ms": 0.2 + 0.03 * x} for x in (8, 60, 190, 356)]
    a, c = fit_layer(rows)
    assert a == pytest.approx(0.2) and c == pytest.approx(0.03)


@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_one_group_touches_the_expected_experts(tokens):
    got = busiest_rank_experts(tokens, 64, 4, 1, 2000, random.Random(1))
    # 2000 trials of a count whose standard deviation is at most ~4: the mean within 3%.
    assert got == pytest.approx(expected_touched(tokens, 64, 4), rel=0.03)


def test_busiest_of_several_groups_holds_at_least_the_mean():
    got = busiest_rank_experts(2, 64, 4, 8, 2000, random.Random(2))
    assert got >= expected_touched(2, 64, 4) / 8 + 0.5


def test_prediction_from_the_committed_measurements(tmp_path):
    out = tmp_path / "pred.md"
    data = run_script("moe", out, "--sections", "predict", "--moe", str(MEASURED),
                      "--trials", "50")
    pred = data["predict"]
    assert pred["prediction"] is True and "a PREDICTION" in out.read_text()
    assert pred["machine_measured"] == "NVIDIA H200"
    for tp, ep in zip(pred["layouts"]["tp8"], pred["layouts"]["ep8"]):
        assert tp["step"] == ep["step"] and ep["moe_ms"] >= tp["moe_ms"] > 0
        assert tp["ms"] == pytest.approx(tp["moe_ms"] + tp["other_ms"] + tp["allreduce_ms"])
