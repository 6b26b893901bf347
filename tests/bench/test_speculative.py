"""benchmarks/speculative.py, every section, small on a CPU (a tiny random pair; the default pair
is a tiny chat Llama with a reference-format drafter, tests/conftest.py): every speculative run
commits exactly the plain run's tokens, `none` never speculates, the DFlash chain accepts what
the oracle's P predicts, every step and ratio is measured, and the goals table says what the
JSON says. A check of the script, not of speed: these are CPU numbers of tiny models."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.bench.scripts import REPO, check_goals, run_script

GOAL_KEYS = ("ar_step_over_floor", "ar_speed_over_compiled_peer", "draft_over_ar_step",
             "verify16_over_ar_step", "verify64_over_ar_step", "verify256_over_ar_step",
             "dflash_over_none_c1", "ddtree_over_none_c1", "ddtree_over_dflash_c1",
             "ddtree_best_budget_c1", "gpu_busy_ddtree_step", "host_ms_between_steps",
             "device_reads_per_spec_step", "adaptive_tau_bias_in_se", "min_spec_over_none",
             "min_adaptive_over_best_fixed", "speedup_vs_reference_dflash",
             "ddtree_over_dflash_e2e")
# CPU-only: no compiled peer, no GPU busy share or idle time, no device reads.
NOT_ON_CPU = {"ar_speed_over_compiled_peer", "gpu_busy_ddtree_step", "host_ms_between_steps",
              "device_reads_per_spec_step"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_chat_model):
    target, drafter = tiny_chat_model
    out = tmp_path_factory.mktemp("speculative") / "s.md"
    data = run_script(
        "speculative", out, "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
        "--ctx", "32", "--batches", "1,3", "--verify-ctxs", "32", "--trees", "1,8,256",
        "--reps", "2", "--copy-mib", "4", "--skip", "8", "--tokens", "160", "--prompts", "3",
        "--budgets", "15,63", "--trials", "16", "--profile-steps", "3", "--profile-budget", "31",
        "--levels", "1,3",
        "--sweep-tokens", "24", "--gen-prompt", "16", "--gen-tokens", "8", "--work",
        str(out.parent / "work"), "--default-model", str(target), "--default-draft",
        str(drafter), "--pair-prompts", "2", "--pair-tokens", "12", "--acceptance-modes",
        "dflash:match,ddtree:rrs", "--temperatures", "0,1", "--per-category", "1",
        "--acceptance-tokens", "12", "--sections",
        "steps,verify,calibrate,c1,profile,sweep,generate,pair,acceptance")
    return out, data


def test_no_section_failed_and_the_goals_table_says_what_the_json_says(run):
    out, data = run
    assert "errors" not in data, data.get("errors")
    check_goals(out, data, GOAL_KEYS)
    for key in set(GOAL_KEYS) - NOT_ON_CPU:  # measured: finite and positive (a bias >= 0)
        assert data[key] is not None, key
        assert data[key] >= 0 if key == "adaptive_tau_bias_in_se" else data[key] > 0, key
    assert data["ddtree_best_budget_c1"] in (15, 63)
    assert all(data[k] is None for k in NOT_ON_CPU)


def test_steps_are_measured_against_their_floor(run):
    st = run[1]["steps"]
    assert st["graphs"] is False and set(st["ar"]) == {"1", "3"}
    for row in st["ar"].values():
        assert row["ms"] > 0 and row["eager_ms"] > 0 and 0 < row["floor_ms"]
    for key in ("engine_step_ms", "decode_with_context_ms", "verify16_ms", "draft_ms",
                "inject_ms", "verify64_ms", "verify16_floor_ms", "draft_floor_ms"):
        assert st[key] > 0, key
    report = run[0].read_text()
    for step in ("verify16", "draft"):  # each beside its floor in the report
        ms = st[f"{step}_ms"]
        assert f"{ms:.3f} ms ({ms / st[f'{step}_floor_ms']:.2f}x its floor)" in report
    # The random target is decisive: its top-2 gap is about hidden_size (64) against a noise of
    # a few units (flashtree/bench/random_pair.py).
    assert st["min_top2_gap"] > 64 / 4
    assert set(run[1]["verify"]["over_ar_step"]["32"]) == {"1", "8", "256"}


def test_speculation_commits_the_plain_tokens_at_the_oracle_rate(run):
    data = run[1]
    c1, sweep = data["c1"], data["sweep"]
    rows = [c1["dflash"], c1["dflash_adaptive"], c1["ddtree_topk_cap"], c1["ddtree_adaptive"],
            *c1["ddtree_budgets"].values(), *c1["curve_dflash"], *c1["curve_ddtree"]]
    assert all(r["equal_to_plain"] == 1.0 for r in rows)
    assert all(r["equal_to_plain"] == 1.0 for rows in sweep["rows"].values() for row in rows
               for r in row["runs"])
    # `none` is plain decoding throughout (an engine without the drafter), fixed DFlash never.
    assert c1["none"]["speculative_share"] == 0.0 and c1["dflash"]["speculative_share"] == 1.0
    p = data["calibrate"]["p"]
    assert abs(1 + sum(p**i for i in range(1, 16)) - 6.6) < 1e-6
    # About 70 steps: the chain's per-step acceptance has a standard deviation near 4.5.
    assert abs(c1["dflash"]["tau"] - 6.6) < 4 * 4.5 / math.sqrt(70)
    # Adaptive rows accept per speculative step what fixed ones do (issue 65: no bias).
    for ratio in data["adaptive_tau_over_fixed_tau"].values():
        assert ratio["se"] > 0 and abs(ratio["ratio"] - 1) < 3 * ratio["se"], ratio
    assert data["adaptive_tau_bias_in_se"] < 3
    taus = [point["tau"] for point in c1["curve_dflash"]]
    assert taus[-1] > taus[0] + 5  # the plot's chain points span the acceptance range
    prof = data["profile"]
    assert prof["ddtree_budget"] == 31  # --profile-budget, where c1's best is 15 or 63
    assert prof["none"]["tokens_per_step"] == 1.0 and prof["ddtree"]["tokens_per_step"] > 2
    assert prof["ddtree"]["host_functions"] and prof["ddtree"]["top"]
    # Every profiling pass ran all its steps (its requests had the tokens for them): timed,
    # under torch.profiler and under cProfile (the sync-debug pass runs on CUDA only); the
    # speculative engines' two read-to-launch passes too.
    assert prof["none"]["calls_made"] == 3 * 3
    assert all(prof[m]["calls_made"] == 5 * 3 for m in ("dflash", "ddtree"))
    # Their steps read on the device path, each read followed by the next step's forward.
    assert all(prof[m]["window_ms"] > 0 and prof[m]["window_functions"]
               for m in ("dflash", "ddtree"))
    # By time with callees, this project's functions alone: the next step is the window's
    # largest (it starts inside it), and no library function is listed.
    ours = prof["ddtree"]["window_ours"]
    assert ours[0][0].startswith("engine/llm_engine.py") and ours[0][0].endswith("(step)")
    assert [cum for _, _, cum in ours] == sorted((cum for _, _, cum in ours), reverse=True)
    assert not [name for name, _, _ in ours if name.startswith("~")]


def test_end_to_end_sections(run):
    out, data = run
    pair = data["pair"]
    # Lossless: speculative decoding of the default pair commits plain decoding's tokens.
    assert pair["dflash_equal_to_none"] == pair["ddtree_equal_to_none"] == 2
    assert data["flashtree_over_transformers"] > 0
    acc = data["acceptance"]["rows"]
    assert [(r["spec"], r["sampling"], r["T"]) for r in acc] == [
        ("dflash", "greedy", 0.0), ("dflash", "match", 1.0), ("ddtree", "rrs", 1.0)]
    assert all(1 <= r["all"] <= 4 for r in acc)  # at most the drafter's block of 4
    md = out.read_text()
    for heading in ("## Steps at context 32", "## Tree verify", "## Concurrency 1",
                    "## Engine steps under the profiler", "## Concurrency sweep",
                    "## End to end against transformers", "## Default pair end to end",
                    "## Tokens per target forward"):
        assert heading in md, heading


@pytest.mark.parametrize("budget", ["0", "-3"])
def test_a_profile_budget_below_one_node_is_refused_before_anything_runs(tmp_path, budget):
    run = subprocess.run([sys.executable, "-m", "benchmarks.speculative", "--shape", "tiny",
                          "--device", "cpu", "--sections", "profile", "--profile-budget",
                          budget, "--out", str(tmp_path / "s.md")],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2 and f"--profile-budget {budget}: DDTree's nodes" in run.stderr
    assert not (tmp_path / "s.json").exists()  # nothing measured, nothing written
