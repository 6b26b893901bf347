"""Issue 65: under one acceptance oracle, the adaptive policy's speculative steps accept what the
fixed policy's do, for a DFlash chain and a DDTree, on the CPU.

The adaptive policy here is the real `AdaptivePolicy`, made to switch every step or two: its
acceptance average spans the last speculative step only, one timed step of each kind gives a
verdict, a back-off is one plain step and a re-time comes every 2 speculative steps, on a clock
where a speculative step costs `tau` plain ones. So it goes plain right after a speculative step
that committed fewer than `tau` tokens (a back-off, as the real one does after poor steps) and
also after good ones (re-times): more than a third of its speculative steps follow a plain one.
Those are where a bias that favours adaptive rows would show: a position re-drawn after a plain
step, a draft rewritten twice or with a stale draw, drafts queued ahead (`draft_ahead`, which a
fixed run uses on nearly every step and an adaptive one after no plain step) ranking the wrong
positions, plain steps stepping over positions whose draws were rejected.

Tokens per speculative step (blocks that max_tokens does not cut short) of the two policies must
agree within 2 standard errors of their difference, each mean's error from its own steps'
spread (the oracle draws each step's slots afresh: steps are independent); the chain's also with
its analytic value 1 + sum_{i<B} p^i, within 2 standard errors from the chain's exact variance.
The seeds are fixed, so the check is deterministic; at 2 standard errors about 1 seed in 20 of
an unbiased engine would fail it. Planting a second chance for the draws of a block drafted
after a plain step, for its first slot only, fails both tests (3.5 and 2.9 standard errors)."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from flashtree import LLM, SamplingParams
from flashtree.bench.oracle import AcceptanceOracle, plain_references
from flashtree.speculative import policy as policy_module
from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy, StepResult

# Prompts over the small pair's 5-token vocabulary, run one after another (concurrency 1, as the
# benchmark's c1 rows run).
PROMPTS = [[0, 1, 2], [3, 4], [1, 1, 0, 2], [4, 3, 2, 1], [2], [0, 0, 1], [3, 1], [2, 4, 4],
           [1, 3], [4, 0, 2], [0, 2, 2, 3], [3, 0]]
BLOCK = 8  # the small pair's drafter
MAX_TOKENS = 200


class _Recorded:
    """A policy whose decode steps are remembered (speculated or not); `clock`, if given, is
    the step time the policy is told instead of the measured one."""

    def __init__(self, policy, clock=None) -> None:
        self.policy, self.clock = policy, clock
        self.budget = policy.budgets[0] if isinstance(policy, AdaptivePolicy) else policy.budget
        self.speculated: list[bool] = []

    def plan(self, requests: int) -> int:
        return self.policy.plan(requests)

    def observe(self, result: StepResult) -> None:
        self.speculated.append(result.speculative)
        if self.clock is not None:
            result = replace(result, seconds=self.clock(result))
        self.policy.observe(result)

    def decisions(self):
        return self.policy.decisions()


@pytest.fixture
def switching_adaptive(monkeypatch):
    """Makes real AdaptivePolicy objects that switch every step or two (module docstring);
    `tau`: a speculative step's time in plain steps."""
    for name, value in (("_ACCEPT_WINDOW", 1), ("_MIN_TIMED", 1), ("_PROBE_SHARE", 1.0),
                        ("_MAX_BACKOFF", 1), ("_RETIME_EVERY", 2)):
        monkeypatch.setattr(policy_module, name, value)

    def make(budget: int, tau: float) -> _Recorded:
        return _Recorded(AdaptivePolicy(budget), clock=lambda r: tau if r.speculative else 1.0)
    return make


def _llm(pair, spec: str) -> LLM:
    target, drafter = map(str, pair)
    return LLM(model=target, draft=drafter, spec=spec, spec_policy="fixed", device="cpu",
               skip_tokenizer_init=True, max_num_seqs=1)


def _speculative_lengths(llm: LLM, references, policy: _Recorded) -> tuple[list[int], int]:
    """Tokens committed by each speculative step whose block max_tokens does not cut short,
    over PROMPTS one after another under `policy`, and how many of those steps came right
    after a plain step. Checks every output equal to plain decoding and each decode step's
    accounting."""
    llm.engine.policy = policy
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lengths, after_plain = [], 0
    for prompt in PROMPTS:
        before = len(policy.speculated)
        out = llm.generate([prompt], params)[0].outputs[0]
        assert list(prompt) + list(out.token_ids) == references[tuple(prompt)]
        kinds, accepts = policy.speculated[before:], out.spec_accept_lengths
        # One accept length per decode step, a plain step's 1, together every output token
        # but the prefill's: tokens are counted at the step that committed them.
        assert len(kinds) == len(accepts) and sum(accepts) == len(out.token_ids) - 1
        assert all(n == 1 for n, spec in zip(accepts, kinds) if not spec)
        done = 1  # output tokens before the step (the prefill's)
        for i, (n, spec) in enumerate(zip(accepts, kinds)):
            if spec and done + BLOCK <= MAX_TOKENS:
                lengths.append(n)
                after_plain += i > 0 and not kinds[i - 1]
            done += n
    return lengths, after_plain


def _error(lengths: list[int]) -> float:
    """The standard error of the mean of `lengths`."""
    return statistics.stdev(lengths) / math.sqrt(len(lengths))


def _fixed_and_adaptive(llm: LLM, references, adaptive: _Recorded
                        ) -> tuple[list[int], list[int]]:
    """Tokens per speculative step under the fixed policy, then under `adaptive` (the same
    oracle, its draws going on)."""
    fixed, _ = _speculative_lengths(llm, references, _Recorded(FixedPolicy(adaptive.budget)))
    switching, after_plain = _speculative_lengths(llm, references, adaptive)
    assert after_plain > max(100, len(switching) / 3), (after_plain, len(switching))
    return fixed, switching


def _assert_agree(fixed: list[int], adaptive: list[int]) -> None:
    error = math.hypot(_error(fixed), _error(adaptive))
    difference = statistics.mean(adaptive) - statistics.mean(fixed)
    assert abs(difference) < 2 * error, (statistics.mean(adaptive), statistics.mean(fixed),
                                         error)


def test_adaptive_chain_accepts_what_fixed_does_and_the_analytic_value(small_pair,
                                                                       switching_adaptive):
    p = 0.8
    llm = _llm(small_pair, "dflash")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    AcceptanceOracle(llm, references, p, seed=11)
    accept = [p**i for i in range(BLOCK)]  # P(length >= i + 1)
    expected = sum(accept)
    fixed, adaptive = _fixed_and_adaptive(llm, references,
                                          switching_adaptive(BLOCK - 1, tau=expected))
    _assert_agree(fixed, adaptive)
    variance = sum((2 * i + 1) * a for i, a in enumerate(accept)) - expected**2
    mean = statistics.mean(adaptive)
    assert abs(mean - expected) < 2 * math.sqrt(variance / len(adaptive)), (mean, expected)


def test_adaptive_tree_accepts_what_fixed_does(small_pair, switching_adaptive):
    llm = _llm(small_pair, "ddtree")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    references = plain_references(llm, PROMPTS, params)
    AcceptanceOracle(llm, references, 0.5, q=0.9, seed=12)
    # About 2.8 tokens per step here: a back-off after steps of 1 or 2.
    fixed, adaptive = _fixed_and_adaptive(llm, references,
                                          switching_adaptive(llm.engine.policy.budget, tau=3.0))
    _assert_agree(fixed, adaptive)
