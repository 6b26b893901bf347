"""Every verdict against speculation an adaptive DDTree engine reaches over a warm-up run and two
timed runs of the chat set (`flashtree bench`'s offline loop), with the forecast's inputs then:
why an engine decodes plain where speculation pays. A verdict against running speculation is
first rechecked (on fresh plain steps: "recheck"), then backed off from ("back-off").

    python benchmarks/backoff_trace.py --model M.gguf [--concurrency 1] [--device cuda]

Prints each run's tokens/s and request-steps by budget (0: plain), then one line per verdict:
the run, its decode step, the batch, the recent accepted drafts per request (and the optimistic
bound the forecast uses), the forecast's plain and speculative step ms, how many plain and
speculative step times its bucket holds, and the slowest speculative / fastest plain
measured-over-profiled factors among them."""

from __future__ import annotations

import argparse

from flashtree import LLM
from flashtree.bench.datasets import load_dataset
from flashtree.bench.offline import run_offline
from flashtree.engine.heap import freeze_startup_heap
from flashtree.models.registry import DEFAULT_DRAFTER_DIR


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if min(args.concurrency, args.prompts, args.tokens) < 1:
        ap.error("--concurrency, --prompts and --tokens must be >= 1")
    llm = LLM(model=args.model, device=args.device, draft=str(DEFAULT_DRAFTER_DIR),
              spec="ddtree", spec_policy="adaptive", max_num_seqs=args.concurrency)
    freeze_startup_heap()
    prompts = load_dataset("chat", args.prompts, 1, llm.model_config.vocab_size)
    policy, stats = llm.engine.speculative.policy, llm.engine.speculative.stats
    verdicts, where = [], {"run": "", "step": 0}
    recheck, back_off, observe_step = policy.recheck, policy.back_off, policy.observe_step

    def note(kind: str, requests: int) -> None:
        size = policy.at(requests)
        spec, plain = sorted(size.spec_scale.samples), sorted(size.plain_scale.samples)
        verdicts.append(
            f"  {kind}: {where['run']} step {where['step']}, {requests} requests: accepted "
            f"{policy.recent.accepted:.2f} ({policy.recent.optimistic_accepted():.2f}), "
            f"plain {1e3 * policy.plain_s(requests):.2f} ms, speculative "
            f"{1e3 * policy.spec_s(requests):.2f} ms; {len(plain)} plain / {len(spec)} "
            f"speculative times, slowest speculative {[round(x, 2) for x in spec[-3:]]}, "
            f"fastest plain {[round(x, 2) for x in plain[:3]]}")

    def traced_recheck(requests: int) -> None:
        note("recheck", requests)
        recheck(requests)

    def traced_back_off(requests: int) -> None:
        note("back-off", requests)
        back_off(requests)

    def counted_step(speculative: bool, requests: int, seconds: float) -> None:
        where["step"] += 1
        observe_step(speculative, requests, seconds)

    policy.recheck, policy.back_off = traced_recheck, traced_back_off
    policy.observe_step = counted_step
    for run in ("warm-up", "run 1", "run 2"):
        where["run"], where["step"] = run, 0
        before = dict(stats.budgets)
        records, wall = run_offline(llm, prompts, args.concurrency, args.tokens)
        budgets = {b: n - before.get(b, 0) for b, n in sorted(stats.budgets.items())}
        print(f"{run}: {sum(r.num_output for r in records) / wall:.0f} tok/s, request-steps "
              f"by budget {budgets}")
    print("verdicts against speculation:")
    print("\n".join(verdicts) if verdicts else "  none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
