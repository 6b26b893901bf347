"""benchmarks/verdict_trace.py and benchmarks/bench_held_plain.py on CPU with the tiny chat
model and its drafter. Traced, a `flashtree bench` run prints the adaptive engine's verdicts
(here a back-off after its first probe: a random drafter's drafts are not accepted). Held
plain, an adaptive engine that would probe within 24 tokens never drafts. A check of the
scripts, not of speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.verdict_trace import trace_verdicts
from flashtree import LLM, SamplingParams
from flashtree.spec.policy import SpecPolicy
from tests.spec.test_policy import LEVELS, _cost, _forecast_gain

ROOT = Path(__file__).resolve().parents[2]


def test_a_traced_bench_run_prints_each_verdict_with_the_forecast_s_inputs(tiny_chat_model,
                                                                          tmp_path):
    model, drafter = tiny_chat_model
    cmd = [sys.executable, str(ROOT / "benchmarks" / "verdict_trace.py"), "bench", "--model",
           str(model), "--draft", str(drafter), "--spec", "none,ddtree", "--dataset", "random",
           "--random-input-len", "12", "--num-prompts", "2", "--max-tokens", "24",
           "--concurrency", "1", "--device", "cpu", "--no-progress", "--output-dir",
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = [line for line in proc.stderr.splitlines() if line.startswith("verdict ")]
    assert any(" back-off: 1 requests, back-off 0: accepted " in line for line in verdicts), (
        proc.stderr[-3000:])
    assert all("speculative times " in line for line in verdicts), verdicts
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["spec"] for r in rows) == ["ddtree", "none"]


def test_a_resume_is_traced_once_and_not_while_a_draining_batch_stays_plain(monkeypatch,
                                                                             capsys):
    """After a back-off, a forecast that pays resumes speculation: one verdict. Where the
    batch drains and the drain rule keeps it plain, the back-off stands and nothing is
    traced, however many steps ask."""
    for name in ("should_draft", "recheck", "back_off"):  # restored after the test
        monkeypatch.setattr(SpecPolicy, name, getattr(SpecPolicy, name))
    trace_verdicts()
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.3)
    policy.at(4).backoff = 9  # a back-off whose plain steps and probe are over
    policy.drain.draining, policy.drain.last_batch = True, 4
    monkeypatch.setattr(policy.drain, "speculation_pays", lambda *args: False)
    assert not any(policy.should_draft(4, lambda: [5] * 4) for _ in range(5))
    assert "verdict" not in capsys.readouterr().err
    assert policy.should_draft(4)  # others wait: the batch no longer drains
    verdicts = capsys.readouterr().err.splitlines()
    assert len(verdicts) == 1 and " resume after back-off 9: 4 requests" in verdicts[0], verdicts


def test_a_held_engine_never_drafts_where_it_would_probe(tiny_chat_model, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "bench_held_plain", ROOT / "benchmarks" / "bench_held_plain.py")
    held = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(held)
    model, drafter = tiny_chat_model
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def budgets() -> dict[int, int]:
        llm = LLM(model=str(model), draft=str(drafter), spec="ddtree", device="cpu")
        llm.generate(["Hello there"], params)
        return llm.engine.speculative.stats.budgets

    assert any(b > 0 for b in budgets())  # its first probe, after 8 plain steps
    monkeypatch.setattr(SpecPolicy, "should_draft", held.never_draft)
    assert set(budgets()) == {0}
