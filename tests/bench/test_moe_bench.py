"""benchmarks/moe_bench.py run small on a CPU: the layer builds from random weights (INT4
experts stacked as after a load), every token count gets a floor and a loop time; the whole
tiny MoE target's decode and verify steps run through the engine's runner with their experts
counted; the report and JSON carry them, so the GPU run cannot drift from the engine
unnoticed."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_moe_bench_runs_small_on_cpu(tmp_path):
    out = tmp_path / "moe.md"
    res = run_benchmark("moe_bench.py", out, "--shapes", "tiny", "--model", "tiny-moe",
                        "--ctx", "32", "--device", "cpu", "--dtype", "float32", "--reps", "2",
                        cwd=tmp_path)
    rows = res["shapes"]["tiny"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 8, 32, 128, 16, 64]
    assert all(r["floor_ms"] > 0 and r["loop_ms"] > 0 for r in rows)
    assert rows[0]["experts_touched"] == 2 and all(r["experts_touched"] <= 8 for r in rows)
    assert "| 128 |" in out.read_text()
    model = res["model"]["rows"]  # the whole tiny MoE target through the engine's runner
    assert [r["step"] for r in model] == ["decode x1", "decode x8", "decode x32", "decode x128",
                                          "verify 16 nodes", "verify 64 nodes"]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in model)
    assert model[0]["experts_touched_per_layer"] == 2  # one token, top-2
    assert model[3]["experts_touched_per_layer"] > 2  # 128 different tokens
    assert res["model"]["moe_ar_step_over_floor_b1"] > 0
