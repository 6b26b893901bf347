"""The acceptance oracle: it ranks the target's next token where asked and leaves every other
logit alone; with it a DFlash chain accepts 1 + sum_{i<B} p^i tokens per step (the analytic
value, within sampling error), also when plain steps come between speculative ones as the
adaptive policy puts them, and speculative outputs still equal plain decoding."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.oracle import (
    AcceptanceOracle,
    expected_tree_acceptance,
    plain_references,
    rank_targets,
    tree_acceptance,
)

PROMPTS = [[0, 1, 2], [3, 4], [1, 1, 0, 2], [4, 3, 2, 1], [2], [0, 0, 1], [3, 1], [2, 4, 4]]
BLOCK = 8


def test_targets_take_the_asked_rank_and_nothing_else_moves():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    targets = torch.tensor([3, 7, 0, -1, 11])
    ranks = torch.tensor([1, 2, 0, 1, 2])
    rank_targets(logits, targets, ranks)
    order = logits.argsort(dim=1, descending=True)
    assert order[0, 0] == 3 and order[1, 1] == 7 and order[2, -1] == 0 and order[4, 1] == 11
    assert torch.equal(logits[3], before[3])  # no target: untouched
    changed = torch.zeros_like(logits, dtype=torch.bool)
    changed[[0, 1, 2, 4], [3, 7, 0, 11]] = True
    assert torch.equal(logits[~changed], before[~changed])


def _brute_force_acceptance(logits: torch.Tensor, targets: list[int], budget: int) -> int:
    """The `budget` most probable prefixes (sum of log-probabilities, ties to the shallower),
    enumerated; 1 + the depth of the longest target prefix among them."""
    logp = logits.double().log_softmax(-1)  # [L, V]
    slots, vocab = logp.shape
    prefixes = [()]
    for _ in range(slots):
        prefixes += [p + (t,) for p in prefixes if len(p) == len(prefixes[-1]) for t in
                     range(vocab)]
    scored = sorted(prefixes[1:], key=lambda p: (-sum(logp[d, t].item()
                                                       for d, t in enumerate(p)), len(p)))
    chosen = set(scored[:budget])
    return 1 + max(d for d in range(slots + 1) if d == 0 or tuple(targets[:d]) in chosen)


@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_tree_acceptance_matches_brute_force(budget):
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(40, 3, 4, generator=gen) * 2  # 40 trials, 3 slots, vocab 4
    targets = torch.randint(0, 4, (40, 3), generator=gen)
    got = tree_acceptance(logits, targets, budget).tolist()
    want = [_brute_force_acceptance(logits[i], targets[i].tolist(), budget) for i in range(40)]
    assert got == want


def test_expected_tree_acceptance_spans_its_limits():
    gen = torch.Generator().manual_seed(0)
    confident = torch.randn(7, 50, generator=gen) * 20  # 7 slots: a block of 8
    assert expected_tree_acceptance(confident, 1.0, 0.0, 60, 64, gen) == 8.0  # the spine
    assert expected_tree_acceptance(confident, 0.0, 0.0, 30, 64, gen) == 1.0  # never drafted
    top1 = expected_tree_acceptance(confident, 0.6, 0.0, 30, 2000, gen)
    both = expected_tree_acceptance(confident, 0.6, 0.9, 30, 2000, gen)
    assert both > top1 + 0.3


def _llm(pair, spec: str) -> LLM:
    target, drafter = map(str, pair)
    return LLM(model=target, draft=drafter, spec=spec, spec_policy="fixed", device="cpu",
               skip_tokenizer_init=True, max_num_seqs=8)


@pytest.mark.parametrize("p", [0.5, 0.8])
def test_chain_acceptance_is_the_analytic_value_and_tokens_equal_plain(small_pair, p):
    llm = _llm(small_pair, "dflash")
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    AcceptanceOracle(llm, references, p, seed=1)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert list(prompt) + list(out.outputs[0].token_ids) == references[tuple(prompt)]
    # Steps away from the end, where the block is not cut short by max_tokens.
    lengths = [n for o in outs for n in o.outputs[0].spec_accept_lengths[:-4]]
    mean = sum(lengths) / len(lengths)
    accept = [p**i for i in range(BLOCK)]  # P(length >= i + 1)
    expected = sum(accept)
    variance = sum((2 * i + 1) * a for i, a in enumerate(accept)) - expected**2
    assert abs(mean - expected) < 4 * math.sqrt(variance / len(lengths)), (mean, expected)


class _Switching:
    """Speculates or decodes plainly at seeded random, so that the engine switches between
    them far more often than the adaptive policy does (whose choice is only that: the budget
    or 0); remembers what each decode step ran."""

    def __init__(self, budget: int, plain_share: float, seed: int) -> None:
        self.budget, self.plain_share, self.rng = budget, plain_share, random.Random(seed)
        self.speculated: list[bool] = []

    def plan(self, requests: int) -> int:
        return 0 if self.rng.random() < self.plain_share else self.budget

    def observe(self, result) -> None:
        self.speculated.append(result.speculative)


def _speculative_lengths(llm: LLM, params: SamplingParams, references, policy=None
                         ) -> list[int]:
    """Tokens committed by each speculative step over PROMPTS run one after another (one
    request a step, so each decode step is one entry of its request's accept lengths),
    checked equal to plain decoding; a request's last 4 steps left out (max_tokens cuts
    their blocks short)."""
    lengths = []
    for prompt in PROMPTS:
        before = len(policy.speculated) if policy else 0
        out = llm.generate([prompt], params)[0].outputs[0]
        assert list(prompt) + list(out.token_ids) == references[tuple(prompt)]
        kinds = policy.speculated[before:] if policy else [True] * len(out.spec_accept_lengths)
        assert len(kinds) == len(out.spec_accept_lengths)
        lengths += [n for n, spec in list(zip(out.spec_accept_lengths, kinds))[:-4] if spec]
    return lengths


def test_plain_steps_between_speculative_ones_leave_chain_acceptance_unbiased(small_pair):
    p = 0.8
    llm = _llm(small_pair, "dflash")
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    AcceptanceOracle(llm, references, p, seed=3)
    policy = llm.engine.policy = _Switching(BLOCK - 1, plain_share=0.4, seed=4)
    lengths = _speculative_lengths(llm, params, references, policy)
    switches = sum(a != b for a, b in zip(policy.speculated, policy.speculated[1:]))
    assert switches > 100 and len(lengths) > 100, (switches, len(lengths))
    accept = [p**i for i in range(BLOCK)]
    expected = sum(accept)
    variance = sum((2 * i + 1) * a for i, a in enumerate(accept)) - expected**2
    assert abs(statistics.mean(lengths) - expected) < 4 * math.sqrt(variance / len(lengths))


def test_plain_steps_between_speculative_ones_leave_tree_acceptance_unbiased(small_pair):
    llm = _llm(small_pair, "ddtree")
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    AcceptanceOracle(llm, references, 0.5, q=0.9, seed=5)
    fixed = _speculative_lengths(llm, params, references)
    policy = llm.engine.policy = _Switching(llm.engine.policy.budget, plain_share=0.4, seed=6)
    switching = _speculative_lengths(llm, params, references, policy)
    assert len(switching) > 100
    error = math.hypot(*(statistics.stdev(x) / math.sqrt(len(x)) for x in (fixed, switching)))
    assert abs(statistics.mean(switching) - statistics.mean(fixed)) < 4 * error


def test_ddtree_with_second_choices_accepts_more_and_tokens_equal_plain(small_pair):
    llm = _llm(small_pair, "ddtree")
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    oracle = AcceptanceOracle(llm, references, 0.5, q=0.0, seed=2)
    top1 = llm.generate(PROMPTS, params)
    oracle.q = 0.9
    both = llm.generate(PROMPTS, params)
    for prompt, a, b in zip(PROMPTS, top1, both):
        assert list(prompt) + list(a.outputs[0].token_ids) == references[tuple(prompt)]
        assert list(prompt) + list(b.outputs[0].token_ids) == references[tuple(prompt)]

    def mean(outs):
        lengths = [n for o in outs for n in o.outputs[0].spec_accept_lengths]
        return sum(lengths) / len(lengths)
    assert mean(both) > mean(top1) + 0.3


def test_bench_oracle_rows_report_rates_acceptance_and_equality(tiny_chat_model, tmp_path):
    model, drafter = tiny_chat_model
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "bench", "--model", str(model), "--draft",
         str(drafter), "--spec", "none,dflash:fixed", "--oracle", "0.9", "--dataset", "random",
         "--random-input-len", "6", "--num-prompts", "4", "--max-tokens", "40",
         "--concurrency", "1,3", "--device", "cpu", "--no-progress", "--output-dir",
         str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    spec_rows = [r for r in rows if r["spec"] == "dflash:fixed"]
    assert len(spec_rows) == 2
    for row in spec_rows:
        assert row["equal_to_plain"] == 1.0 and row["oracle_p"] == 0.9
        assert row["accept_length"] > 2.5  # a random drafter alone accepts about 1
    assert all("equal_to_plain" not in r for r in rows if r["spec"] == "none")
    assert "acceptance oracle p=0.9" in (tmp_path / "report.md").read_text()


def test_bench_oracle_refuses_sampling(tiny_chat_model, tmp_path):
    model, drafter = tiny_chat_model
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "bench", "--model", str(model), "--draft",
         str(drafter), "--spec", "dflash", "--oracle", "0.9", "--temperature", "0.7",
         "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--oracle needs --temperature 0" in run.stderr


def test_a_top1_target_holds_at_least_the_confidence():
    logits = torch.zeros(3, 50)  # flat rows: +1 over the rest would hold only e / (e + 49)
    targets, ranks = torch.tensor([4, 5, 6]), torch.tensor([1, 1, 2])
    rank_targets(logits, targets, ranks, confidence=0.86)
    probs = logits.softmax(-1)
    assert probs[0, 4] == pytest.approx(0.86, abs=1e-4) and probs[1, 5] == pytest.approx(0.86,
                                                                                     abs=1e-4)
    assert probs[2, 6] < 0.05  # a second choice keeps the drafter's own scale
