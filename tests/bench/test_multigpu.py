"""benchmarks/multigpu.py: layout names -> (tensor_parallel_size, expert_parallel_size) by
SGLang's --tp T --ep E convention (E divides T, experts in E groups of T / E ranks), and the
whole script small on a CPU over gloo, one process and two ranks with experts split (the GPU
run's code paths: engine steps, the verify timer, collectives, the oracle on every rank): every
layout's rows are measured and its tokens equal the first layout's (the random target is
decisive: a top-2 gap of about hidden_size, far above the float32 sums' reordering)."""

from __future__ import annotations

import pytest

from benchmarks.multigpu import parse_layout
from tests.bench.scripts import check_goals, run_script


@pytest.mark.parametrize("name,want", [
    ("tp4", (4, 1)), ("tp8", (8, 1)), ("tp1", (1, 1)), ("ep8", (8, 8)), ("ep2", (2, 2)),
    ("ep4tp2", (8, 4)), ("ep2tp4", (8, 2)), ("ep1tp8", (8, 1)),
])
def test_layout_names(name, want):
    assert parse_layout(name) == want
    tp, ep = want
    assert tp % ep == 0  # every parsed layout is one LLM accepts


@pytest.mark.parametrize("name", ["", "tp", "tp0", "ep0tp2", "tp4ep2", "TP4", "ep4tp", "dp2",
                                  "tp4 ", "ep8tp2tp2"])
def test_bad_layout_names_raise_naming_the_forms(name):
    with pytest.raises(ValueError, match=r"tpN .*epN .*epNtpM"):
        parse_layout(name)


def test_the_script_runs_small_on_cpu(tmp_path):
    out = tmp_path / "multigpu.md"
    data = run_script(
        "multigpu", out, "--work", str(tmp_path / "work"), "--shape", "tiny-moe", "--device",
        "cpu", "--dtype", "float32", "--layouts", "tp1,ep2,tp4", "--max-ranks", "2",
        "--concurrency", "1,2", "--tree-sizes", "4", "--ctx", "16", "--steps", "3", "--block",
        "8", "--equality-specs", "ddtree", "--equality-temps", "0,0.8", "--equality-tokens", "8",
        "--comm-tokens", "1,4", "--comm-iters", "2", "--oracle-concurrency", "2",
        "--oracle-tokens", "16", "--sections", "decode,verify,equality,comm,oracle")
    assert "errors" not in data, data.get("errors")
    assert data["skipped"] == ["skipped tp4 (TP, EP (4, 1)): needs 4 ranks, 2 available"]
    decode = [(r["layout"], r["spec"], r["concurrency"]) for r in data["decode"]]
    assert decode == [(n, s, c) for n in ("tp1", "ep2") for s in ("none", "ddtree")
                      for c in (1, 2)]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in data["decode"])
    assert [(r["layout"], r["tree_budget"]) for r in data["verify"]] == [("tp1", 4), ("ep2", 4)]
    assert all(r["verify_ms"] > 0 for r in data["verify"])
    # Seeded sampling at T 0.8 draws alike too: the logits differ by rounding only.
    assert [(r["layout"], r["temperature"]) for r in data["equality"]["rows"]] == [
        ("ep2", 0.0), ("ep2", 0.8)]
    assert all(r["equal"] == r["requests"] == 4 for r in data["equality"]["rows"])
    assert [r["ranks"] for r in data["comm"]] == [2, 2]
    assert all(r["all_reduce_us"] > 0 and r["all_to_all_us"] is None for r in data["comm"])
    oracle = {(r["layout"], r["spec"]): r for r in data["oracle"]}
    assert set(oracle) == {(n, s) for n in ("tp1", "ep2") for s in ("none", "ddtree")}
    # The oracle drafts the plain tokens (P 0.863), on every rank alike: DDTree steps commit
    # several tokens, plain steps one.
    assert all(oracle[n, "ddtree"]["tau"] > 2 and oracle[n, "none"]["tau"] == 1
               for n in ("tp1", "ep2"))
    check_goals(out, data, ("tp2_over_tp1_b1", "tp2_over_tp1_b32"))
