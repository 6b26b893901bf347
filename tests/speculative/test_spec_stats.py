"""The engine's speculation counters (`LLMEngine.spec_stats`, what /metrics exports) against a
brute-force replay of the requests' own commit records: drafts, verified candidates per step
(the budget histogram, DFlash blocks shrinking at the end), accepted tokens per position and
steps per batch size. Greedy steps keep their candidates on the device, sampled ones on the
host: both paths of the speculative step are counted."""

from __future__ import annotations

from collections import Counter

import pytest

from flashtree import LLM, SamplingParams
from tests.tiny import TINY_PROMPTS, save_reference_drafter, save_tiny_qwen3

VOCAB, BLOCK, BUDGET = 5, 4, 6
MAX_TOKENS = 11  # not a multiple of any block: the last DFlash blocks shrink


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = save_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=5, vocab_size=VOCAB,
                             initializer_range=0.3)
    drafter = save_reference_drafter(tmp_path_factory.mktemp("drafter"), target, seed=7,
                                     initializer_range=0.3, block_size=BLOCK)
    return target, drafter


def replayed_stats(prompts: list[list[int]], lengths: list[list[int]], spec: str) -> dict:
    """The counters that requests prefilled together and then decoded speculatively at every
    step must have left: step s of request r committed lengths[r][s] tokens over
    num_computed = prompt + the tokens committed before it, with a draft block of
    min(BLOCK, room left) for DFlash, and a tree of BUDGET nodes for DDTree."""
    budgets, per_pos = Counter(), Counter()
    for prompt, steps in zip(prompts, lengths):
        computed, total = len(prompt), len(prompt) + MAX_TOKENS
        for committed in steps:
            budgets[BUDGET if spec == "ddtree" else min(BLOCK, total - computed) - 1] += 1
            per_pos.update(range(committed - 1))
            computed += committed
    # Step s runs the requests that have an s-th step.
    batch = Counter(sum(len(steps) > s for steps in lengths)
                    for s in range(max(map(len, lengths))))
    return {"num_drafts": sum(map(len, lengths)),
            "num_draft_tokens": sum(b * n for b, n in budgets.items()),
            "num_accepted_tokens": sum(n - 1 for steps in lengths for n in steps),
            "accepted_per_pos": [per_pos[p] for p in range(len(per_pos))],
            "budgets": dict(budgets), "speculative_steps": dict(batch)}


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_counters_match_the_requests_commits(pair, spec, temperature):
    target, drafter = pair
    tree = {"tree_budget": BUDGET} if spec == "ddtree" else {}
    llm = LLM(model=str(target), draft=str(drafter), spec=spec, spec_policy="fixed", device="cpu",
              dtype="float32", skip_tokenizer_init=True, **tree)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    outs = llm.generate(TINY_PROMPTS, params)
    lengths = [list(o.outputs[0].spec_accept_lengths) for o in outs]
    assert any(n > 1 for steps in lengths for n in steps), lengths  # drafts were accepted
    expected = replayed_stats(TINY_PROMPTS, lengths, spec)
    got = {name: getattr(llm.engine.spec_stats, name) for name in expected}
    assert got == expected, lengths
