"""benchmarks/prompt_step_paired.py on CPU with a tiny target over 5 tokens and its drafter,
on random prompts: both engines prefill the same prompts in every wave (32 tokens each), and
a wave ends with every request done at its first token. A check of the script, not of
speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_engines_prefill_the_same_prompts_in_every_wave(small_pair):
    target, drafter = small_pair
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prompt_step_paired.py"), "--model",
           str(target), "--draft", str(drafter), "--device", "cpu", "--concurrency", "3",
           "--blocks", "2", "--block", "2", "--engines", "none,drafter", "--dataset", "random"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith("  ")}
    assert set(rows) == {"none", "drafter"}, proc.stdout
    assert {float(row[2]) for row in rows.values()} == {3 * 32.0}, proc.stdout
    assert rows["none"][3:5] == ["1.0000", "+-"], proc.stdout  # the first engine's own ratio
