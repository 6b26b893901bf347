"""`flashtree bench`, any of its arguments, with every adaptive policy held plain: its engines
load the drafter and run its prompt steps (target features captured, the drafter's context
K/V written) but never draft. Against `none` in the same rounds this is what a drafter engine
costs where speculation is off, in whole runs with requests coming and going (prompt steps,
admissions, the policy's per-step work), apart from what its probes cost.

    python benchmarks/bench_held_plain.py bench --model M.gguf --draft D --spec none,ddtree \\
        --concurrency 256 --num-prompts 512 --max-tokens 64 --rounds 30 ...

The `ddtree` rows are the held engine's (their budget histograms hold budget 0 alone)."""

from __future__ import annotations

import sys
from pathlib import Path

from flashtree.cli import main
from flashtree.spec.policy import SpecPolicy


def never_draft(self: SpecPolicy, requests: int, remaining=None) -> bool:
    """SpecPolicy.should_draft, held plain: every decode step runs plain."""
    return False


if __name__ == "__main__":
    if sys.argv[1:2] != ["bench"]:
        sys.exit(f"usage: {Path(sys.argv[0]).name} bench [flashtree bench arguments]")
    SpecPolicy.should_draft = never_draft
    sys.exit(main(sys.argv[1:]))
