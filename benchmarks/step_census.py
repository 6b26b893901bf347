"""`flashtree bench`, any of its arguments, with every engine step timed: where an adaptive
engine's time goes against `none`'s and fixed's in the runs the sweeps time (requests coming
and going, engines interleaved round by round). The adaptive policy's verdicts are traced as
`verdict_trace.py` traces them.

    python benchmarks/step_census.py bench --model M.gguf --draft D \\
        --spec none,ddtree,ddtree:fixed --concurrency 4 --num-prompts 48 --max-tokens 128 \\
        --rounds 3 --output-dir OUT

Prints to stderr at exit, per engine (`none`, `fixed`, `adaptive`), step kind (prefill, plain
decode, mixed: prompt chunks with running requests' decode tokens, speculative decode) and
batch size: the steps, their total and median seconds, and the accepted drafts per request of
speculative steps. `--trail FILE` (before `bench`) also
writes one CSV row per step: start time, engine, kind, batch, seconds, accepted drafts per
request, and for adaptive engines whether the step chose its tree budgets (1) or kept the
last choice's (0)."""

from __future__ import annotations

import atexit
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from flashtree.cli import main
from flashtree.engine.llm_engine import LLMEngine
from flashtree.engine.scheduler import step_kind

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.verdict_trace import trace_verdicts  # noqa: E402


def engine_name(engine: LLMEngine) -> str:
    if engine.speculative is None:
        return "none"
    return "fixed" if engine.speculative.policy is None else "adaptive"


# The census's names of the scheduler's step kinds (`step_kind`).
_KINDS = {"decode": "plain", "prompt": "prefill", "mixed": "mixed"}


class StepCensus:
    """Every LLMEngine step's time, kind and batch size, kept as the engines run."""

    def __init__(self) -> None:
        # (engine, kind, batch) -> [(seconds, accepted drafts per request)]
        self.steps: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
        self.trail: list[str] = []  # CSV rows

    def install(self) -> None:
        step, plain, speculative = (LLMEngine.step, LLMEngine._plain_step,
                                    LLMEngine._speculative_step)
        kinds: dict[int, tuple[str, int]] = {}  # id(engine) -> the running step's kind, batch

        def plain_step(engine: LLMEngine, chunks):
            kinds[id(engine)] = (_KINDS[step_kind(chunks)], len(chunks))
            return plain(engine, chunks)

        def speculative_step(engine: LLMEngine, chunks):
            kinds[id(engine)] = ("speculative", len(chunks))
            return speculative(engine, chunks)

        def timed_step(engine: LLMEngine):
            stats = engine.speculative.stats if engine.speculative is not None else None
            accepted_before = stats.num_accepted_tokens if stats is not None else 0
            start = time.perf_counter()
            finished = step(engine)
            seconds = time.perf_counter() - start
            kind, batch = kinds[id(engine)]
            accepted = (stats.num_accepted_tokens - accepted_before) / batch if stats else 0.0
            name = engine_name(engine)
            self.steps[(name, kind, batch)].append((seconds, accepted))
            chose = (int(engine.speculative.planner._kept_steps == 0) if name == "adaptive"
                     else "")
            self.trail.append(f"{start:.6f},{name},{kind},{batch},{seconds:.6f},"
                              f"{accepted:.3f},{chose}")
            return finished

        LLMEngine.step, LLMEngine._plain_step = timed_step, plain_step
        LLMEngine._speculative_step = speculative_step

    def report(self, trail: Path | None) -> None:
        print("census: engine kind batch steps total_s median_ms accepted_per_request",
              file=sys.stderr)
        for (name, kind, batch), rows in sorted(self.steps.items()):
            seconds = [s for s, _ in rows]
            print(f"census: {name:8s} {kind:11s} {batch:4d} {len(rows):6d} {sum(seconds):8.3f} "
                  f"{1e3 * statistics.median(seconds):8.3f} "
                  f"{statistics.mean(a for _, a in rows):6.3f}", file=sys.stderr)
        if trail is not None:
            trail.write_text("start,engine,kind,batch,seconds,accepted,chose\n"
                             + "".join(row + "\n" for row in self.trail))


if __name__ == "__main__":
    args = sys.argv[1:]
    trail_path = None
    if args[:1] == ["--trail"] and len(args) > 1:
        trail_path, args = Path(args[1]), args[2:]
    if args[:1] != ["bench"]:
        sys.exit(f"usage: {Path(sys.argv[0]).name} [--trail FILE] bench "
                 "[flashtree bench arguments]")
    census = StepCensus()
    census.install()
    atexit.register(census.report, trail_path)
    trace_verdicts()
    sys.exit(main(args))
