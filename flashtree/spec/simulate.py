"""Drive the adaptive policy through the decode steps of one request on a synthetic machine, as
LLMEngine does with DDTree: what the policy's tests check it against, and what
`benchmarks/policy_simulation.py` compares policy settings on. No model runs: step times and
accepted drafts are drawn."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from flashtree.spec.budgets import CostModel
from flashtree.spec.policy import SpecPolicy

# A small model on a GPU (seconds): 1 ms per target forward plus 2 us per token, 0.5 ms per
# draft, and plain steps that take 1.37 ms in all.
GPU_LIKE = CostModel(((1, 1e-3), (4096, 1e-3 + 4095 * 2e-6)), ((1, 5e-4), (64, 5e-4)))
GPU_LIKE_PLAIN_S = 1.37e-3
_HICCUP_SHARE = 0.02  # steps that a host hiccup slows, under jitter
_HICCUP_SLOWDOWN = (3.0, 10.0)  # by a factor drawn uniformly from this range


def chain_gains(accept: float, levels: tuple[int, ...]) -> list[float]:
    """Expected accepted drafts of a chain of each level when each draft is accepted with
    probability `accept` given its parent was."""
    return [sum(accept ** d for d in range(1, b + 1)) for b in levels]


@dataclass(frozen=True)
class SyntheticMachine:
    """Plain steps take `plain_s` (the first after speculative ones `cold_plain` x that, as on
    an H200, where it took 1.11x at 16 and 64 requests); speculative ones `spec_factor` x
    their profiled forwards (the first `cold_steps` of them 3x that). A step accepts drafts
    as a real drafter's: each next one with probability `accept` given its parent was (1.38
    on average at 0.58, anywhere from 0 to the tree's depth of 7), while the drafter's trees
    claim chain_gains(`claimed`).
    With `jitter`, every step's time is off by a log-normal factor of that spread, and one step
    in 50 is 3-10x slower (a host hiccup): what a GPU's steps look like to the host. With
    `stretches`, ((steps, accept), ...) repeated, acceptance moves with the text instead: a
    stretch the drafter drafts badly, then one it drafts well. With `slowdowns`, ((steps,
    factor), ...) repeated, speculative steps' times move in stretches (what an H200's host
    did at one request: tens of speculative steps in a row at 1.2x their usual time)."""

    plain_s: float
    spec_factor: float
    cold_steps: int = 0
    cold_plain: float = 1.0
    jitter: float = 0.0
    accept: float = 0.58
    claimed: float = 0.7
    depth: int = 7
    stretches: tuple[tuple[int, float], ...] = ()
    slowdowns: tuple[tuple[int, float], ...] = ()

    def slowdown_at(self, step: int) -> float:
        """The factor on a speculative step's time at the `step`-th step (from 0)."""
        return _periodic(self.slowdowns, step, 1.0)

    def accept_at(self, step: int) -> float:
        """The acceptance of the `step`-th step (from 0)."""
        return _periodic(self.stretches, step, self.accept)

    @property
    def mean_slowdown(self) -> float:
        """The jitter's mean factor on a step's time (1 without jitter)."""
        if not self.jitter:
            return 1.0
        hiccup = _HICCUP_SHARE * (sum(_HICCUP_SLOWDOWN) / 2 - 1)
        return math.exp(self.jitter * self.jitter / 2) * (1 + hiccup)


def _periodic(stretches: tuple[tuple[int, float], ...], step: int, default: float) -> float:
    """The value of the stretch ((steps, value), ... repeated) that holds the `step`-th step,
    or `default` where there are none."""
    if not stretches:
        return default
    step %= sum(n for n, _ in stretches)
    for n, value in stretches:
        if step < n:
            return value
        step -= n
    raise AssertionError("unreachable: step was taken modulo the stretches' length")


def fixed_policy(cost: CostModel, levels: tuple[int, ...]) -> SpecPolicy:
    """A policy that drafts every step and verifies the full tree, its calls still made: the
    fixed policy to compare the adaptive one with on the same machine."""
    policy = SpecPolicy(cost, levels)
    choose = policy.choose

    def full_tree(seq_ids: list[int], raw_gains: list[list[float]]) -> list[int]:
        choose(seq_ids, raw_gains)
        return [levels[-1]] * len(seq_ids)

    policy.should_draft = lambda requests, remaining=None: True
    policy.choose = full_tree
    return policy


def run_steps(policy: SpecPolicy, machine: SyntheticMachine, steps: int, seed: int = 0
              ) -> tuple[list[int], float]:
    """Each step's budget (0: plain) and the tokens committed per second over the run (a
    probe's steps commit one token, as the engine's do)."""
    rng = random.Random(seed)
    gains = chain_gains(machine.claimed, policy.levels)
    budgets: list[int] = []
    cold_steps, tokens, seconds_total = machine.cold_steps, 0, 0.0
    for step in range(steps):
        accept = machine.accept_at(step)
        budget = 0
        if policy.should_draft(1):
            budget = policy.choose([0], [policy.expected_gains(0)])[0]
        if budget:
            accepted = 0
            while accepted < min(budget, machine.depth) and rng.random() < accept:
                accepted += 1
            policy.note_reach({0: gains})
            policy.observe(0, accepted, gains[policy.levels.index(budget)])
            policy.observe_speculation(1, budget, accepted)
            seconds = (machine.spec_factor * machine.slowdown_at(step) * policy.predicted_s
                       * (3 if cold_steps > 0 else 1))
            cold_steps -= 1
            tokens += 1 if policy.probing else 1 + accepted
        else:
            seconds = machine.plain_s * (machine.cold_plain if budgets and budgets[-1] else 1.0)
            tokens += 1
        if machine.jitter:
            seconds *= rng.lognormvariate(0, machine.jitter) * (
                rng.uniform(*_HICCUP_SLOWDOWN) if rng.random() < _HICCUP_SHARE else 1)
        seconds_total += seconds
        policy.observe_step(budget > 0, 1, seconds)
        budgets.append(budget)
    return budgets, tokens / seconds_total
