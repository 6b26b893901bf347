"""benchmarks/moe.py: the layers section small on a CPU (the loop; the grouped GEMMs need CUDA),
also as a rank's share of a layout, its floors against the touched experts; the Kimi report's
fit recovers a known line and its prediction adds the collectives a rank launches, each at the
assumed latency, to the rank's measured time per token, checked against arithmetic by hand."""

from __future__ import annotations

import json

import pytest

from flashtree.bench.kimi import fit_layer
from tests.bench.scripts import run_script


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


def test_layers_of_a_rank_share_touch_its_experts(tmp_path):
    data = run_script("moe", tmp_path / "moe.md", "--shapes", "tiny-moe", "--layout", "ep2",
                      "--device", "cpu", "--dtype", "float32", "--reps", "1")
    rows = data["shapes"]["tiny-moe"]["rows"]
    # 4 of the 8 experts live on rank 0 of ep2: a token's 2 choices touch 0-2 of them.
    assert data["layout"] == "ep2" and all(r["experts_touched"] <= 4 for r in rows)
    assert rows[0]["experts_touched"] <= 2


def test_kimi_prediction_adds_the_rank_collectives(tmp_path):
    run = {"layout": "tp8", "layers": 61, "draft_layers": 6,
           "steps": {"ar": {"1": {"ms": 10.0, "floor_ms": 2.0}}},
           "c1": {"none": {"tokens_per_s": 100.0, "tau": 1.0},
                  "dflash": {"tokens_per_s": 250.0, "tau": 5.0},
                  "ddtree_budgets": {"31": {"tokens_per_s": 300.0, "tau": 6.0}},
                  "best_budget": 31}}
    path = tmp_path / "tp8.json"
    path.write_text(json.dumps(run))
    data = run_script("moe", tmp_path / "kimi.md", "--sections", "kimi", "--ranks", str(path),
                      "--allreduce-us", "10")
    # Plain: 124 collectives a token (2 per layer, embedding, LM head) at 10 us after 10 ms.
    assert data["kimi_tp8_predicted_ar_tps_c1"] == pytest.approx(1 / (0.01 + 124e-5))
    # DFlash: 124 + the drafter's 14 per step of 5 tokens, after 4 ms a token.
    assert data["kimi_tp8_predicted_dflash_tps_c1"] == pytest.approx(1 / (0.004 + 138e-5 / 5))
    assert data["kimi_tp8_rank_decode_b1_ms"] == 10.0
    assert data["kimi_tp8_rank_ddtree_over_dflash_c1"] == pytest.approx(1.2)
    assert "PREDICTION" in (tmp_path / "kimi.md").read_text()
