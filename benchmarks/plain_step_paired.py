"""Plain decode steps of a drafter engine against `none`, paired: every engine holds a steady
batch of CONCURRENCY requests (no request ends during the measurement) and the engines take
turns running blocks of decode steps, in rotated order, in one process, so each block's ratio
to `none` compares the same machine state. Where whole benchmark runs swing by 10% from round
to round on a GPU host, this resolves 1%.

    python benchmarks/plain_step_paired.py --model M.gguf --device cuda --concurrency 64

Engines (`--engines`, comma-separated; a suffix `.x` adds another copy): `none`; `adaptive`
(an adaptive DDTree engine whose policy runs as it does in serving: at a batch where
speculation does not pay, plain steps with its probes); `held` (an adaptive DDTree engine
whose policy never drafts: plain steps that keep the drafter's context features); and
ablations of `held`: `nodefer` (the features are not kept), `nofeat` (decode
graphs without feature outputs), `notime` (no step timing or budget statistics),
`nofeat_notime`. Prints each engine's median ms per step and its per-block speed over the
first engine's (mean and standard error; `paired_steps.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashtree import LLM
from flashtree.graphs.forward import TargetForward
from flashtree.graphs.schema import GraphMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paired_steps import measure, parse_args  # noqa: E402

VARIANTS = ("none", "adaptive", "held", "nodefer", "nofeat", "notime", "nofeat_notime")


def engine(variant: str, args: argparse.Namespace) -> LLM:
    kw = dict(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    if variant == "none":
        return LLM(**kw)
    llm = LLM(draft=args.draft, spec="ddtree", **kw)
    e = llm.engine
    if variant == "adaptive":
        return llm
    e.speculative.policy.should_draft = lambda requests, remaining=None: False  # held plain
    if "nofeat" in variant:  # decode graphs again, without feature outputs
        if e.runner.graphs is None:
            raise SystemExit(f"{variant}: needs captured graphs (CUDA, not enforce_eager)")
        e.runner.graphs.forward = TargetForward(e.runner.model, e.runner.backend, ())
        e.runner.graphs.capture(GraphMode.DECODE, 1, max(8192, args.concurrency))
    if "notime" in variant:
        e.speculative.policy.timed = False
        e.speculative.stats.record_budget = lambda *a: None
    if variant == "nodefer":
        e.proposer.defer = lambda rows: None
    return llm


def main() -> int:
    args, names = parse_args(__doc__.split("\n\n")[0], VARIANTS, concurrency=16, blocks=60,
                             block=16, engines="none,held")
    engines = {n: engine(n.split(".")[0], args) for n in names}
    measure(engines, args, max_tokens=args.blocks * args.block + 64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
