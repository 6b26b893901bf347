"""benchmarks/multigpu_bench.py: layout names -> (tensor_parallel_size, expert_parallel_size) by
SGLang's --tp T --ep E convention (E divides T, experts in E groups of T / E ranks), and the
whole script run small on a CPU so that it cannot drift from the engine unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.multigpu_bench import parse_layout

ROOT = Path(__file__).resolve().parents[2]


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
    """The whole script on a tiny MoE over gloo, one process and two ranks with experts split
    (the GPU run's code paths: engine steps, the verify timer, collectives): every layout's
    decode and verify rows are measured, nothing failed."""
    out = tmp_path / "multigpu.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu_bench.py"), "--out", str(out),
         "--work", str(tmp_path / "work"), "--shape", "tiny", "--device", "cpu", "--dtype",
         "float32", "--layouts", "tp1,ep2", "--max-ranks", "2", "--concurrency", "1,2",
         "--tree-sizes", "1,4", "--ctx", "16", "--steps", "3", "--comm-tokens", "1,4",
         "--comm-iters", "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = out.read_text()
    assert "failed" not in report and "Traceback" not in report, report
    rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| tp1 ")
            or line.startswith("| ep2 ")]
    decode = [r for r in rows if len(r) == 8]
    verify = [r for r in rows if len(r) == 5]
    assert len(decode) == 2 * 2 * 2  # layouts x (none, ddtree) x concurrencies
    assert len(verify) == 2 * 2  # layouts x tree sizes
    assert all(float(r[-1]) > 0 for r in decode) and all(float(r[-2]) > 0 for r in verify)
