"""Host time per engine step by function, two engines side by side (cProfile over the bench's
offline loop, after a warm-up run of the same workload): where one engine's steps spend host
time the other's do not. On a GPU the device runs asynchronously, so the host's time is what
stalls it in launch-bound steps (a small model's decode).

    python benchmarks/host_profile.py --model M.gguf --compare none,held-plain --concurrency 64
    python benchmarks/host_profile.py --model M.gguf --compare fixed,adaptive --concurrency 1

Engines: `none`; `held-plain` (an adaptive DDTree engine whose policy never drafts: plain steps
that keep the drafter's context); `fixed` and `adaptive` DDTree. Prints each engine's profiled
host microseconds per engine step (prompt steps included), then the functions whose time per
step differs most between the two, either way."""

from __future__ import annotations

import argparse
import cProfile
import pstats

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import run_offline
from flashtree.engine.heap import freeze_startup_heap
from flashtree.models.registry import DEFAULT_DRAFTER_DIR

ENGINES = ("none", "held-plain", "fixed", "adaptive")


def engine(name: str, args: argparse.Namespace) -> LLM:
    kw = dict(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    if name == "none":
        return LLM(**kw)
    policy = "fixed" if name == "fixed" else "adaptive"
    llm = LLM(draft=str(DEFAULT_DRAFTER_DIR), spec="ddtree", spec_policy=policy, **kw)
    if name == "held-plain":
        llm.engine.speculative.policy.should_draft = lambda requests, remaining=None: False
    return llm


def profile_steps(llm: LLM, prompts: list, args: argparse.Namespace) -> dict[str, float]:
    """Profiled host seconds per engine step (prompt steps included), by function
    (file:name)."""
    steps, engine_step = [0], llm.engine.step

    def counted():
        steps[0] += 1
        return engine_step()

    llm.engine.step = counted
    profiler = cProfile.Profile()
    profiler.enable()
    run_offline(llm, prompts, args.concurrency, args.tokens)
    profiler.disable()
    del llm.engine.step
    per_step: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        where = path.split("flashtree/")[-1] if "flashtree" in path else path.split("/")[-1]
        key = f"{where}:{name}"
        per_step[key] = per_step.get(key, 0.0) + own / steps[0]
    return per_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--compare", default="none,held-plain",
                    help=f"two of {', '.join(ENGINES)}, comma-separated")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    names = args.compare.split(",")
    if len(names) != 2 or not set(names) <= set(ENGINES):
        ap.error(f"--compare takes two of {', '.join(ENGINES)} (got {args.compare!r})")
    if min(args.concurrency, args.prompts, args.tokens) < 1:
        ap.error("--concurrency, --prompts and --tokens must be >= 1")
    engines = [engine(name, args) for name in names]
    freeze_startup_heap()
    prompts = load_dataset("chat", args.prompts, 1, engines[0].model_config.vocab_size)
    for llm in engines:
        run_offline(llm, prompts, args.concurrency, args.tokens)  # warm-up
    first, second = (profile_steps(llm, prompts, args) for llm in engines)
    for name, per_step in zip(names, (first, second)):
        print(f"{name}: {1e6 * sum(per_step.values()):.0f} us of profiled host time per step")
    print(f"\nlargest differences, us per step: {names[1]} minus {names[0]}, then "
          f"{names[1]}'s and {names[0]}'s own")
    keys = set(first) | set(second)
    for key in sorted(keys, key=lambda k: -abs(second.get(k, 0) - first.get(k, 0)))[:args.top]:
        a, b = first.get(key, 0.0), second.get(key, 0.0)
        print(f"  {1e6 * (b - a):8.1f}  {1e6 * b:8.1f} / {1e6 * a:8.1f}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
