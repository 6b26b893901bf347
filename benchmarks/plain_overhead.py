"""What an engine with a drafter costs on plain steps: `none` against an adaptive DDTree engine
whose policy is held plain (it never drafts, but still keeps the target's context features for
the drafter), through the bench's offline loop, in alternating rounds.

    python benchmarks/plain_overhead.py [--model default] [--prompts 6] [--tokens 48]
        [--rounds 4] [--concurrency 1] [--device cpu]

Prints each round's times and the held-plain engine's speed over `none`'s per round."""

from __future__ import annotations

import argparse

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import run_offline
from flashtree.models.registry import DEFAULT_DRAFTER_DIR
from flashtree.spec.policy import SpecPolicy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a target the bench takes")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    counts = {"--prompts": args.prompts, "--tokens": args.tokens, "--rounds": args.rounds,
              "--concurrency": args.concurrency}
    if min(counts.values()) < 1:
        parser.error("must be >= 1: " + ", ".join(f"{k} (got {v})" for k, v in counts.items()
                                                 if v < 1))
    SpecPolicy.should_draft = lambda self, requests, remaining=None: False  # every step plain
    common = dict(model=args.model, device=args.device, max_num_seqs=args.concurrency)
    engines = {"none": LLM(**common),
               "held plain": LLM(draft=str(DEFAULT_DRAFTER_DIR), **common)}
    prompts = load_dataset("chat", args.prompts, 1, engines["none"].model_config.vocab_size)
    for llm in engines.values():
        run_offline(llm, prompts, args.concurrency, 16)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in names:
            _, duration = run_offline(engines[name], prompts, args.concurrency, args.tokens)
            seconds[name].append(duration)
            print(f"round {r + 1} {name}: {duration:.2f} s", flush=True)
    ratios = [n / h for n, h in zip(seconds["none"], seconds["held plain"])]
    print("held plain over none, by round: " + ", ".join(f"{x:.3f}" for x in ratios)
          + f"; mean {sum(ratios) / len(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
