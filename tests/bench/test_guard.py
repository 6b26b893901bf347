"""The slowdown guard (`flashtree/bench/guard.py`, `speculative.py --guard`): a step slower
than the committed one beyond the tolerance is flagged and the script exits 1, one within it
is not; the baseline is the newest committed run of the same shape, depth, layout and GPU,
never another GPU's, shape's or the run's own file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from flashtree.bench.guard import compare, last_results
from tests.bench.scripts import REPO


def _steps(ar: float, draft: float, verify: float, chain: int = 16) -> dict:
    return {"ar": {"1": {"ms": ar}}, "draft_ms": draft, f"verify{chain}_ms": verify,
            "chain": chain}


def test_a_step_slower_beyond_the_tolerance_is_flagged():
    rows = compare(_steps(1.02, 2.0, 3.5), _steps(1.0, 2.0, 3.0), tolerance=0.03)
    assert {r["step"]: r["slower"] for r in rows} == {"ar_b1_ms": False, "draft_ms": False,
                                                       "verify16_ms": True}
    assert rows[0]["ratio"] == 1.02
    # A block-8 drafter's chain is a different step: not compared with a block-16 one.
    assert [r["step"] for r in compare(_steps(1, 1, 1, 8), _steps(1, 1, 1), 0.03)] == [
        "ar_b1_ms", "draft_ms"]


def test_where_both_runs_timed_the_graphs_alone_their_ratio_decides():
    """The whole step carries the host's jitter (10-20% between runs on the same GPU); the
    graph replayed alone is the device's time, which a kernel change moves."""
    before, now = _steps(1.0, 2.0, 3.0), _steps(1.2, 2.0, 3.0)
    before["ar"]["1"]["replay_ms"], now["ar"]["1"]["replay_ms"] = 0.80, 0.81
    before["draft_replay_ms"], now["draft_replay_ms"] = 1.0, 1.1
    rows = {r["step"]: r for r in compare(now, before, tolerance=0.03)}
    assert not rows["ar_b1_ms"]["slower"] and rows["ar_b1_ms"]["ratio"] == 1.2
    assert rows["draft_ms"]["slower"] and rows["draft_ms"]["replay_ratio"] == 1.1
    assert "replay_ratio" not in rows["verify16_ms"]  # timed alone in one run only: the wall
    assert not rows["verify16_ms"]["slower"]


def _write(path, name, shape="qwen3-8b", gpu="H100", layers=36, layout=None, steps=True):
    run = {"shape": shape, "layers": layers, "layout": layout, "machine": {"gpu": gpu}}
    if steps:
        run["steps"] = _steps(1, 1, 1)
    (path / name).write_text(json.dumps(run))
    return path / name


def test_the_baseline_is_the_newest_run_of_the_same_setup(tmp_path):
    run = {"shape": "qwen3-8b", "layers": 36, "layout": None, "machine": {"gpu": "H100"}}
    (tmp_path / "archive").mkdir()
    old = _write(tmp_path / "archive", "2026-12-01-a-gpu.json")
    new = _write(tmp_path, "2026-12-05-b-gpu.json")
    _write(tmp_path, "2026-12-07-c-gpu.json", gpu="H200")
    _write(tmp_path, "2026-12-07-d-gpu.json", layers=4)
    _write(tmp_path, "2026-12-07-e-gpu.json", layout="tp8")
    _write(tmp_path, "2026-12-07-f-gpu.json", steps=False)
    (tmp_path / "2026-12-08-broken.json").write_text("{")
    mine = _write(tmp_path, "2026-12-09-mine-gpu.json")
    assert last_results(run, tmp_path, exclude=mine) == new
    new.unlink()
    assert last_results(run, tmp_path, exclude=mine) == old
    assert last_results({**run, "shape": "tiny"}, tmp_path) is None


def test_the_script_exits_1_on_a_slowdown(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--ctx", "16",
            "--batches", "1", "--verify-ctxs", "16", "--reps", "1", "--copy-mib", "4",
            "--sections", "steps"]

    def run(out, *extra):
        return subprocess.run([sys.executable, "-m", "benchmarks.speculative", *base, *extra,
                               "--out", str(tmp_path / out)], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=600)
    first = run("a.md")
    assert first.returncode == 0, first.stderr[-2000:]
    baseline = str(tmp_path / "a.json")
    # Tolerance -1: any time is "slower"; a huge one: none is.
    slower = run("b.md", "--guard", baseline, "--guard-tolerance", "-1")
    assert slower.returncode == 1 and "SLOWER" in slower.stdout, slower.stdout[-2000:]
    same = run("c.md", "--guard", baseline, "--guard-tolerance", "100")
    assert same.returncode == 0 and "SLOWER" not in same.stdout
