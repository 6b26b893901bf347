"""Prompt steps of a drafter engine against `none`, paired: the engines take turns, in rotated
order and in one process, running waves in which CONCURRENCY prompts are admitted and each
stops at its first token (the token its prompt step samples), so that a wave is prompt steps
alone. With a drafter those steps also capture the target's features and write the drafter's
context K/V; at 256 requests on an H200 whole runs decoding plain lost ~3% to `none` while
their decode steps were at par (`plain_step_paired.py`), and this measures the prompt steps.

    python benchmarks/prompt_step_paired.py --model M.gguf --device cuda --concurrency 256

Engines (`--engines`, comma-separated; a suffix `.x` adds another copy): `none`; `drafter`
(DDTree with the drafter; its policy never runs, as no request decodes). Prints each engine's
median ms per wave, prompt tokens per wave and its per-block speed over the first engine's
(`--block` waves a block)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import encode
from flashtree.engine.heap import freeze_startup_heap

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paired_steps import Blocks, parse_args, report  # noqa: E402

VARIANTS = ("none", "drafter")


def engine(variant: str, args: argparse.Namespace) -> LLM:
    kw = dict(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    return LLM(**kw) if variant == "none" else LLM(draft=args.draft, spec="ddtree", **kw)


def wave(llm: LLM, prompts: list[list[int]]) -> None:
    """Admit `prompts` (token ids), each to stop at its first token, and step until all end."""
    e = llm.engine
    for i, ids in enumerate(prompts):
        e.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                          seed=i))
    while e.has_unfinished():
        e.step()


def run_waves(engines: dict[str, LLM], prompts: dict[str, list[list[int]]], blocks: int,
              block: int) -> dict[str, Blocks]:
    """`blocks` rounds in which every engine runs `block` waves, in rotated order."""
    names = list(engines)
    timed = {n: Blocks(block) for n in names}
    for b in range(blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            start = time.perf_counter()
            for _ in range(block):
                wave(engines[n], prompts[n])
            timed[n].seconds.append(time.perf_counter() - start)
            timed[n].tokens.append(block * sum(map(len, prompts[n])))
    return timed


def main() -> int:
    args, names = parse_args(__doc__.split("\n\n")[0], VARIANTS, concurrency=256, blocks=30,
                             block=2, engines="none,drafter", unit="waves")
    engines = {n: engine(n.split(".")[0], args) for n in names}
    freeze_startup_heap()
    first = next(iter(engines.values()))
    texts = load_dataset(args.dataset, args.concurrency, 1, first.model_config.vocab_size,
                         random_input_len=32)
    prompts = {n: [encode(llm, t) for t in texts] for n, llm in engines.items()}
    for n, llm in engines.items():  # warm-up: first calls, allocations
        wave(llm, prompts[n])
    print(f"concurrency {args.concurrency}, {args.blocks} blocks of {args.block} waves, "
          "rotated order (per wave: ms, prompt tokens)")
    report(run_waves(engines, prompts, args.blocks, args.block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
