"""benchmarks/spec_step_paired.py on CPU with a tiny target over 5 tokens and a drafter whose
drafts it accepts, on random prompts: the `full` engine (the adaptive
policy's calls, the full tree every step) commits the very tokens `fixed` does at every step,
which is what lets its step times be compared block by block. A check of the script, not of
speed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(small_pair, engines: str, concurrency: int = 2, blocks: int = 3,
               *extra: str) -> str:
    """The script's output for `concurrency` requests, `blocks` blocks of 2 steps each, on
    random prompts."""
    target, drafter = small_pair
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spec_step_paired.py"), "--model",
           str(target), "--draft", str(drafter), "--device", "cpu", "--concurrency",
           str(concurrency), "--blocks", str(blocks), "--block", "2", "--engines", engines,
           "--dataset", "random", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_full_and_fixed_commit_the_same_tokens_per_step(small_pair):
    """Also with the policy's work of the device's wait moved after the step's read."""
    names = {"fixed", "full", "full_untimed", "full_after_read"}
    stdout = run_script(small_pair, ",".join(sorted(names)))
    rows = {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.startswith("  ")}
    assert set(rows) == names, stdout
    tokens_per_step = {name: float(row[2]) for name, row in rows.items()}
    assert tokens_per_step["fixed"] > 2.0, stdout  # 2 requests: drafts were accepted
    assert set(tokens_per_step.values()) == {tokens_per_step["fixed"]}, stdout


def test_the_adaptive_engine_s_verdicts_are_tallied(small_pair):
    """Every decode step the adaptive engine ran is counted once, as speculative, plain or a
    probe's: the tally's plain and probe steps fit in its decode steps, which are at least
    the timed blocks' (the plain steps a tiny CPU model's policy takes here vary)."""
    line = run_script(small_pair, "fixed,adaptive").strip().splitlines()[-1]
    tally = re.fullmatch(r"adaptive: of (\d+) decode steps (\d+) plain, (\d+) of probes; "
                         r"(\d+) rechecks, (\d+) back-offs", line)
    assert tally, line
    steps, plain, probes, _, _ = map(int, tally.groups())
    assert steps >= 3 * 2 + 8, line  # the timed blocks and the hold's 8 steps at least
    assert plain + probes <= steps, line


def test_a_batch_of_one_whose_request_ends_reports_the_blocks_before(small_pair):
    """At one request the request ends within some block (the batch is then empty): the
    blocks before it are reported, and the profile has no request left to step."""
    stdout = run_script(small_pair, "fixed,full", 1, 1000, "--profile")
    assert re.search(r"a request ended after block (\d+)", stdout), stdout
    rows = [line.split()[0] for line in stdout.splitlines() if line.startswith("  ")]
    assert rows.count("fixed") == 2 and rows.count("full") == 2, stdout  # timing, profile
