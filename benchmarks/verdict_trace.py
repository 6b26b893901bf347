"""`flashtree bench`, any of its arguments, with every verdict of its adaptive engines traced:
why an engine decodes plain where speculation pays, in the runs the sweeps time (engines
interleaved round by round, the machine's slow stretches included).

    python benchmarks/verdict_trace.py bench --model M.gguf --draft D --spec none,ddtree \\
        --concurrency 1 --rounds 8 ...

Prints to stderr, besides the benchmark's own output, one line per verdict: seconds since
start, its kind (a recheck of running speculation, a back-off, or a resume after one), the
batch, the back-off so far, the recent accepted drafts per request (the optimistic bound the
forecast uses, and how many steps the average weighs), the forecast's plain and speculative
step ms, and the bucket's measured-over-profiled step times (their medians, the last 8)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flashtree.cli import main
from flashtree.spec.policy import SpecPolicy, StepScale


def _times(scale: StepScale) -> str:
    samples = list(scale.samples)
    median = f"{statistics.median(samples):.2f}" if samples else "-"
    return f"{len(samples)} (median {median}, last {[round(x, 2) for x in samples[-8:]]})"


def describe(policy: SpecPolicy, requests: int) -> str:
    """The forecast's inputs at a batch of `requests`, in one line."""
    size = policy.at(requests)
    recent = policy.recent
    return (f"{requests} requests, back-off {size.backoff}: accepted {recent.accepted:.2f} "
            f"({recent.optimistic_accepted():.2f}, {recent.steps} steps), plain "
            f"{1e3 * policy.plain_s(requests):.2f} ms, speculative "
            f"{1e3 * policy.spec_s(requests):.2f} ms; plain times {_times(size.plain_scale)}, "
            f"speculative times {_times(size.spec_scale)}")


def trace_verdicts() -> None:
    """Every SpecPolicy's rechecks, back-offs and resumes, printed to stderr as they come."""
    start = time.perf_counter()
    recheck, back_off, should_draft = (SpecPolicy.recheck, SpecPolicy.back_off,
                                       SpecPolicy.should_draft)

    def note(policy: SpecPolicy, kind: str, requests: int) -> None:
        print(f"verdict {time.perf_counter() - start:8.2f} s {kind}: "
              f"{describe(policy, requests)}", file=sys.stderr, flush=True)

    def traced_recheck(self: SpecPolicy, requests: int) -> None:
        note(self, "recheck", requests)
        recheck(self, requests)

    def traced_back_off(self: SpecPolicy, requests: int) -> None:
        note(self, "back-off", requests)
        back_off(self, requests)

    def traced_should_draft(self: SpecPolicy, requests: int,
                            remaining: Callable[[], list[int]] | None = None) -> bool:
        # a resume ends the back-off; a forecast that pays where a draining batch still
        # decodes plain (`DrainWatch`) leaves it, and is no verdict
        size = self.at(requests)
        backoff = size.backoff
        drafts = should_draft(self, requests, remaining)
        if backoff > 0 and size.backoff == 0:
            note(self, f"resume after back-off {backoff}", requests)
        return drafts

    SpecPolicy.recheck, SpecPolicy.back_off = traced_recheck, traced_back_off
    SpecPolicy.should_draft = traced_should_draft


if __name__ == "__main__":
    if sys.argv[1:2] != ["bench"]:
        sys.exit(f"usage: {Path(sys.argv[0]).name} bench [flashtree bench arguments]")
    trace_verdicts()
    sys.exit(main(sys.argv[1:]))
