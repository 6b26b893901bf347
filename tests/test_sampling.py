"""Sampling: parameter validation, the processed distribution against brute-force enumeration
and transformers' logits processors, and the engine's draws against the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.sampling import SamplingRow, apply_penalties, probabilities, sample_tokens
from tests.tiny import save_tiny_llama


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.2),
        ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
        ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", float("nan")),
        ("seed", "abc"), ("stop", [""]), ("stop_token_ids", [-1]),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _brute_force(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """Enumerate tokens by descending probability and apply each filter by its definition."""
    p = torch.softmax(logits.double() / t, -1)
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    keep = set(order[:top_k] if top_k > 0 else order)
    kept_p = torch.zeros_like(p)
    for i in keep:
        kept_p[i] = p[i]
    kept_p /= kept_p.sum()
    mass, nucleus = 0.0, set()
    for i in sorted(keep, key=lambda i: -float(kept_p[i])):
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += float(kept_p[i])
    out = torch.zeros_like(p)
    for i in nucleus:
        out[i] = kept_p[i]
    out[out < min_p * out.max()] = 0
    return out / out.sum()


@pytest.mark.parametrize("t, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1),
    (0.9, 8, 0.6, 0.05),
])
def test_probabilities_match_brute_force(t, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(20) * 2
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    got = probabilities(logits, params).double()
    assert torch.allclose(got, _brute_force(logits, t, top_k, top_p, min_p), atol=1e-6)


def test_penalties_match_transformers_and_vllm_definition():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(30)
    prompt, output = [1, 2, 3], [3, 4, 4, 5]
    rep = SamplingParams(repetition_penalty=1.3)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([prompt + output]), logits.clone()[None]
    )[0]
    assert torch.allclose(apply_penalties(logits, rep, prompt, output), expected)

    pf = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, pf, prompt, output)
    expected = logits.clone()
    for tok in set(output):  # vLLM: presence and frequency count generated tokens only
        expected[tok] -= 0.5 + 0.25 * output.count(tok)
    assert torch.allclose(got, expected)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), seed=3, vocab_size=16,
                           initializer_range=0.5)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    expected_all = probs * counts.sum()
    big = expected_all >= 5  # chi-square needs ~5 expected counts per bin
    observed, expected = counts[big].double(), expected_all[big]
    small = ~big & (probs > 0)  # lump the rare (but possible) tokens into one bin
    if small.any():
        observed = torch.cat([observed, counts[small].sum().double()[None]])
        expected = torch.cat([expected, expected_all[small].sum()[None]])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def test_engine_samples_the_target_distribution(tiny_dir):
    """Chi-square of 2000 seeded first-token draws against transformers' softmax(logits / T)
    with top-k applied by enumeration."""
    from transformers import AutoModelForCausalLM

    prompt = [3, 1, 4, 1, 5]
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    target = _brute_force(logits, 0.8, 10, 1.0, 0.0)

    llm = LLM(model=str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_num_seqs=64)
    n = 2000
    params = [SamplingParams(temperature=0.8, top_k=10, max_tokens=1, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]),
                            minlength=logits.shape[0])
    assert counts[target == 0].sum() == 0, "sampled a token that top-k removed"
    assert _chi_square_p_value(counts, target) > 1e-3


def test_seeds_reproduce_across_batch_composition(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True)
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True)
              for s in range(5)]
    batched = llm.generate([[5, 6], [1, 2, 3], [7, 8, 9, 10], [2], [4, 4]],
                           [others[0], sp, others[2], others[3], others[4]])
    assert batched[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    assert llm.generate([[1, 2, 3]], other_seed)[0].outputs[0].token_ids != alone


def test_greedy_ignores_seed(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True)
    a = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=8, seed=1))
    b = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=8, seed=2))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert not math.isnan(sum(a[0].outputs[0].token_ids))


def test_batched_draws_equal_one_row_at_a_time():
    """sample_tokens groups rows by parameters; every row must still get exactly the token it
    gets alone (same seed), greedy rows the argmax of their penalized logits."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [
        SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=1.2, top_k=5, frequency_penalty=1.0),
    ]
    history = [[1, 2], [3], [4, 5, 6], [7], [int(logits[4].argmax()), 9], [10, 10, 11]]

    def rows(seed):
        return [SamplingRow(p, seed + i, [0], h) for i, (p, h) in enumerate(zip(params, history))]

    penalized = apply_penalties(logits[4], params[4], [0], history[4])
    for seed in range(0, 50, 10):
        batch = sample_tokens(logits, rows(seed))
        alone = [sample_tokens(logits[i : i + 1], rows(seed)[i : i + 1])[0] for i in range(6)]
        assert batch == alone
        assert batch[0] == int(logits[0].argmax())
        assert batch[4] == int(penalized.argmax()) != int(logits[4].argmax())


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_mass():
    """Position-keyed uniforms through the inverse CDF: a chi-square test against the
    distribution (top-k leaves zero-mass tokens, which are never drawn)."""
    from scipy.stats import chisquare

    from flashtree.sampling import inverse_cdf, uniform

    probs = probabilities(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]),
                          SamplingParams(temperature=1.0, top_k=4))
    n = 20000
    draws = inverse_cdf(probs.expand(n, -1), [uniform(11, i) for i in range(n)])
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[4:].sum() == 0
    expected = n * probs[0, :4].double() / probs[0, :4].double().sum()
    assert chisquare(counts[:4], expected).pvalue > 1e-3
    assert inverse_cdf(probs, [1 - 2**-53]).item() == 3  # the last token with mass
