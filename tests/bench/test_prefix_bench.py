"""benchmarks/prefix_bench.py run small: every request after the first finds the shared prefix
(and its own earlier turns) cached, the answers equal those computed without caching, and the
report carries the ratio it was written for."""

from __future__ import annotations

from tests.helpers import run_benchmark


def test_prefix_bench_runs_small(tmp_path):
    out = tmp_path / "prefix.md"
    res = run_benchmark("prefix_bench.py", out, "--prefix-tokens", "40", "--conversations", "2",
                        "--turns", "2", "--user-tokens", "5", "--max-tokens", "4")
    assert res["same_answers"] is True
    on, off = res["runs"]["on"], res["runs"]["off"]
    assert all(r["cached_tokens"] == 0 for r in off)
    assert on[0]["cached_tokens"] == 0
    # Later requests: the system prompt's full pages (32 of 40 tokens) at least.
    assert all(r["cached_tokens"] >= 32 for r in on[1:])
    assert res["ttft_off_over_on"] > 0 and "TTFT without caching" in out.read_text()
