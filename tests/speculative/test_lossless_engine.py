"""Speculative sampling through the real engine is lossless: the joint law of the first three
generated tokens under dflash/ddtree x match/rrs is chi-square-consistent with the exact law of
plain sampling (enumerated with transformers' logits), with top-k, top-p and a repetition
penalty on; and the same harness rejects a deliberately wrong verifier."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashtree.speculative.candidates as candidates
from flashtree import LLM, SamplingParams
from flashtree.sampling import apply_penalties, probabilities
from tests.tiny import save_reference_drafter, save_tiny_qwen3

VOCAB, LENGTH, SAMPLES = 5, 3, 2000
PROMPT = [1, 3, 0, 2]
CONFIGS = [(spec, mode, t) for spec in ("dflash", "ddtree") for mode in ("match", "rrs")
           for t in (0.5, 1.0, 1.5)]
ALPHA = 1e-3 / (len(CONFIGS) + 1)  # Bonferroni over every test of the module


def _params(t: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=t, top_k=4, top_p=0.9, repetition_penalty=1.3,
                          max_tokens=LENGTH, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = save_tiny_qwen3(root / "t", seed=11, vocab_size=VOCAB, initializer_range=0.15)
    drafter = save_reference_drafter(root / "d", target, seed=12, block_size=4,
                                     initializer_range=0.5)
    return target, drafter


@pytest.fixture(scope="module")
def hf_target(pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()


def exact_law(hf_target, t: float) -> dict[tuple[int, ...], float]:
    """Plain sampling's law of the first LENGTH tokens, by enumerating every prefix."""
    params = _params(t)
    law = {(): 1.0}
    for _ in range(LENGTH):
        nxt = {}
        for prefix, w in law.items():
            with torch.no_grad():
                logits = hf_target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            probs = probabilities(apply_penalties(logits, params, PROMPT, list(prefix)), params)
            for tok, p in enumerate(probs.tolist()):
                if p > 0:
                    nxt[prefix + (tok,)] = w * p
        law = nxt
    return law


def chi_square_p(counts: dict, law: dict, n: int) -> float:
    from scipy.stats import chisquare

    assert set(counts) <= set(law), f"impossible outputs {set(counts) - set(law)}"
    cells = sorted(law, key=lambda k: -law[k])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:
        if law[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(law[c] * n)
        else:
            pool_o += counts.get(c, 0)
            pool_e += law[c] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = n / sum(exp)  # the law sums to 1 up to float32 rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sample_counts(llm: LLM, t: float) -> dict[tuple[int, ...], int]:
    outs = llm.generate([PROMPT] * SAMPLES, [_params(t, seed=s) for s in range(SAMPLES)])
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _llm(pair, spec, mode) -> LLM:
    target, drafter = pair
    return LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
               spec=spec, tree_sampling=mode,
               tree_budget=6 if spec == "ddtree" else None, device="cpu",
               skip_tokenizer_init=True, max_num_seqs=256)


@pytest.mark.parametrize("spec, mode, t", CONFIGS)
def test_speculative_sampling_matches_plain_law(pair, hf_target, spec, mode, t):
    llm = _llm(pair, spec, mode)
    counts = sample_counts(llm, t)
    assert chi_square_p(counts, exact_law(hf_target, t), SAMPLES) > ALPHA
    # The speculative path really ran and committed several tokens in one step.
    steps = llm.generate([PROMPT] * 64, [_params(t, seed=s) for s in range(64)])
    assert any(max(o.outputs[0].spec_accept_lengths) > 1 for o in steps)


def test_harness_rejects_min_p_over_q_on_a_top_k_tree(pair, hf_target, monkeypatch):
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

    monkeypatch.setattr(candidates, "sample_spine_tree", top_k_tree)
    counts = sample_counts(_llm(pair, "ddtree", "rrs"), 1.0)
    assert chi_square_p(counts, exact_law(hf_target, 1.0), SAMPLES) < ALPHA


def test_exact_law_sums_to_one(hf_target):
    assert abs(sum(exact_law(hf_target, 1.0).values()) - 1) < 1e-5
    assert all(len(k) == LENGTH for k in itertools.islice(exact_law(hf_target, 0.5), 5))


@pytest.mark.parametrize("spec, mode", [("dflash", "match"), ("ddtree", "rrs")])
def test_mixed_batches_and_seeded_reproducibility(pair, spec, mode):
    llm = _llm(pair, spec, mode)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(pair[0]), device="cpu", skip_tokenizer_init=True)
    expected_greedy = plain.generate([PROMPT], greedy)[0].outputs[0].token_ids
    mixed = [greedy, _params(0.7, seed=5), _params(1.3, seed=6), greedy]
    first = llm.generate([PROMPT] * 4, mixed)
    again = llm.generate([PROMPT] * 4, mixed)
    assert first[0].outputs[0].token_ids == first[3].outputs[0].token_ids == expected_greedy
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
