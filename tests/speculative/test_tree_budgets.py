"""A DDTree engine verifies trees of every budget of its ladder (`SpecConfig.budgets`), picked
step by step: each budget commits plain decoding's tokens, and a step at a large budget tells
exactly what each smaller budget's tree would have committed (the adaptive policy's acceptance
for budgets it does not run). Oracle for the latter: an engine that runs the smaller tree."""

from __future__ import annotations

import random

import pytest

from flashtree import LLM, SamplingParams
from flashtree.config import SpecConfig
from flashtree.speculative.policy import StepResult

BUDGET = 63
PROMPTS = [[0, 1, 2], [3, 4], [1, 1, 0, 2], [4, 3, 2, 1], [2], [0, 0, 1], [3, 1], [2, 4, 4]]


class _Planned:
    """Plans budgets from `choose(step)` and keeps every step's result."""

    def __init__(self, choose) -> None:
        self.choose, self.results = choose, []

    def plan(self, requests: int) -> int:
        return self.choose(len(self.results))

    def observe(self, result: StepResult) -> None:
        self.results.append(result)


def _llm(pair) -> LLM:
    target, drafter = map(str, pair)
    return LLM(model=target, draft=drafter, spec="ddtree", tree_budget=BUDGET,
               spec_policy="fixed", device="cpu", skip_tokenizer_init=True, max_num_seqs=1)


def test_the_ladder_is_the_budget_and_its_quarters():
    assert SpecConfig("ddtree", 16, 255).budgets == (255, 63, 15, 3)
    assert SpecConfig("ddtree", 16, 100).budgets == (100, 24, 5)
    assert SpecConfig("ddtree", 16, 7).budgets == (7,)
    assert SpecConfig("dflash", 16, 255).budgets == (15,)


def _first_step(llm: LLM, prompt: list[int], budget: int, params: SamplingParams) -> StepResult:
    """The first decode step of `prompt` at `budget` (after the prefill's token)."""
    llm.engine.policy = policy = _Planned(lambda _: budget)
    llm.generate([prompt], params)
    return policy.results[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_large_tree_tells_what_each_smaller_tree_commits(small_pair, temperature):
    """Greedy steps keep their trees on the device, seeded sampled ones build them on the host
    (sample-and-match decides each node with the draw plain decoding uses for its position, so
    a smaller tree's walk is the larger walk cut where it leaves the smaller tree)."""
    llm = _llm(small_pair)
    smaller = llm.engine.speculative.cfg.budgets[1:]
    assert smaller == (15, 3)
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=12, ignore_eos=True)
    differs = 0
    for prompt in PROMPTS:
        told = _first_step(llm, prompt, BUDGET, params).committed_at
        assert told is not None and told[BUDGET] == _first_step(llm, prompt, BUDGET,
                                                                  params).committed
        for budget in smaller:
            assert told[budget] == _first_step(llm, prompt, budget, params).committed, (
                prompt, budget)
        differs += told[3] < told[BUDGET]
    assert differs >= 2  # the smaller trees did accept less somewhere


def test_budgets_switched_step_to_step_commit_plain_decodings_tokens(small_pair):
    llm = _llm(small_pair)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(small_pair[0]), device="cpu", skip_tokenizer_init=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    rng = random.Random(0)
    ladder = [0, *llm.engine.speculative.cfg.budgets]
    llm.engine.policy = policy = _Planned(lambda _: rng.choice(ladder))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    assert {r.budget for r in policy.results} == set(ladder)
