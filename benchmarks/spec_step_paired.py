"""Speculative decode steps of the adaptive policy against the fixed one, paired: every engine
holds a steady batch of CONCURRENCY greedy requests and the engines take turns running blocks
of decode steps (`paired_steps.py`), so that a difference of ~1% in step time shows where
whole runs swing by 10%.

    python benchmarks/spec_step_paired.py --model M.gguf --device cuda --concurrency 4

Engines (`--engines`, comma-separated; a suffix `.x` adds another copy): `fixed` (DDTree, the
full tree every step); `adaptive` (the policy as it runs: it may decode plain, and probes);
`full` (the adaptive policy makes all its calls, but every step drafts and verifies the full
tree: the same trees as `fixed`, so the same tokens at every step, and any difference in step
time is the policy's host work and reads; where the policy would decode plain, its
back-offs skip the forecast, as they do when it runs); `full_untimed` (`full` without step
timing); `adaptive_after_read`, `full_after_read` (the policy's host work that the engine does
while the device runs a speculative step's target forward, `SpecPolicy.meanwhile`, done after
the step's device read instead, as before it moved: the host time that move saves).
Prints each engine's median ms per step, committed tokens per step and its per-block speed
over the first engine's; then, for each `adaptive` engine, what its policy did over all its
decode steps (the warm-up's included): steps run plain, probe steps, rechecks and back-offs
(where it commits fewer tokens per step than `fixed`, whether verdicts are the cause)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from flashtree import LLM
from flashtree.spec.policy import _TRUSTED_PLAIN

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paired_steps import measure, parse_args  # noqa: E402

VARIANTS = ("fixed", "adaptive", "full", "full_untimed", "adaptive_after_read",
            "full_after_read")


def engine(variant: str, args: argparse.Namespace) -> LLM:
    policy_name = "fixed" if variant == "fixed" else "adaptive"
    llm = LLM(model=args.model, device=args.device, max_num_seqs=args.concurrency,
              draft=args.draft, spec="ddtree", spec_policy=policy_name)
    if variant.startswith("full"):
        policy = llm.engine.speculative.policy
        decide, choose, choose_next = policy.should_draft, policy.choose, policy.choose_next

        def always_draft(requests: int, remaining=None) -> bool:
            # Plain step times, as a running engine has them (no step decodes plain here, and
            # a back-off drops them): without them should_draft returns before its forecast.
            scale = policy.at(requests).plain_scale
            while len(scale.samples) < _TRUSTED_PLAIN:
                scale.add(1.0, 1.0)
            decide(requests, remaining)
            policy.probing = False  # a probe would commit one token a step
            return True

        def full_tree(seq_ids: list[int], raw_gains: list[list[float]]) -> list[int]:
            choose(seq_ids, raw_gains)
            return [policy.levels[-1]] * len(seq_ids)

        def full_next_tree(seq_ids: list[int]) -> list[int]:  # a prepared choice's too
            choose_next(seq_ids)
            return [policy.levels[-1]] * len(seq_ids)

        policy.should_draft, policy.choose = always_draft, full_tree
        policy.choose_next = full_next_tree
        if variant == "full_untimed":
            policy.timed = False
    if variant.endswith("_after_read"):
        meanwhile_after_read(llm)
    return llm


def meanwhile_after_read(llm: LLM) -> None:
    """The engine's policy work of `SpeculativeDecoder._policy_meanwhile` run after each
    speculative step instead of before its device read: each step's outcome is taken in
    right after it (as it was before the move), and the next forecast and choice are
    prepared then."""
    spec = llm.engine.speculative
    meanwhile, step = spec._policy_meanwhile, spec.step

    def step_then_policy(seqs):
        verified = step(seqs)
        meanwhile(len(seqs))
        return verified

    spec._policy_meanwhile = lambda requests: None
    spec.step = step_then_policy


def count_verdicts(llm: LLM) -> Counter:
    """A tally, kept as the engine runs, of its policy's verdicts: decode steps, those run
    plain and those of probes, rechecks and back-offs begun."""
    policy, tally = llm.engine.speculative.policy, Counter()
    decide, recheck, back_off = policy.should_draft, policy.recheck, policy.back_off

    def counted_decide(requests: int, remaining=None) -> bool:
        drafts = decide(requests, remaining)
        tally["steps"] += 1
        tally["plain" if not drafts else "probe" if policy.probing else "speculative"] += 1
        return drafts

    def counted(name: str, method):
        def call(requests: int) -> None:
            tally[name] += 1
            method(requests)
        return call

    policy.should_draft = counted_decide
    policy.recheck, policy.back_off = counted("rechecks", recheck), counted("back-offs", back_off)
    return tally


def main() -> int:
    args, names = parse_args(__doc__.split("\n\n")[0], VARIANTS, concurrency=4, blocks=40,
                             block=8, engines="fixed,full,adaptive")
    engines = {n: engine(n.split(".")[0], args) for n in names}
    tallies = {n: count_verdicts(llm) for n, llm in engines.items()
               if n.startswith("adaptive")}
    # Up to a whole tree's depth a step; a request that ends stops the measurement early.
    longest = min(llm.engine.args.scheduler.max_model_len for llm in engines.values())
    measure(engines, args, max_tokens=longest // 2)
    for n, tally in tallies.items():
        print(f"{n}: of {tally['steps']} decode steps {tally['plain']} plain, "
              f"{tally['probe']} of probes; {tally['rechecks']} rechecks, "
              f"{tally['back-offs']} back-offs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
