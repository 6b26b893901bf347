"""Sampling: parameter validation, the processed distribution against brute-force enumeration
and transformers' logits processors, and the engine's draws against the target distribution."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.sampling import (
    SamplingRow,
    apply_penalties,
    penalize_rows,
    probabilities,
    sample_tokens,
)
from tests.sampling_oracle import penalized_logits, sampling_probs
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


# Penalized logits stay below 64 in magnitude here; flashtree and the oracle order their float32
# products and differences differently, up to 4 roundings each of at most half an ulp (2^-18).
PENALTY_ATOL = 8 * 2**-18
# Filtered probabilities: flashtree renormalizes the kept softmax mass, transformers takes a
# softmax over the kept logits; both float32, a few roundings of 2^-24 relative each.
PROB_ATOL = 1e-6


def _random_case(g: torch.Generator, vocab: int, rows: int, ties: bool) -> torch.Tensor:
    """[rows, vocab] logits; with ties, rounded to halves so that many are exactly equal (and
    some exactly 0, where the repetition penalty's two branches meet)."""
    logits = torch.randn(rows, vocab, generator=g) * 3
    return torch.round(logits * 2) / 2 if ties else logits


def _ids(g: torch.Generator, vocab: int, most: int) -> list[int]:
    """Up to `most` token ids drawn from a few, so that they repeat."""
    n = int(torch.randint(0, most + 1, (), generator=g))
    pool = torch.randint(0, vocab, (max(1, vocab // 3),), generator=g)
    return pool[torch.randint(0, len(pool), (n,), generator=g)].tolist()


def _pick(g: torch.Generator, options: tuple):
    return options[int(torch.randint(0, len(options), (), generator=g))]


def test_penalties_match_transformers_and_openai_formula():
    """penalize_rows (rows sharing a context, each adding its own tokens) and apply_penalties
    against the oracle row by row over 160 seeded cases: repeats in prompt and output, tied
    and zero logits, penalties at their limits (repetition < 1 rewards)."""
    g = torch.Generator().manual_seed(0)
    for case in range(160):
        vocab, rows = _pick(g, (3, 17, 128, 1000)), _pick(g, (1, 2, 3))
        logits = _random_case(g, vocab, rows, ties=case % 2 == 0)
        params = SamplingParams(repetition_penalty=_pick(g, (1.0, 0.5, 1.3, 2.0)),
                                presence_penalty=_pick(g, (0.0, 0.4, -2.0, 2.0)),
                                frequency_penalty=_pick(g, (0.0, 0.3, -2.0, 2.0)))
        prompt, output = _ids(g, vocab, 12), _ids(g, vocab, 10)
        paths = [_ids(g, vocab, 4) for _ in range(rows)]
        extra = torch.zeros(rows, vocab)
        for r, path in enumerate(paths):
            for token in path:
                extra[r, token] += 1
        got = penalize_rows(logits, params, prompt, output, extra)
        for r, path in enumerate(paths):
            want = penalized_logits(logits[r], params, prompt, output + path)
            where = (f"case {case} row {r}: repetition {params.repetition_penalty}, presence "
                     f"{params.presence_penalty}, frequency {params.frequency_penalty}")
            torch.testing.assert_close(got[r], want, rtol=0, atol=PENALTY_ATOL,
                                       msg=lambda m, where=where: f"{where}: {m}")
        torch.testing.assert_close(apply_penalties(logits[0], params, prompt, output),
                                   penalized_logits(logits[0], params, prompt, output),
                                   rtol=0, atol=PENALTY_ATOL)


def _near_a_cut(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether a top-p or min-p threshold lies within float32 rounding of a token's value, where
    two correct float32 implementations may cut differently. torch's CPU cumsum accumulates in
    double, so the mass before a token and a probability ratio are each off by a few roundings
    of 2^-24 relative (softmax, sum, renormalization); 2^-20 covers 16 of them."""
    z = logits.double() / params.temperature
    if 0 < params.top_k < len(z):
        z = z.masked_fill(z < z.topk(params.top_k).values[-1], float("-inf"))
    p = torch.softmax(z, -1).sort(descending=True).values
    before = p.cumsum(-1) - p  # the mass of the more likely tokens
    if params.top_p < 1 and ((before - params.top_p).abs() < 2**-20)[p > 0].any():
        return True
    ratio = p / p[0]  # min-p keeps a token whose ratio to the top one reaches min_p
    near = (ratio - params.min_p).abs() < 2**-20 * params.min_p
    return params.min_p > 0 and bool(near[(ratio != params.min_p) & (p > 0)].any())


def _mass_by_tie_group(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The probability of each group of tokens with equal logits (within float32 rounding),
    ordered by logit: which of tied tokens a top-p cut keeps is unspecified (flashtree sorts
    descending, transformers ascending), only how much of the group's mass it keeps."""
    order = logits.argsort()
    new_group = torch.cat([torch.tensor([True]), logits[order].diff() > 1e-5])
    group = torch.empty_like(order)
    group[order] = new_group.cumsum(0) - 1
    return torch.zeros(int(group.max()) + 1, dtype=probs.dtype).index_add_(0, group, probs)


def test_probabilities_match_transformers_warpers():
    """flashtree's temperature, top-k, top-p and min-p against transformers' warpers over 240
    seeded cases: batches of rows, vocabularies of 2 to 500, ties, top_k 1 and beyond the
    vocabulary, top_p near 0 and 1, min_p up to 1, temperatures 0.05 to 10."""
    g = torch.Generator().manual_seed(1)
    for case in range(240):
        vocab, ties = _pick(g, (2, 3, 10, 64, 500)), case % 2 == 1
        params = SamplingParams(temperature=_pick(g, (1.0, 0.05, 0.7, 10.0)),
                                top_k=_pick(g, (0, -1, 1, 3, vocab, vocab + 5)),
                                top_p=_pick(g, (1.0, 1e-4, 0.6, 0.999)),
                                min_p=_pick(g, (0.0, 0.0, 0.1, 1.0)))
        logits = _random_case(g, vocab, _pick(g, (1, 2, 3)), ties)
        got = probabilities(logits, params)
        for r in range(len(logits)):
            where = (f"case {case} row {r}: temperature {params.temperature}, top_k "
                     f"{params.top_k}, top_p {params.top_p}, min_p {params.min_p}")
            assert not _near_a_cut(logits[r], params), f"{where}: rounding decides a cut"
            want = sampling_probs(logits[r], params, [], [])
            torch.testing.assert_close(_mass_by_tie_group(got[r], logits[r]),
                                       _mass_by_tie_group(want, logits[r]), rtol=0,
                                       atol=PROB_ATOL, msg=lambda m, where=where: f"{where}: {m}")
            if not ties:  # token by token
                torch.testing.assert_close(got[r], want, rtol=0, atol=PROB_ATOL,
                                           msg=lambda m, where=where: f"{where}: {m}")


def test_sample_tokens_draw_the_oracle_law():
    """2000 seeded draws of one penalized, filtered row (every processing step on) through
    sample_tokens: chi-square against the oracle's distribution, nothing outside its support."""
    from scipy.stats import chisquare

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_k=9, top_p=0.95, min_p=0.03,
                            repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)
    prompt, output = [1, 2, 2, 7], [3, 3, 4, 7]
    want = sampling_probs(logits[0], params, prompt, output).double()
    assert 4 <= int((want > 0).sum()) < 9  # top-k, top-p or min-p removed some, several remain
    n = 2000
    draws = sample_tokens(logits.expand(n, -1),
                          [SamplingRow(params, seed, prompt, output) for seed in range(n)])
    counts = torch.bincount(torch.tensor(draws), minlength=12).double()
    assert counts[want == 0].sum() == 0, "drew a token the oracle removed"
    kept = want > 0
    expected = n * want[kept] / want[kept].sum()
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


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


def test_greedy_ignores_seed_and_equals_transformers_greedy(tiny_dir):
    """Greedy tokens are the same under any seed and equal transformers' greedy generate, whose
    top-2 logit gap along the path exceeds the two implementations' float32 difference."""
    from transformers import AutoModelForCausalLM

    prompt, n = [1, 2], 8
    llm = LLM(model=str(tiny_dir), device="cpu", dtype="float32", skip_tokenizer_init=True)
    a, b = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, seed=seed,
                                                  ignore_eos=True))[0].outputs[0].token_ids
            for seed in (1, 2))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        full = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n)[0].tolist()
        logits = ref(torch.tensor([full])).logits[0, len(prompt) - 1 : -1]  # [n, vocab]
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # float32 logits agree to about 1e-4
    assert a == b == full[len(prompt):]


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

    penalized = penalized_logits(logits[4], params[4], [0], history[4])
    for seed in range(0, 50, 10):
        batch = sample_tokens(logits, rows(seed))
        alone = [sample_tokens(logits[i : i + 1], rows(seed)[i : i + 1])[0] for i in range(6)]
        assert batch == alone
        assert batch[0] == int(logits[0].argmax())
        assert batch[4] == int(penalized.argmax()) != int(logits[4].argmax())
        for i in (1, 2, 3, 5):  # each sampled token is possible under the oracle's law
            assert sampling_probs(logits[i], params[i], [0], history[i])[batch[i]] > 0


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
