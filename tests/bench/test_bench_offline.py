"""`flashtree bench` in process on a tiny chat model with a drafter: every method x concurrency
row is written with sane values, the report flags and the plots exist, and the metric
arithmetic matches hand-computed values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.metrics import RequestRecord, summarize
from flashtree.bench.offline import run_offline
from flashtree.bench.report import add_speedups, merge_rounds, never_drafted, write_report

REQUIRED = ["spec", "concurrency", "output_throughput", "request_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_e2e_ms", "accept_length", "accept_length_histogram", "speedup_vs_none"]
PROMPTS, MAX_TOKENS = 6, 8


@pytest.fixture(scope="module")
def sweep(tiny_chat_model, tmp_path_factory):
    model, drafter = tiny_chat_model
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "bench", "--model", str(model), "--draft",
         str(drafter), "--spec", "none,dflash,ddtree", "--dataset", "random,chat",
         "--random-input-len", "12", "--num-prompts", str(PROMPTS), "--max-tokens",
         str(MAX_TOKENS), "--concurrency", "1,3", "--device", "cpu", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, rows


def test_every_method_and_concurrency_has_a_complete_row(sweep):
    _, rows = sweep
    assert sorted((r["dataset"], r["spec"], r["concurrency"]) for r in rows) == sorted(
        (d, s, c) for d in ("random", "chat") for s in ("none", "dflash", "ddtree")
        for c in (1, 3))
    for r in rows:
        assert all(k in r for k in REQUIRED), [k for k in REQUIRED if k not in r]
        assert r["completed"] == PROMPTS and r["failed"] == 0
        assert 0 < r["mean_ttft_ms"] <= r["mean_e2e_ms"]
        assert 0 < r["mean_tpot_ms"] <= r["p99_tpot_ms"] * 1.0001
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
        hist = {int(k): v for k, v in r["accept_length_histogram"].items()}
        assert r["accept_length"] == pytest.approx(
            sum(k * v for k, v in hist.items()) / sum(hist.values()))
        by_batch = {int(b): n for b, n in r["speculative_steps_by_batch"].items()}
        assert all(1 <= b <= r["concurrency"] for b in by_batch), by_batch
        # each speculative step's requests are request-steps of the budget histogram
        assert sum(b * n for b, n in by_batch.items()) <= sum(r["budget_histogram"].values())
        if r["spec"] == "none":
            assert r["accept_length"] == 1.0 and set(hist) == {1}
            assert r["speedup_vs_none"] == 1.0 and by_batch == {}
        else:
            assert r["accept_length"] >= 1.0 and r["speedup_vs_none"] > 0
        if r["dataset"] == "random":  # ignore_eos: every request runs to max_tokens
            assert r["total_output_tokens"] == PROMPTS * MAX_TOKENS
            # the first token comes from the prefill; every later one from a counted forward
            assert sum(k * v for k, v in hist.items()) == PROMPTS * (MAX_TOKENS - 1)


def test_report_flags_slow_methods_and_plots_exist(sweep):
    out, rows = sweep
    report = (out / "report.md").read_text()
    assert "## random" in report and "## chat" in report and "flashtree bench" in report
    slower = [r for r in rows if r["speedup_vs_none"] < 1 and not never_drafted(r)]
    assert report.count("**slower than none**") == len(slower)
    assert report.count("**never drafted**") == sum(never_drafted(r) for r in rows)
    assert "Rerun with `--rounds 3`" in report  # one round: the noise is unknown
    for name in ("throughput_random.png", "accept_hist_random.png", "throughput_chat.png",
                 "accept_hist_chat.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in report


def test_rounds_interleave_methods_and_take_speedups_within_a_round(tiny_chat_model, tmp_path):
    """--rounds 3: each method timed three times per concurrency, each row's speedup against
    `none` of its own round; the report shows the rounds' mean and range. --num-prompts with
    one count per concurrency: each run takes its own."""
    model, drafter = tiny_chat_model
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "bench", "--model", str(model), "--draft",
         str(drafter), "--spec", "none,ddtree", "--dataset", "random", "--random-input-len",
         "8", "--num-prompts", "2,3", "--max-tokens", "5", "--concurrency", "1,2", "--rounds", "3",
         "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted((r["spec"], r["concurrency"], r["round"]) for r in rows) == [
        (s, c, k) for s in ("ddtree", "none") for c in (1, 2) for k in (1, 2, 3)]
    assert {(r["concurrency"], r["completed"]) for r in rows} == {(1, 2), (2, 3)}
    assert {r["total_output_tokens"] for r in rows} == {2 * 5, 3 * 5}  # random: ignore_eos
    none = {(r["concurrency"], r["round"]): r["output_throughput"] for r in rows
            if r["spec"] == "none"}
    ratios = []
    rows = [r for r in rows if r["concurrency"] == 2]
    for r in rows:
        ratios.append(r["output_throughput"] / none[2, r["round"]])
        assert r["speedup_vs_none"] == pytest.approx(ratios[-1])
    ddtree = [x for r, x in zip(rows, ratios) if r["spec"] == "ddtree"]
    report = (tmp_path / "report.md").read_text()
    assert "3 interleaved rounds" in report
    assert "2 / 3 prompts per run at concurrency 1 / 2" in report
    assert (f"{sum(ddtree) / 3:.2f} ({min(ddtree):.2f}-{max(ddtree):.2f})") in report


def test_merged_rounds_average_metrics_and_sum_histograms():
    def row(spec, round_, throughput, hist):
        return {"dataset": "d", "spec": spec, "concurrency": 4, "round": round_,
                "output_throughput": throughput, "accept_length_histogram": hist}

    rows = [row("none", 1, 100.0, {"1": 5}), row("ddtree", 1, 150.0, {"1": 1, "3": 2}),
            row("ddtree", 2, 90.0, {"2": 4}), row("none", 2, 50.0, {"1": 5})]
    add_speedups(rows)
    merged = {r["spec"]: r for r in merge_rounds(rows)}
    tree = merged["ddtree"]
    assert tree["rounds"] == 2 and "round" not in tree
    assert tree["output_throughput"] == pytest.approx(120.0)
    assert tree["speedup_vs_none"] == pytest.approx((1.5 + 1.8) / 2)
    assert (tree["speedup_min"], tree["speedup_max"]) == (pytest.approx(1.5), pytest.approx(1.8))
    assert tree["accept_length_histogram"] == {"1": 1, "2": 4, "3": 2}
    assert merged["none"]["speedup_vs_none"] == 1.0


def test_tpot_lies_within_the_per_token_gaps(tiny_chat_model):
    model, drafter = tiny_chat_model
    llm = LLM(model=str(model), draft=str(drafter), spec="ddtree", device="cpu")
    prompts = load_dataset("random", 5, vocab_size=llm.model_config.vocab_size,
                           random_input_len=10)
    records, duration = run_offline(llm, prompts, concurrency=2, max_tokens=MAX_TOKENS)
    assert len(records) == 5 and duration > 0
    for rec in records:
        assert rec.ok and rec.num_output == MAX_TOKENS and rec.end == rec.chunks[-1][0]
        # TPOT is the token-weighted mean of the per-token gaps between chunks
        gaps = [(b - a) / n for (a, _), (b, n) in zip(rec.chunks, rec.chunks[1:])]
        assert min(gaps) * 0.9999 <= rec.tpot <= max(gaps) * 1.0001
        assert rec.start < rec.chunks[0][0]


def test_summary_matches_hand_computed_values():
    a = RequestRecord(start=0.0, prompt_tokens=5, chunks=[(0.5, 1), (0.7, 2), (1.1, 1)],
                      end=1.1, accept_lengths=[2, 1])
    b = RequestRecord(start=1.0, prompt_tokens=3, chunks=[(1.2, 1), (1.6, 1)], end=1.6,
                      accept_lengths=[1])
    failed = RequestRecord(start=0.0, prompt_tokens=4, error="boom")
    row = summarize([a, b, failed], duration=2.0)
    assert row["completed"] == 2 and row["failed"] == 1
    assert row["total_output_tokens"] == 6 and row["output_throughput"] == 3.0
    assert row["request_throughput"] == 1.0 and row["total_input_tokens"] == 8
    assert row["mean_ttft_ms"] == pytest.approx((500 + 200) / 2)
    assert row["mean_tpot_ms"] == pytest.approx((600 / 3 + 400 / 1) / 2)
    assert row["median_itl_ms"] == pytest.approx(400)  # gaps 200, 400, 400
    assert row["mean_e2e_ms"] == pytest.approx((1100 + 600) / 2)
    assert row["accept_length"] == pytest.approx(4 / 3)
    assert row["accept_length_histogram"] == {"1": 2, "2": 1}


def test_bad_dataset_and_missing_draft_are_named(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "flashtree", "bench", "--output-dir",
                               str(tmp_path), *args], capture_output=True, text=True,
                              timeout=300)

    bad = run("--spec", "none", "--dataset", "nope")
    assert bad.returncode == 2 and "unknown dataset 'nope'" in bad.stderr
    assert "humaneval" in bad.stderr
    nodraft = run("--model", str(tmp_path), "--spec", "none,ddtree")  # not the default model
    assert nodraft.returncode == 2 and "--draft" in nodraft.stderr
    empty = run("--spec", "none", "--num-prompts", "0")
    assert empty.returncode == 2 and "--num-prompts: values must be >= 1" in empty.stderr
    counts = run("--spec", "none", "--num-prompts", "4,8,16", "--concurrency", "1,4")
    assert counts.returncode == 2
    assert "--num-prompts has 3 values for 2 --concurrency values" in counts.stderr


def _row(spec: str, concurrency: int, round_: int, throughput: float, budgets: dict) -> dict:
    return {"dataset": "chat", "spec": spec, "concurrency": concurrency, "round": round_,
            "output_throughput": throughput, "request_throughput": 1.0, "mean_ttft_ms": 1.0,
            "p99_ttft_ms": 1.0, "mean_tpot_ms": 1.0, "p99_tpot_ms": 1.0, "mean_e2e_ms": 1.0,
            "accept_length": 1.5 if spec != "none" else 1.0, "budget_histogram": budgets,
            "accept_length_histogram": {"1": 5, "2": 5} if spec != "none" else {"1": 10}}


def test_report_tells_noise_plain_rows_and_real_losses_apart(tmp_path):
    """Over two rounds: a speedup whose range holds 1 is within the noise, a speculative row
    that never drafted is named as such, and only a loss in every round is slower than none."""
    rows = []
    for k, (c1, c4, c16) in enumerate([(0.95, 0.7, 0.8), (1.05, 1.3, 0.85)], start=1):
        rows += [_row("none", c, k, 100.0, {}) for c in (1, 4, 16)]
        rows += [_row("ddtree", 1, k, 100 * c1, {"0": 5, "15": 5}),
                 _row("ddtree", 4, k, 100 * c4, {"0": 10}),
                 _row("ddtree", 16, k, 100 * c16, {"15": 10})]
    add_speedups(rows)
    write_report(tmp_path, rows, ["header"])
    report = (tmp_path / "report.md").read_text()
    line = {c: next(ln for ln in report.splitlines() if ln.startswith(f"| ddtree | {c} |"))
            for c in (1, 4, 16)}
    assert "(within noise)" in line[1] and "slower" not in line[1]
    assert "**never drafted**" in line[4]
    assert "**slower than none**" in line[16]
    assert "mean over 2 rounds" in report
    assert "- chat: ddtree at concurrency 16 (0.82x)" in report
    assert "- chat: ddtree at concurrency 4" in report.split("never drafted (plain")[1]
