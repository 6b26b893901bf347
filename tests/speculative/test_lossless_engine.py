"""Speculative sampling through the real engine is lossless: the joint law of the first six
generated tokens under dflash/ddtree x match/rrs is chi-square-consistent with the exact law of
plain sampling, with top-k, top-p and repetition, presence and frequency penalties on. The
drafter agrees with the target often enough that every depth of the block and of the tree is
accepted (asserted); the same harness rejects a deliberately wrong verifier."""

from __future__ import annotations

import pytest
import torch

import flashtree.speculative.candidate_builder as candidate_builder
from flashtree import LLM, SamplingParams
from tests.speculative.agreeing_pair import save_agreeing_pair
from tests.speculative.plain_law import chi_square_p, plain_sampling_law

BLOCK, BUDGET = 4, 6  # DDTree: 6 nodes over the block's 3 draft depths
# The prefill's token, then speculative steps: the first can commit a whole block, the others
# run with penalties that count the tokens of the steps before.
LENGTH, SAMPLES = 6, 2000
PROMPT = [1, 3, 0, 2]
# Sample-and-match decides every node with the uniform plain decoding uses for that position:
# correct, it returns plain decoding's tokens seed by seed, and a second temperature would test
# plain sampling's law again. RRS's own draws and its q = softmax(draft / T) get both.
CONFIGS = [("dflash", "match", 1.3), ("ddtree", "match", 0.7)] + [
    (spec, "rrs", t) for spec in ("dflash", "ddtree") for t in (0.7, 1.3)]
ALPHA = 1e-3 / (len(CONFIGS) + 1)  # Bonferroni over every chi-square test of the module


def _params(t: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=t, top_k=4, top_p=0.9, repetition_penalty=1.3,
                          presence_penalty=0.2, frequency_penalty=0.1, max_tokens=LENGTH,
                          ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("pair"), BLOCK)


@pytest.fixture(scope="module")
def exact_law(pair):
    """Plain sampling's law of the first LENGTH tokens at temperature t, from transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    laws = {}

    def law(t: float) -> dict[tuple[int, ...], float]:
        if t not in laws:
            laws[t] = plain_sampling_law(hf, PROMPT, _params(t), LENGTH)
        return laws[t]

    return law


def _llm(pair, spec, mode) -> LLM:
    target, drafter = pair
    return LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
               spec=spec, tree_sampling=mode,
               tree_budget=BUDGET if spec == "ddtree" else None, device="cpu",
               skip_tokenizer_init=True, max_num_seqs=256)


def _sample(llm: LLM, t: float):
    """SAMPLES seeded generations: (counts of each output, every step's accept length)."""
    outs = llm.generate([PROMPT] * SAMPLES, [_params(t, seed=s) for s in range(SAMPLES)])
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, {n for o in outs for n in o.outputs[0].spec_accept_lengths}


@pytest.mark.parametrize("spec, mode, t", CONFIGS)
def test_speculative_sampling_matches_plain_law(pair, exact_law, spec, mode, t):
    counts, accept_lengths = _sample(_llm(pair, spec, mode), t)
    # A step commits its accepted depth plus one: every depth of the block (DFlash) and of the
    # tree (DDTree) was accepted in some step, the deepest included.
    assert accept_lengths == set(range(1, BLOCK + 1)), f"accept lengths seen: {accept_lengths}"
    assert chi_square_p(counts, exact_law(t), SAMPLES) > ALPHA


def test_harness_rejects_min_p_over_q_on_a_top_k_tree(pair, exact_law, monkeypatch):
    """Power check: RRS's min(1, p/q) walk on DETERMINISTIC top-k siblings (Leviathan's rule on
    a top-k tree, the bias engines have shipped) must fail the same test."""

    def top_k_tree(draft_probs, width, generator):
        drawn = draft_probs.topk(min(width, draft_probs.shape[1]), dim=-1).indices.tolist()
        tokens, parents, spine = [], [], 0
        for row in drawn:
            first = len(tokens) + 1
            tokens += row
            parents += [spine] * len(row)
            spine = first
        return tokens, parents

    monkeypatch.setattr(candidate_builder, "sample_spine_tree", top_k_tree)
    counts, _ = _sample(_llm(pair, "ddtree", "rrs"), 1.3)
    assert chi_square_p(counts, exact_law(1.3), SAMPLES) < ALPHA


def test_exact_law_sums_to_one(exact_law):
    law = exact_law(0.7)
    assert abs(sum(law.values()) - 1) < 1e-9
    assert {len(k) for k in law} == {LENGTH}


@pytest.mark.parametrize("spec, mode", [("dflash", "match"), ("ddtree", "rrs")])
def test_mixed_batches_and_seeded_reproducibility(small_pair, spec, mode):
    """On conftest's random pair, whose greedy tokens vary (the agreeing pair's are all 0)."""
    llm = _llm(small_pair, spec, mode)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(small_pair[0]), device="cpu", skip_tokenizer_init=True)
    expected_greedy = plain.generate([PROMPT], greedy)[0].outputs[0].token_ids
    mixed = [greedy, _params(0.7, seed=5), _params(1.3, seed=6), greedy]
    first = llm.generate([PROMPT] * 4, mixed)
    again = llm.generate([PROMPT] * 4, mixed)
    assert first[0].outputs[0].token_ids == first[3].outputs[0].token_ids == expected_greedy
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
