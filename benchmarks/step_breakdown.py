"""Where an offline run's time goes, per spec, engine step by engine step: steps, the time in
them, speculative steps, step-time percentiles, the draft cache's catch-up flushes and the
Python garbage collector; then the adaptive policy's state. Prompts: the chat set (a GGUF or
other model with a tokenizer) or random tokens on a SmolLM2-135M-shaped random target.

    python benchmarks/step_breakdown.py --model SmolLM2-135M-Instruct.Q4_1.gguf --concurrency 64
    python benchmarks/step_breakdown.py --model M.gguf --concurrency 1 --forced-runs 40,8

`--forced-runs P,S` replaces the adaptive policy's choice by P plain steps then S speculative
steps (full budget), over and over, and reports the median step time and mean accepted drafts
by position in a run: what switching to speculation costs on top of a run's steady steps, and
whether the drafter accepts as much right after plain steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.profile_step import SMOLLM2_135M  # noqa: E402
from flashtree import LLM  # noqa: E402
from flashtree.bench.datasets import BenchPrompt, load_dataset  # noqa: E402
from flashtree.bench.offline import run_offline  # noqa: E402
from flashtree.engine.heap import freeze_startup_heap  # noqa: E402
from flashtree.models.registry import DEFAULT_DRAFTER_DIR  # noqa: E402
from flashtree.spec.policy import SpecPolicy, batch_bucket  # noqa: E402


class GcClock:
    """Seconds spent in the garbage collector, and full (generation 2) collections."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2


def prompts_for(args: argparse.Namespace, chat: bool) -> list[BenchPrompt]:
    if chat:
        return load_dataset("chat", args.num_prompts)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 70, (args.num_prompts,), generator=gen).tolist()
    return [BenchPrompt(token_ids=torch.randint(100, 49000, (n,), generator=gen).tolist(),
                        ignore_eos=True) for n in lengths]


def force_runs(plain: int, speculative: int) -> dict:
    """Make every adaptive policy run `plain` plain steps, then `speculative` full-budget
    speculative ones, repeating; returns the counter of decode steps decided so far."""
    pattern = [False] * plain + [True] * speculative
    decided = {"steps": 0, "period": len(pattern), "plain": plain}

    def should_draft(self, requests: int, remaining=None) -> bool:
        decided["steps"] += 1
        return pattern[(decided["steps"] - 1) % len(pattern)]

    SpecPolicy.should_draft = should_draft
    SpecPolicy.choose = lambda self, seq_ids, gains: [self.levels[-1]] * len(seq_ids)
    return decided


