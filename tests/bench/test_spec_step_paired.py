"""benchmarks/spec_step_paired.py on CPU with a tiny target over 5 tokens and a drafter whose
drafts it accepts, on random prompts: the `full` engine (the adaptive
policy's calls, the full tree every step) commits the very tokens `fixed` does at every step,
which is what lets its step times be compared block by block. A check of the script, not of
speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_full_and_fixed_commit_the_same_tokens_per_step(small_pair):
    target, drafter = small_pair
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spec_step_paired.py"), "--model",
           str(target), "--draft", str(drafter), "--device", "cpu", "--concurrency", "2",
           "--blocks", "3", "--block", "2", "--engines", "fixed,full,full_untimed",
           "--dataset", "random"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith("  ")}
    assert set(rows) == {"fixed", "full", "full_untimed"}, proc.stdout
    tokens_per_step = {name: float(row[2]) for name, row in rows.items()}
    assert tokens_per_step["fixed"] > 2.0, proc.stdout  # 2 requests: drafts were accepted
    assert tokens_per_step["full"] == tokens_per_step["fixed"] == tokens_per_step["full_untimed"]
