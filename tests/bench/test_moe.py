"""benchmarks/moe.py: the layers section small on a CPU (the loop; the grouped GEMMs need CUDA),
also as a rank's share of a layout, its floors against the touched experts; the Kimi report's
fit recovers a known line and its prediction adds the collectives a rank launches, each at the
assumed latency, to the rank's measured time per token, checked against arithmetic by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtree.bench.kimi import KIMI_GOALS, fit_layer
from tests.bench.scripts import REPO, check_goals, run_script


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


def _kimi_stage_outputs(folder: Path, mla_heads: int = 8) -> None:
    """What each stage of benchmarks/kimi_rank.sh leaves, made up: a TP8 rank with its sweep,
    an EP8 rank with steps only, the MoE layer's fit, MLA at `mla_heads` and the Qwen3-30B-A3B
    shape's steps."""
    sweep = {name: [{"concurrency": c, "runs": [{"tokens_per_s": rate * c, "tau": tau,
                                                 "equal_to_plain": 1.0}]} for c in (1, 32)]
             for name, rate, tau in (("none", 100.0, 1.0), ("dflash", 200.0, 4.5))}
    tp8 = {"layout": "tp8", "layers": 61, "draft_layers": 6,
           "steps": {"ar": {"1": {"ms": 10.0, "floor_ms": 2.0}}, "draft_ms": 1.5,
                     "draft_floor_ms": 0.5},
           "verify": {"ms": {"1024": {"8": 20.0}}, "floor_ms": {"1024": {"8": 8.0}},
                      "over_ar_step": {"1024": {"8": 2.0}}},
           "c1": {"none": {"tokens_per_s": 100.0, "tau": 1.0},
                  "dflash": {"tokens_per_s": 250.0, "tau": 5.0},
                  "ddtree_budgets": {"7": {"tokens_per_s": 300.0, "tau": 6.0}},
                  "best_budget": 7},
           "sweep": {"rows": sweep}}
    files = {"tp8": tp8, "ep8": {"layout": "ep8", "layers": 61, "draft_layers": 6,
                                 "steps": {"ar": {"1": {"ms": 9.0, "floor_ms": 2.0}}}},
             "moe": {"moe_layer_fixed_us": 30.0, "int4_expert_bw_fraction": 0.4},
             "mla": {"mla": {"shape": [mla_heads, 512, 64]},
                     "mla_decode_bw_fraction_16k_b32": 0.6},
             "moe-target": {"shape": "qwen3-30b-a3b",
                            "steps": {"chain": 16, "ar": {"1": {"ms": 3.0, "floor_ms": 1.5}},
                                      "verify16_ms": 4.5, "verify16_floor_ms": 3.0}}}
    for name, data in files.items():
        (folder / f"{name}.json").write_text(json.dumps(data))


def _kimi_report_stage(folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "benchmarks/kimi_rank.sh", str(folder), "report"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_kimi_rank_script_reports_every_goal_from_its_stages(tmp_path):
    """The script's report stage finds each stage's JSON in its folder and gives every Kimi
    goal its value: the rank's, the MoE layer's, MLA's at 8 heads and the Qwen3-30B-A3B
    shape's steps over their floors; the tables hold the draft, the verifies and the sweep
    past concurrency 1 against `none` there."""
    _kimi_stage_outputs(tmp_path)
    run = _kimi_report_stage(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "kimi-rank.json").read_text())
    assert all(data[k] is not None for k in KIMI_GOALS), {k: data.get(k) for k in KIMI_GOALS}
    assert data["mla_rank_decode_bw_fraction_16k_b32"] == 0.6
    assert data["moe_ar_step_over_floor_b1"] == 2.0
    assert data["moe_chain16_verify_over_floor"] == 1.5
    assert data["moe_layer_fixed_us"] == 30.0 and data["kimi_tp8_rank_decode_b1_ms"] == 10.0
    report = (tmp_path / "kimi-rank.md").read_text()
    assert "tp8 draft step 1.50 ms, 3.0x its floor" in report
    assert "| 8 | 20.00 | 2.00 | 2.50 |" in report  # 8 nodes: ms, / AR step, / floor
    assert "| dflash | 32 | 6400.0 | 2.00 | 4.50 | yes |" in report
    assert "| none | 1 |" not in report  # concurrency 1 has its own table
    check_goals(tmp_path / "kimi-rank.md", data, KIMI_GOALS)


def test_kimi_report_refuses_mla_at_a_whole_models_heads(tmp_path):
    _kimi_stage_outputs(tmp_path, mla_heads=128)
    run = _kimi_report_stage(tmp_path)
    assert run.returncode != 0 and "--mla-heads 8" in run.stderr, run.stderr[-2000:]
