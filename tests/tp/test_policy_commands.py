"""Under tensor parallelism rank 0's speculation policy decides every rank's steps: its
decision rides in the step's command, so a policy that switches at random between plain steps
and speculative ones at each budget of a DDTree's ladder still yields plain decoding's tokens
on TP=2 (a rank taking its own decision
would run other collectives than rank 0 and stall or diverge), and a steady step costs one
broadcast of a header, not a second collective for the policy."""

from __future__ import annotations

import random

import torch.distributed as dist

from flashtree import LLM, SamplingParams
from flashtree.distributed.tp import TPGroup
from flashtree.speculative.policy import FollowedPolicy, size_class_of
from tests.tp.test_tp_cpu import PROMPTS, tiny  # noqa: F401  (the module's fixture)


class _Switching:
    """A budget of `budgets` or a plain step at seeded random, decided before each step
    (`decisions`)."""

    def __init__(self, budgets: tuple[int, ...], seed: int) -> None:
        self.choices, self.rng, self.kinds = (0, *budgets), random.Random(seed), []
        self.budget = budgets[0]

    def decisions(self) -> FollowedPolicy:
        self.budget = self.rng.choice(self.choices)
        return FollowedPolicy(dict.fromkeys((1, 2, 4, 8), self.budget) if self.budget else {})

    def plan(self, requests: int) -> int:
        assert size_class_of(requests) <= 8
        self.kinds.append(self.budget)
        return self.budget

    def observe(self, result) -> None:
        pass


def _llm(tiny, tp: int, spec: str, policy: str = "fixed") -> LLM:  # noqa: F811
    target, drafter = tiny
    extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec,
                                       "spec_policy": policy}
    if spec == "ddtree":
        extra["tree_budget"] = 15  # the ladder 15, 3
    return LLM(model=str(target), device="cpu", skip_tokenizer_init=True,
               tensor_parallel_size=tp, **extra)


def test_workers_follow_rank_zero_policy(tiny):  # noqa: F811
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(tiny, 1, "none").generate(PROMPTS, greedy)]
    two = _llm(tiny, 2, "ddtree")
    try:
        ladder = two.engine.speculative.cfg.budgets
        assert ladder == (15, 3)
        two.engine.policy = policy = _Switching(ladder, seed=3)
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, greedy)]
    finally:
        two.shutdown()
    assert got == want
    assert set(policy.kinds) == {0, *ladder}  # plain steps and every budget ran


def test_a_steady_step_broadcasts_one_header(tiny, monkeypatch):  # noqa: F811
    two = _llm(tiny, 2, "dflash", policy="adaptive")
    try:
        broadcasts, sends = [], []
        broadcast, send = dist.broadcast, TPGroup.send
        monkeypatch.setattr(dist, "broadcast",
                            lambda t, *a, **k: broadcasts.append(t.numel()) or broadcast(
                                t, *a, **k))
        monkeypatch.setattr(TPGroup, "send", lambda self, ops: sends.append(ops) or send(
            self, ops))
        two.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    finally:
        two.shutdown()
    changed = sum(a != b for a, b in zip(sends, sends[1:])) + 1
    # One header per step; a payload only where the commands changed (requests added, the
    # policy's decisions moved). A policy collective of its own would add one per step.
    assert len(broadcasts) == len(sends) + changed
    assert changed < len(sends) / 2
