"""Plain decode steps of a drafter engine against `none`, paired: every engine holds a steady
batch of CONCURRENCY requests (no request ends during the measurement) and the engines take
turns running blocks of decode steps, in rotated order, in one process, so each block's ratio
to `none` compares the same machine state. Where whole benchmark runs swing by 10% from round
to round on a GPU host, this resolves 1%.

    python benchmarks/plain_step_paired.py --model M.gguf --device cuda --concurrency 64

Engines (`--engines`, comma-separated; a suffix `.x` adds another copy): `none`; `held` (an
adaptive DDTree engine whose policy never drafts: plain steps that keep the drafter's context
features); and ablations of `held`: `nodefer` (the features are not kept), `nofeat` (decode
graphs without feature outputs), `notime` (no step timing or budget statistics),
`nofeat_notime`. Prints each engine's median ms per step and its per-block speed over the
first engine's (mean and standard error)."""

from __future__ import annotations

import argparse
import statistics
import time

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import encode
from flashtree.engine.heap import freeze_startup_heap
from flashtree.graphs.forward import TargetForward
from flashtree.graphs.schema import GraphMode
from flashtree.models.registry import DEFAULT_DRAFTER_DIR
from flashtree.sampling import SamplingParams
from flashtree.spec.policy import SpecPolicy

VARIANTS = ("none", "held", "nodefer", "nofeat", "notime", "nofeat_notime")


def engine(variant: str, args: argparse.Namespace) -> LLM:
    kw = dict(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    if variant == "none":
        return LLM(**kw)
    llm = LLM(draft=str(DEFAULT_DRAFTER_DIR), spec="ddtree", **kw)
    e = llm.engine
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--block", type=int, default=16, help="decode steps per block")
    ap.add_argument("--engines", default="none,held")
    args = ap.parse_args()
    names = args.engines.split(",")
    bad = [n for n in names if n.split(".")[0] not in VARIANTS]
    if bad or len(set(names)) != len(names):
        ap.error(f"--engines: distinct names of {', '.join(VARIANTS)} (got {args.engines!r})")
    if min(args.concurrency, args.blocks, args.block) < 1 or args.blocks < 2:
        ap.error("--concurrency and --block must be >= 1, --blocks >= 2")
    SpecPolicy.should_draft = lambda self, requests: False  # drafter engines held plain
    engines = {n: engine(n.split(".")[0], args) for n in names}
    freeze_startup_heap()
    prompts = load_dataset("chat", args.concurrency, 1, engines[names[0]].model_config.vocab_size)
    for llm in engines.values():  # admit and prefill every request, then a few decode steps
        e = llm.engine
        for i, p in enumerate(prompts):
            e.add_request(encode(llm, p), SamplingParams(
                temperature=0.0, max_tokens=args.blocks * args.block + 64, ignore_eos=True,
                seed=i))
        while e.scheduler.waiting or any(s.num_computed < s.num_tokens - 1
                                         for s in e.scheduler.running):
            e.step()
        for _ in range(8):
            e.step()
    per_step = {n: [] for n in names}
    for b in range(args.blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            step, start = engines[n].engine.step, time.perf_counter()
            for _ in range(args.block):
                step()
            per_step[n].append((time.perf_counter() - start) / args.block)
    print(f"concurrency {args.concurrency}, {args.blocks} blocks of {args.block} decode steps, "
          f"rotated order: median ms per step; per-block speed over {names[0]} (mean +- "
          "standard error)")
    for n in names:
        ratios = [a / b for a, b in zip(per_step[names[0]], per_step[n])]
        se = statistics.stdev(ratios) / len(ratios) ** 0.5
        print(f"  {n:14s} {1e3 * statistics.median(per_step[n]):7.3f} ms  "
              f"{statistics.mean(ratios):.4f} +- {se:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
