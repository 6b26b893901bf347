"""Paired decode-step measurements: engines that each hold a steady batch take turns running
blocks of decode steps in one process, in rotated order, so that each block's ratio to the
first engine's compares one machine state (whole benchmark runs on a GPU host swing by 10%
from round to round; this resolves about 1%). Shared by `plain_step_paired.py` and
`spec_step_paired.py`."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import encode
from flashtree.engine.heap import freeze_startup_heap
from flashtree.engine.llm_engine import LLMEngine
from flashtree.models.registry import DEFAULT_DRAFTER_DIR
from flashtree.sampling import SamplingParams


def parse_args(description: str, variants: tuple[str, ...], *, concurrency: int, blocks: int,
               block: int, engines: str, unit: str = "decode steps"
               ) -> tuple[argparse.Namespace, list[str]]:
    """The paired scripts' command line (defaults as given) and the engine names, checked:
    distinct, each a variant with an optional `.x` suffix for another copy. `unit`: what a
    block is made of, for `--block`'s help."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFTER_DIR), help="drafter directory")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--blocks", type=int, default=blocks)
    ap.add_argument("--block", type=int, default=block, help=f"{unit} per block")
    ap.add_argument("--engines", default=engines)
    ap.add_argument("--dataset", default="chat", help="chat, or random (32 random token ids)")
    ap.add_argument("--profile", action="store_true",
                    help="then one more block per engine under torch.profiler: device launches, "
                         "host syncs and device time per step")
    args = ap.parse_args()
    names = args.engines.split(",")
    if any(n.split(".")[0] not in variants for n in names) or len(set(names)) != len(names):
        ap.error(f"--engines: distinct names of {', '.join(variants)} (got {args.engines!r})")
    if min(args.concurrency, args.blocks, args.block) < 1 or args.blocks < 2:
        ap.error("--concurrency and --block must be >= 1, --blocks >= 2")
    return args, names


@dataclass
class Blocks:
    """One engine's timed blocks of `block` decode steps: seconds and committed tokens of
    each."""

    block: int
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def hold_batches(engines: dict[str, LLM], concurrency: int, max_tokens: int,
                 dataset: str = "chat") -> None:
    """Admit `concurrency` prompts of `dataset` (greedy, run to `max_tokens`) into every
    engine and step each until every request is decoding, then 8 decode steps more."""
    freeze_startup_heap()
    first = next(iter(engines.values()))
    prompts = load_dataset(dataset, concurrency, 1, first.model_config.vocab_size,
                           random_input_len=32)
    for llm in engines.values():
        e = llm.engine
        for i, p in enumerate(prompts):
            e.add_request(encode(llm, p), SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=i))
        while e.scheduler.waiting or any(s.num_computed < s.num_tokens - 1
                                         for s in e.scheduler.running):
            e.step()
        for _ in range(8):
            e.step()


def run_blocks(engines: dict[str, LLM], blocks: int, block: int) -> dict[str, Blocks]:
    """`blocks` rounds in which every engine runs `block` decode steps, in rotated order;
    stops early (the blocks so far) when a request of any engine has ended: the batches are
    no longer steady."""
    names = list(engines)
    timed = {n: Blocks(block) for n in names}
    sizes = {n: len(engines[n].engine.scheduler.running) for n in names}
    for b in range(blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            e = engines[n].engine
            before = sum(len(s.output_ids) for s in e.scheduler.running)
            start = time.perf_counter()
            decode_steps(e, block)
            timed[n].seconds.append(time.perf_counter() - start)
            timed[n].tokens.append(sum(len(s.output_ids) for s in e.scheduler.running) - before)
        if any(len(engines[n].engine.scheduler.running) != sizes[n] for n in names):
            print(f"a request ended after block {b + 1}: the blocks before it are reported")
            return {n: Blocks(block, t.seconds[:b], t.tokens[:b]) for n, t in timed.items()}
    return timed


def decode_steps(engine: LLMEngine, steps: int) -> int:
    """`steps` engine steps, fewer where its last request ends before (a batch of one);
    returns how many ran."""
    step, unfinished = engine.step, engine.has_unfinished
    for done in range(steps):
        if not unfinished():
            return done
        step()
    return steps


def measure(engines: dict[str, LLM], args: argparse.Namespace, max_tokens: int) -> None:
    """Hold the batches (`hold_batches`), run the blocks (`run_blocks`) and print the report,
    as the command line (`parse_args`) says."""
    hold_batches(engines, args.concurrency, max_tokens, args.dataset)
    print(f"concurrency {args.concurrency}, {args.blocks} blocks of {args.block} decode steps, "
          "rotated order")
    timed = run_blocks(engines, args.blocks, args.block)
    if len(next(iter(timed.values())).seconds) < 2:
        raise SystemExit("fewer than 2 blocks before a request ended: lower --block")
    report(timed)
    if args.profile:
        profile_blocks(engines, args.block)


def profile_blocks(engines: dict[str, LLM], block: int) -> None:
    """Per engine, one block of `block` decode steps under torch.profiler: runtime calls that
    launch device work (kernels, graphs, copies), host syncs and device time per step, where a
    difference in step time that host profiles do not show can be device work or waiting."""
    from benchmarks.profile_step import per_step_counts, profiler_activities

    cuda = torch.cuda.is_available()
    print("engine          launches/step  syncs/step  device ms/step")
    for name, llm in engines.items():
        with torch.profiler.profile(activities=profiler_activities(cuda)) as prof:
            steps = decode_steps(llm.engine, block)
            if cuda:
                torch.cuda.synchronize()
        if steps == 0:
            print(f"  {name:14s} no request left to profile")
            continue
        launches, syncs, device_ms = per_step_counts(prof.key_averages(), steps)
        print(f"  {name:14s} {launches:13.1f}  {syncs:10.1f}  {device_ms:14.3f}")


def report(timed: dict[str, Blocks]) -> None:
    """Per engine: median ms per step, tokens per step, and per block its speed over the first
    engine's in tokens/s and in steps/s (mean +- standard error)."""
    names = list(timed)
    base = timed[names[0]]
    print("engine          ms/step  tokens/step  tokens/s over first  steps/s over first")
    for n in names:
        t = timed[n]
        per_step = [s / t.block for s in t.seconds]
        token_ratios = [(a / s) / (b / r) for a, s, b, r
                        in zip(t.tokens, t.seconds, base.tokens, base.seconds)]
        step_ratios = [r / s for s, r in zip(t.seconds, base.seconds)]
        print(f"  {n:14s} {1e3 * statistics.median(per_step):7.3f}  "
              f"{sum(t.tokens) / (t.block * len(t.tokens)):11.2f}  {_mean_se(token_ratios):>19s}  "
              f"{_mean_se(step_ratios):>18s}")


def _mean_se(values: list[float]) -> str:
    """Mean +- standard error of two or more values."""
    se = statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.mean(values):.4f} +- {se:.4f}"
