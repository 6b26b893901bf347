"""benchmarks/side_by_side.sh on a CPU: `prepare` puts a commit's code (without the drafter
weights) where `run` finds it; `run` times the steps of that commit and then of the working
tree, each from its own code (a mark added to the commit's copy prints once), and exits 1 when
the guard finds a step slower (here every step, at a tolerance of -1); without `prepare` it
says what to run first."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.bench.scripts import REPO

SCRIPT = REPO / "benchmarks" / "side_by_side.sh"
TINY = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--ctx", "32",
        "--verify-ctxs", "32", "--batches", "1", "--reps", "2", "--copy-mib", "4"]


def _side_by_side(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BEFORE": str(tmp_path / "before"), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)


def test_the_commit_before_and_the_working_tree_each_run_their_own_code(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout: nothing to archive")
    missing = _side_by_side(tmp_path, "run", *TINY)
    assert missing.returncode == 2 and "prepare REF" in missing.stderr
    prepared = _side_by_side(tmp_path, "prepare", "HEAD")
    assert prepared.returncode == 0, prepared.stderr
    before = tmp_path / "before"
    assert (before / "flashtree" / "llm.py").exists()
    assert (before / "benchmarks" / "speculative.py").exists()
    assert not (before / "flashtree" / "drafters").exists()
    with open(before / "flashtree" / "__init__.py", "a") as f:  # marks the code that runs
        f.write('\nprint("the commit before")\n')
    run = _side_by_side(tmp_path, "run", *TINY, "--guard-tolerance", "-1")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"guard against {tmp_path / 'out' / 'before.json'}" in run.stdout
    assert run.stdout.count("SLOWER") >= 2  # AR and draft, at least
    assert run.stdout.count("the commit before") == 1  # its run alone imported its code
    for name in ("before", "after"):
        data = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert data["steps"]["ar"]["1"]["ms"] > 0, name


def test_profile_alternates_the_commit_before_and_the_working_tree(tmp_path):
    """`profile`: each side's engine steps under the profiler, from its own code (a mark on
    stderr from the commit's copy shows once), a line per method and side (one round here)."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout: nothing to archive")
    assert _side_by_side(tmp_path, "prepare", "HEAD").returncode == 0
    with open(tmp_path / "before" / "flashtree" / "__init__.py", "a") as f:
        f.write('\nimport sys\nprint("the commit before", file=sys.stderr)\n')
    env = {**os.environ, "BEFORE": str(tmp_path / "before"), "OUT": str(tmp_path / "out"),
           "ROUNDS": "1"}
    run = subprocess.run(["bash", str(SCRIPT), "profile", *TINY, "--profile-steps", "2"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr.count("the commit before") == 1
    for side in ("before", "after"):
        for method in ("none", "dflash", "ddtree"):
            assert f"{side} 1 **{method}**: " in run.stdout, run.stdout
    assert run.stdout.count("ms wall per call") == 6
    # The speculative engines' host time from each device read to the next launch, a side each.
    assert run.stdout.count("From each device read to the next launch: ") == 4
