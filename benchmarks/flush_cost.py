"""What the drafter's catch-up costs after a stretch of plain decoding: an adaptive DDTree
engine held plain (its policy never drafts) runs the chat set, `--concurrency` requests at a
time, until half of them have finished and later ones have started; then the context rows it
deferred are injected into the draft cache (`DFlashProposer.flush`, as the next draft would),
timed. Only eager forwards defer rows: with CUDA graphs, decode steps and short prompt chunks
write their own, and there is little or nothing left to flush.

    python benchmarks/flush_cost.py [--model default] [--prompts 16] [--tokens 48]
        [--concurrency 4] [--runs 3] [--device cpu]

Prints the rows deferred, how many belong to requests still running, and the flush's
milliseconds (the best of `--runs`, each over its own requests)."""

from __future__ import annotations

import argparse
import time

import torch

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import encode
from flashtree.models.registry import DEFAULT_DRAFTER_DIR
from flashtree.sampling import SamplingParams
from flashtree.spec.policy import SpecPolicy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if min(args.prompts, args.tokens, args.concurrency, args.runs) < 1:
        ap.error("--prompts, --tokens, --concurrency and --runs must be >= 1")
    SpecPolicy.should_draft = lambda self, requests, remaining=None: False  # held plain
    llm = LLM(model=args.model, device=args.device, draft=str(DEFAULT_DRAFTER_DIR),
              spec="ddtree", max_num_seqs=args.concurrency)
    engine, proposer = llm.engine, llm.engine.proposer
    prompts = load_dataset("chat", args.prompts, 1, llm.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    cuda = engine.args.device.type == "cuda"
    best = float("inf")
    for _ in range(args.runs):
        seqs = [engine.add_request(encode(llm, p), params) for p in prompts]
        while (sum(s.is_finished for s in seqs) < len(seqs) // 2
               or not sum(engine.pages.lengths.values())):  # and the next ones started
            engine.step()
        deferred, live = proposer.deferred_rows, sum(engine.pages.lengths.values())
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        proposer.flush()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
        proposer.flush()
    print(f"{deferred} context rows deferred, {live} of them in requests still running; "
          f"flush: {1e3 * best:.1f} ms (best of {args.runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
