"""`flashtree bench serving` against a real flashtree server on loopback: the openai client
streams every request, acceptance comes from the server's /metrics counters, and a `none`
baseline in the same output folder gives the later label its speedups."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from flashtree.bench.serving import acceptance_from_counters, spec_counters
from flashtree.server.metrics import ServerMetrics
from tests.server.conftest import API_KEY, MODEL, metric, start_server

PROMPTS, MAX_TOKENS = 6, 8


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    """A ddtree server that verifies full trees every step (spec_policy fixed), so that its
    speculative counters account for every returned token after the first."""
    base, proc = start_server(*tiny_chat_model, extra=("--spec-policy", "fixed"))
    yield base, proc
    proc.terminate()
    proc.wait(timeout=60)


def _bench(base: str, out, label: str, dataset: str) -> list[dict]:
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "bench", "serving", "--base-url", f"{base}/v1",
         "--model", MODEL, "--api-key", API_KEY, "--label", label, "--dataset", dataset,
         "--vocab-size", "1000", "--num-prompts", str(PROMPTS), "--max-tokens", str(MAX_TOKENS),
         "--concurrency", "1,3", "--output-dir", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "failed" not in run.stderr
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_serving_sweep_measures_a_real_server(server, tmp_path):
    base, _ = server
    _bench(base, tmp_path, "none", "random")
    rows = _bench(base, tmp_path, "ddtree", "random")
    assert sorted((r["spec"], r["concurrency"]) for r in rows) == [
        ("ddtree", 1), ("ddtree", 3), ("none", 1), ("none", 3)]
    for r in rows:
        assert r["completed"] == PROMPTS and r["failed"] == 0
        assert r["total_output_tokens"] == PROMPTS * MAX_TOKENS  # usage, ignore_eos honoured
        assert 0 < r["mean_ttft_ms"] <= r["mean_e2e_ms"] and r["mean_tpot_ms"] > 0
        # The server speculates (ddtree); its counters cover the returned tokens after the
        # first (a round cut by max_tokens counts what the request kept), exactly where one
        # request runs at a time. Beside others, a request's admission step carries their
        # decode tokens, plain (a mixed step): at most one per running request.
        hist = {int(k): v for k, v in r["accept_length_histogram"].items()}
        counted, returned = sum(k * v for k, v in hist.items()), PROMPTS * (MAX_TOKENS - 1)
        if r["concurrency"] == 1:
            assert counted == returned
        else:
            assert returned - PROMPTS * (r["concurrency"] - 1) <= counted <= returned
        assert r["accept_length"] == pytest.approx(
            sum(k * v for k, v in hist.items()) / sum(hist.values()))
        assert r["speedup_vs_none"] == pytest.approx(
            r["output_throughput"] / next(b["output_throughput"] for b in rows
                                          if b["spec"] == "none"
                                          and b["concurrency"] == r["concurrency"]))
    report = (tmp_path / "report.md").read_text()
    assert "| ddtree | 3 |" in report and "| none | 1 |" in report


def test_metrics_count_the_speculative_steps_of_a_lone_request_at_batch_1(server):
    """One request alone on the fixed-policy server: each of its decode steps drafts at batch
    size 1, one verify round each, so the speculative-steps gauge for batch 1 moves by the
    drafts counter's move, and by at most its MAX_TOKENS - 1 decode steps."""
    from openai import OpenAI

    base, _ = server
    names = ('flashtree:spec_decode_speculative_steps_total{batch="1"}',
             "flashtree:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total")
    before = [metric(base, n) for n in names]
    OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0).completions.create(
        model=MODEL, prompt="Count", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    steps, drafts, vllm_drafts = (metric(base, n) - b for n, b in zip(names, before))
    assert 1 <= steps <= MAX_TOKENS - 1 and steps == drafts == vllm_drafts


def test_chat_dataset_streams_through_the_chat_endpoint(server, tmp_path):
    rows = _bench(server[0], tmp_path, "ddtree", "chat")
    assert all(r["completed"] == PROMPTS and r["total_output_tokens"] > 0 for r in rows)


def test_counters_parse_flashtree_and_vllm_expositions():
    from prometheus_client import generate_latest

    m = ServerMetrics()
    m.drafts.sync({"": 4})
    m.drafts.sync({"": 10})  # cumulative totals: the counter moves by what they gained
    m.accepted.sync({"": 14})
    m.accepted_per_pos.sync({str(pos): count for pos, count in enumerate([6, 5, 3])})
    text = generate_latest(m.registry).decode()
    assert re.search(r"# TYPE flashtree:spec_decode_num_drafts(_total)? counter", text)
    assert "flashtree:spec_decode_num_drafts_total 10.0" in text
    assert "vllm:spec_decode_num_drafts_total 10.0" in text
    after = spec_counters(text)  # flashtree's own series, not both prefixes summed
    assert after is not None and after["drafts"] == 10 and after["pos0"] == 6
    before = {"drafts": 0.0, "accepted": 0.0}
    mean, hist = acceptance_from_counters(before, after)
    assert mean == pytest.approx(2.4)
    # drafts accepting >= 0, 1, 2, 3 candidates: 10, 6, 5, 3
    assert hist == {"1": 4, "2": 1, "3": 2, "4": 3}
    vllm = ("# TYPE vllm:spec_decode_num_drafts counter\n"
            'vllm:spec_decode_num_drafts_total{model_name="m"} 8.0\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0\n')
    assert spec_counters(vllm) == {"drafts": 8.0, "accepted": 12.0}
    assert spec_counters("# TYPE other counter\nother_total 1.0\n") is None