def forced_runs(text: str) -> tuple[int, int]:
    """argparse type of --forced-runs: 'PLAIN,SPECULATIVE', two positive integers."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PLAIN,SPECULATIVE step counts, two positive integers (e.g. 40,8)")
    return int(parts[0]), int(parts[1])


def timed_run(llm: LLM, prompts: list[BenchPrompt], args: argparse.Namespace,
              gc_clock: GcClock, decided: dict | None) -> dict:
    """One offline run with every engine step and draft-cache flush timed."""
    eng = llm.engine
    steps: list[tuple[float, int]] = []  # (seconds, speculative drafts so far)
    details: list[tuple[float, int, dict, float]] = []  # seconds, requests, budgets, flush s
    by_position: dict[int, list[float]] = {}
    accepted_by_position: dict[int, list[int]] = {}  # accepted drafts per speculative step
    engine_step, flush = eng.step, eng.proposer.flush if eng.proposer else None
    flushes = [0.0, 0]
    prefills = [0.0, 0]  # seconds, steps with a prompt chunk
    schedule, scheduled = eng.scheduler.schedule, {"prompt": False}

    def timed_schedule():  # what the step runs, as the scheduler decided it
        chunks = schedule()
        scheduled["prompt"] = any(not c.decode for c in chunks)
        return chunks
    stats = eng.speculative.stats if eng.speculative else None

    def step():
        position = -1
        if decided is not None:  # this step's place in the forced pattern (-1: plain)
            position = decided["steps"] % decided["period"] - decided["plain"]
        accepted = stats.num_accepted_tokens if stats else 0
        budgets, flushed = dict(stats.budgets) if stats else {}, flushes[0]
        requests = len(eng.scheduler.running) + len(eng.scheduler.waiting)
        start = time.perf_counter()
        out = engine_step()
        seconds = time.perf_counter() - start
        steps.append((seconds, stats.num_drafts if stats else 0))
        if scheduled["prompt"]:
            prefills[0] += seconds
            prefills[1] += 1
        chosen = {b: n - budgets.get(b, 0) for b, n in sorted(stats.budgets.items())
                  if n > budgets.get(b, 0)} if stats else {}
        details.append((seconds, requests, chosen, flushes[0] - flushed))
        by_position.setdefault(max(position, -1), []).append(seconds)
        if position >= 0 and stats:
            accepted_by_position.setdefault(position, []).append(
                stats.num_accepted_tokens - accepted)
        return out

    def timed_flush():
        start, pending = time.perf_counter(), eng.proposer._deferred_rows
        flush()
        flushes[0] += time.perf_counter() - start
        flushes[1] += pending > 0

    policy = eng.speculative.policy if eng.speculative else None
    by_bucket = watch_policy(policy) if policy is not None and decided is None else None
    eng.step, eng.scheduler.schedule = step, timed_schedule
    if flush is not None:
        eng.proposer.flush = timed_flush
    gc_clock.seconds, gc_clock.full = 0.0, 0
    accepted_before = stats.num_accepted_tokens if stats else 0
    records, wall = run_offline(llm, prompts, args.concurrency, args.max_tokens)
    accepted = (stats.num_accepted_tokens - accepted_before) if stats else 0
    del eng.step, eng.scheduler.schedule
    if flush is not None:
        del eng.proposer.flush
    if by_bucket is not None:
        del policy.observe_step, policy.observe_speculation, policy.drain.speculation_pays
    times = sorted(s for s, _ in steps)
    speculative = [s for i, (s, d) in enumerate(steps) if d != (steps[i - 1][1] if i else 0)]
    return {"wall": wall, "tokens": sum(r.num_output for r in records), "steps": len(steps),
            "in_steps": sum(times), "spec_steps": len(speculative),
            "spec_ms": 1e3 * sum(speculative), "accepted": accepted,
            "p50": 1e3 * times[len(times) // 2],
            "p99": 1e3 * times[int(len(times) * 0.99)], "max": 1e3 * times[-1],
            "flush_ms": 1e3 * flushes[0], "flushes": flushes[1],
            "prefill_ms": 1e3 * prefills[0], "prefills": prefills[1],
            "gc_ms": 1e3 * gc_clock.seconds, "gc_full": gc_clock.full,
            "by_position": by_position, "accepted_by_position": accepted_by_position,
            "slowest": sorted(details, key=lambda d: -d[0])[: args.slowest],
            "by_bucket": by_bucket}


def watch_policy(policy: SpecPolicy) -> dict[int, dict[str, list]]:
    """Record the adaptive policy's own view of each decode step, per batch bucket: plain and
    speculative step seconds, how many speculative steps were probes, the accepted drafts
    per request of each speculative step, and the steps a draining batch ran plain."""
    by_bucket: dict[int, dict[str, list]] = {}
    observe_step, observe_speculation = policy.observe_step, policy.observe_speculation
    speculation_pays = policy.drain.speculation_pays

    def bucket(requests: int) -> dict[str, list]:
        return by_bucket.setdefault(batch_bucket(requests), {
            "plain": [], "spec": [], "probes": [], "accepted": [], "drain_plain": []})

    def step(speculative: bool, requests: int, seconds: float) -> None:
        b = bucket(requests)
        b["spec" if speculative else "plain"].append(seconds)
        if speculative and policy.probing:
            b["probes"].append(seconds)
        observe_step(speculative, requests, seconds)

    def speculation(requests: int, verified: float, accepted: float) -> None:
        bucket(requests)["accepted"].append(accepted / requests)
        observe_speculation(requests, verified, accepted)

    def drain_verdict(remaining: list[int], spec_s, plain_s) -> bool:
        pays = speculation_pays(remaining, spec_s, plain_s)
        if not pays:
            bucket(len(remaining))["drain_plain"].append(max(remaining))
        return pays

    policy.observe_step, policy.observe_speculation = step, speculation
    policy.drain.speculation_pays = drain_verdict
    return by_bucket


def print_by_bucket(name: str, by_bucket: dict[int, dict[str, list]], policy: SpecPolicy) -> None:
    """One run's decode steps by batch bucket, and the policy's forecast there at the end."""
    print(f"\n{name}, decode steps by batch bucket: steps plain / speculative (probes), median "
          "ms plain / speculative, accepted drafts per request, (1 + accepted) x plain ms / "
          "speculative ms (above 1: speculation paid); the forecast's ms plain / speculative and "
          "accepted at the end; steps a draining batch ran plain (and the most tokens left then)")
    for b, r in sorted(by_bucket.items()):
        plain = 1e3 * statistics.median(r["plain"]) if r["plain"] else float("nan")
        spec = 1e3 * statistics.median(r["spec"]) if r["spec"] else float("nan")
        accepted = statistics.mean(r["accepted"]) if r["accepted"] else float("nan")
        print(f"  {b:4d}: {len(r['plain'])} / {len(r['spec'])} ({len(r['probes'])}), "
              f"{plain:.2f} / {spec:.2f} ms, {accepted:.2f}, {(1 + accepted) * plain / spec:.2f}; "
              f"forecast {1e3 * policy.plain_s(b):.2f} / {1e3 * policy.spec_s(b):.2f} ms, "
              f"{policy.recent.optimistic_accepted():.2f}; drain plain {len(r['drain_plain'])}"
              + (f" ({max(r['drain_plain'])} left)" if r["drain_plain"] else ""))
    paces = sorted(policy.drain.samples())
    if paces:
        quartiles = statistics.quantiles(paces, n=4) if len(paces) > 1 else paces * 3
        print(f"  paces (steps per committed token) of {len(paces)} requests: min "
              f"{paces[0]:.2f}, quartiles {' / '.join(f'{q:.2f}' for q in quartiles)}, "
              f"max {paces[-1]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: a random SmolLM2-135M-shaped target")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--specs", default="none,ddtree,none,ddtree",
                    help="comma list of none | ddtree (adaptive) | ddtree:fixed, run in order; "
                         "each engine is built and warmed up with the workload once")
    ap.add_argument("--forced-runs", default=None, type=forced_runs, metavar="PLAIN,SPECULATIVE",
                    help="two positive integers, e.g. 40,8")
    ap.add_argument("--slowest", type=int, default=0,
                    help="list this many of each run's slowest steps: requests, the budgets "
                         "chosen (request-steps by budget; none: prefill or plain engine), and "
                         "the draft-cache flush inside the step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    chat = args.model is not None
    if args.model is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        args.model = tempfile.mkdtemp()
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(args.model)
    decided = force_runs(*args.forced_runs) if args.forced_runs else None
    prompts, gc_clock = prompts_for(args, chat), GcClock()
    engines: dict[str, LLM] = {}
    results = []
    for spec in args.specs.split(","):
        if spec not in engines:
            kw = {"spec": "none"} if spec == "none" else dict(
                draft=str(DEFAULT_DRAFTER_DIR), spec="ddtree",
                spec_policy="fixed" if spec.endswith(":fixed") else "adaptive")
            llm = LLM(model=args.model, device=args.device, skip_tokenizer_init=not chat,
                      max_num_seqs=args.concurrency, max_model_len=512, **kw)
            freeze_startup_heap()  # as `flashtree bench` and `flashtree serve` do
            run_offline(llm, prompts, args.concurrency, args.max_tokens)  # warm-up
            engines[spec] = llm
        results.append((spec, timed_run(engines[spec], prompts, args, gc_clock, decided)))
    for spec, llm in engines.items():
        speculative = llm.engine.speculative
        if speculative is not None and speculative.policy is not None and decided is None:
            p, budgets = speculative.policy, dict(sorted(speculative.stats.budgets.items()))
            size = p.at(args.concurrency)
            print(f"{spec}: request-steps by budget {budgets}"
                  f"; measured/profiled step time at {args.concurrency}: speculative "
                  f"{size.spec_scale.factor:.2f}, plain {size.plain_scale.factor:.2f}; recent "
                  f"verified/accepted per request {p.recent.verified:.2f}/{p.recent.accepted:.2f}")
    print(f"\nconcurrency {args.concurrency}, {args.num_prompts} prompts x {args.max_tokens} "
          f"tokens, {args.device}\n\n| spec | wall s | tok/s | steps | s in steps | "
          "speculative steps (ms) | accepted drafts per speculative step "
          "| step p50 / p99 / max ms | steps with a prompt chunk (ms) | flushes (ms) "
          "| GC ms (full) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec, r in results:
        print(f"| {spec} | {r['wall']:.2f} | {r['tokens'] / r['wall']:.0f} | {r['steps']} "
              f"| {r['in_steps']:.2f} | {r['spec_steps']} ({r['spec_ms']:.1f}) "
              f"| {r['accepted'] / max(r['spec_steps'], 1):.2f} "
              f"| {r['p50']:.2f} / {r['p99']:.2f} / {r['max']:.1f} "
              f"| {r['prefills']} ({r['prefill_ms']:.1f}) "
              f"| {r['flushes']} ({r['flush_ms']:.1f}) | {r['gc_ms']:.1f} ({r['gc_full']}) |")
    for i, (spec, r) in enumerate(results):
        if r["slowest"]:
            print(f"\nrun {i + 1} ({spec}), slowest steps: ms, requests in the engine, "
                  "request-steps by budget, flush ms inside")
        for seconds, requests, budgets, flush_s in r["slowest"]:
            print(f"  {1e3 * seconds:8.2f} {requests:4d} {budgets} {1e3 * flush_s:.2f}")
    for i, (spec, r) in enumerate(results):
        if r["by_bucket"] is not None:
            print_by_bucket(f"run {i + 1} ({spec})", r["by_bucket"],
                            engines[spec].engine.speculative.policy)
    if decided is not None:
        spec, r = results[-1]
        print(f"\n{spec}: median step ms (mean accepted drafts) by position in a forced run "
              "(-1: plain steps)")
        for position, times in sorted(r["by_position"].items()):
            accepted = r["accepted_by_position"].get(position)
            drafts = f" ({statistics.mean(accepted):.2f})" if accepted else ""
            print(f"  {position:2d}: {1e3 * statistics.median(times):.2f}{drafts} "
                  f"({len(times)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
