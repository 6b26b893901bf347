"""The adaptive speculation policy: budget choice on synthetic cost and acceptance curves, the
expected-acceptance model against brute-force enumeration of draft trees, the cost profile, and
the engine running it (lossless, with budgets that really vary and plain steps in between)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.engine import candidates
from flashtree.engine.llm_engine import LLMEngine
from flashtree.graphs.rows import RowGraphs
from flashtree.spec.budgets import CostModel, budget_levels, choose_budgets
from flashtree.spec.cost import load_profile, lower_envelope, save_profile
from flashtree.spec.policy import (
    _COLD_PLAIN_STEPS,
    _MARGIN,
    _MAX_BACKOFF,
    _MIN_BACKOFF,
    _PLAIN_PROBE,
    _PLAIN_PROBE_DOUBLINGS,
    _PROBE_PRIOR_STEPS,
    _PROBE_STEPS,
    _RECENT_RATE,
    _TRUSTED_PLAIN,
    _WARM_STEPS,
    _WIDE_GAIN,
    RecentSpeculation,
    SpecPolicy,
    _plain_scale,
    _spec_scale,
)
from flashtree.spec.simulate import (
    GPU_LIKE,
    GPU_LIKE_PLAIN_S,
    SyntheticMachine,
    chain_gains,
    fixed_policy,
    run_steps,
)
from flashtree.spec.tree import best_first_levels, best_path_logprobs, build_trees, topk_logprobs
from tests.helpers import ran_mixed_steps, record_schedules
from tests.tiny import TINY_PROMPTS

LEVELS = budget_levels(15)  # (0, 1, 2, 4, 8, 15)


def _cost(per_token: float, base: float = 1.0, draft: float = 0.1) -> CostModel:
    return CostModel(((1, base), (4096, base + 4095 * per_token)), ((1, draft), (64, draft)))


def _chain_gains(accept: float) -> list[float]:
    return chain_gains(accept, LEVELS)


def test_budget_levels_are_a_fixed_ladder_ending_at_the_maximum():
    assert budget_levels(15) == (0, 1, 2, 4, 8, 15)
    assert budget_levels(16) == (0, 1, 2, 4, 8, 16)
    assert budget_levels(1) == (0, 1)


def _speculated(policy: SpecPolicy, requests: int, verified: float, accepted: float,
                time_factor: float = 1.0, steps: int = 5) -> None:
    """`steps` speculative steps of `requests` (after plain ones), each verifying and accepting
    `verified` and `accepted` drafts per request, timed at `time_factor` x their profile; and
    a plain step timed at its profile before them."""
    policy.observe_step(False, requests, policy.cost.target_s(requests))
    for _ in range(steps):
        policy.observe_speculation(requests, verified * requests, accepted * requests)
        policy.predicted_s = (policy.cost.draft_s(requests)
                              + policy.cost.target_s(round(requests * (1 + verified))))
        policy.observe_step(True, requests, time_factor * policy.predicted_s)


def _should_draft_timing_plain(policy: SpecPolicy, requests: int) -> bool:
    """policy.should_draft, a plain step then timed at its profile (as the engine times it:
    a back-off's last steps re-time plain decoding before its probe)."""
    if policy.should_draft(requests):
        return True
    policy.observe_step(False, requests, policy.cost.target_s(requests))
    return False


def test_expensive_verify_and_low_acceptance_choose_plain_decoding():
    """Budget 0 for every request, undrafted, once speculative steps have been measured:
    verifying costs more than the few accepted drafts give. Were the step drafted, the choice
    would take the one upgrade worth most."""
    policy = SpecPolicy(_cost(per_token=0.5), LEVELS)
    _speculated(policy, requests=8, verified=2.0, accepted=0.1)
    assert not policy.should_draft(8)
    picks, _ = choose_budgets([_chain_gains(0.1)] * 8, LEVELS, _cost(per_token=0.5), 0.1)
    assert sorted(picks) == [0] * 7 + [1]


def test_flat_verify_and_high_acceptance_choose_the_largest_budget():
    policy = SpecPolicy(_cost(per_token=1e-6), LEVELS)
    _speculated(policy, requests=8, verified=15.0, accepted=8.0)
    assert policy.should_draft(8)
    assert policy.choose(list(range(8)), [_chain_gains(0.95)] * 8) == [15] * 8


def test_budgets_follow_each_request_and_match_exhaustive_search():
    """Two requests with different acceptance under a verify cost that grows: the greedy choice
    equals the best of all level pairs that verify a draft, and the better drafted request
    gets more."""
    gains = [_chain_gains(0.9), _chain_gains(0.4)]
    cost, draft_s = _cost(per_token=0.02), 0.1
    picks, value = choose_budgets(gains, LEVELS, cost, draft_s)

    def objective(js):
        tokens = 2 + sum(LEVELS[j] for j in js)
        return (2 + sum(g[j] for g, j in zip(gains, js))) / (draft_s + cost.target_s(tokens))

    best = max((js for js in itertools.product(range(len(LEVELS)), repeat=2) if any(js)),
               key=objective)
    assert value == pytest.approx(objective(best))
    assert picks[0] > picks[1]


def test_one_budget_per_step_is_the_best_shared_level():
    """Where CUDA graphs pad every request to the step's largest budget, the choice gives all
    requests one level: the best of the shared levels by the same objective (whatever one
    request alone would get)."""
    gains = [_chain_gains(0.9), _chain_gains(0.4), _chain_gains(0.7)]
    cost = _cost(per_token=0.02)
    policy = SpecPolicy(cost, LEVELS, timed=False, one_budget=True)
    picks = policy.choose([0, 1, 2], gains)

    def objective(j):
        n = len(gains)
        tokens = n * (1 + LEVELS[j])
        return (n + sum(g[j] for g in gains)) / (cost.draft_s(n) + cost.target_s(tokens))

    assert len(set(picks)) == 1
    assert picks[0] == LEVELS[max(range(1, len(LEVELS)), key=objective)]
    assert set(choose_budgets(gains, LEVELS, cost, cost.draft_s(3))[0]) != {LEVELS.index(picks[0])}


def test_a_verdict_against_speculation_backs_off_doubling_between_probes():
    """Where measured steps say drafting does not pay, the step runs plain and a back-off of
    plain steps follows (9, 18, ...), doubling up to 1024 while verdicts keep coming, each
    followed by a probe of _PROBE_STEPS speculative steps (whatever the forecast says: their
    times are what the next verdict is judged by); once speculation pays, the back-off is
    over."""
    policy = SpecPolicy(_cost(per_token=1e-3, draft=0.05), LEVELS)
    _speculated(policy, requests=1, verified=4.0, accepted=0.02)  # a probe costs 1.2 plain steps
    runs = _runs(_decode(policy, 1, 4400, plain_factor=1.0, spec_factor=1.0))
    assert runs[0][0] is False
    assert [n for _, n in runs[0::2][:10]] == [min(_MIN_BACKOFF << k, _MAX_BACKOFF)
                                               for k in range(10)]
    assert set(runs[1::2][:9]) == {(True, _PROBE_STEPS)}
    policy.cost = _cost(per_token=1e-6, draft=0.0)  # drafting and verifying are free now
    while not _decode(policy, 1, 1, plain_factor=1.0, spec_factor=1.0)[0]:  # the back-off
        pass  # under way, then the probe
    assert all(_decode(policy, 1, _PROBE_STEPS + 10, plain_factor=1.0, spec_factor=1.0))
    assert policy.at(1).backoff == 0


def test_probes_are_rare_where_a_speculative_step_costs_many_plain_ones():
    """A wide batch on a CPU: drafting 64 blocks and verifying 3 tokens per request costs ~14
    plain steps. The back-off is long enough that a probe's extra time is at most 1/32 of it,
    past _MAX_BACKOFF if need be."""
    policy = SpecPolicy(_cost(per_token=1.0, draft=700.0), LEVELS)
    _speculated(policy, requests=64, verified=2.0, accepted=0.1)
    ratio = policy.spec_s(64) / policy.plain_s(64)
    assert ratio == pytest.approx((700 + 192) / 64)
    plain = 0
    while not _should_draft_timing_plain(policy, 64):
        plain += 1
    assert plain > _MAX_BACKOFF
    assert _PROBE_STEPS * (ratio - 1) <= plain / 32 < _PROBE_STEPS * (ratio - 1) + 1 / 32


def test_a_back_off_is_weighed_by_the_last_probe_s_whole_time():
    """At 16 requests speculation loses; a probe's first step also catches the drafter up on
    the context of the plain steps before it, at 30 plain steps' time. The back-off after
    that probe is long enough that its extra time, catch-up included, is 1/32 of it (where
    its speculative steps alone would allow one 6x shorter)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=16, gain=0.9)
    _plain_steps_at(policy, 16, 1.0)
    policy.back_off(16)
    plain = policy.cost.target_s(16)
    spec = policy.cost.draft_s(16) + policy.cost.target_s(16 * 9)
    probe_steps = 0
    while probe_steps < _PROBE_STEPS:
        drafted = policy.should_draft(16)
        catch_up = 30 * plain if drafted and probe_steps == 0 else 0.0
        probe_steps += drafted
        policy.predicted_s = spec
        policy.observe_step(drafted, 16, spec + catch_up if drafted else plain)
    assert not policy.should_draft(16)  # the verdict after the probe: a back-off
    steps_alone = _PROBE_STEPS * (spec / plain - 1)
    assert policy.at(16).probe_extra == pytest.approx(30 + steps_alone)
    assert policy.at(16).backoff == math.ceil(32 * (30 + steps_alone))
    assert policy.at(16).backoff > 6 * 32 * steps_alone


def test_a_probe_step_run_plain_for_want_of_pages_is_still_to_come():
    """The engine runs a step the policy allowed plain when the pages its draft would write
    are not free (`draft_refused`). Where that step was a probe's last, the probe still runs
    its last speculative step after it, and its cost is measured from its speculative steps
    alone (counted as the probe's, the plain step had added no time and ended the probe
    unmeasured, and the verdict came a step early)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=16, gain=0.9)
    _plain_steps_at(policy, 16, 1.0)
    policy.back_off(16)
    policy.at(16).plain_steps_left = 0  # the probe is next
    plain = policy.cost.target_s(16)
    spec = policy.cost.draft_s(16) + policy.cost.target_s(16 * 9)
    for refused in [False] * (_PROBE_STEPS - 1) + [True, False]:
        assert policy.should_draft(16) and policy.probing
        if refused:
            policy.draft_refused(16)
            assert not policy.probing and policy.at(16).probe_steps_left == 1
        policy.predicted_s = spec
        policy.observe_step(not refused, 16, plain if refused else spec)
    assert policy.at(16).probe_extra == pytest.approx(_PROBE_STEPS * (spec / plain - 1))
    assert not policy.should_draft(16)  # the verdict after the probe: a back-off


def test_the_engine_tells_the_policy_of_an_allowed_draft_it_runs_plain(small_pair, tmp_path,
                                                                        monkeypatch):
    """Where the pages a draft writes are not free, a step the policy allowed runs plain,
    and the engine says so (`draft_refused`), once per such step."""
    engine, policy = _probing_engine(small_pair, tmp_path, monkeypatch)
    refused: list[int] = []
    monkeypatch.setattr(policy, "draft_refused", refused.append)
    monkeypatch.setattr(engine, "_reserve_lookahead", lambda chunks: False)
    seq = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                        ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seq.spec_accept_lengths == [1] * 4 and refused == [1] * 4  # the first: a prompt step
    assert engine.speculative.stats.budgets == {0: 4}


def test_a_probe_cut_short_by_another_batch_size_is_not_timed():
    """A probe at 16 runs one step, then the batch shrinks to 8 and 8's probe runs whole;
    back at 16, the rest of 16's probe would pay a second catch-up, so it is not timed (16's
    probe cost stays as it was), while 8's is."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    for requests in (16, 8):
        _forecast_gain(policy, requests=requests, gain=0.9)
        _plain_steps_at(policy, requests, 1.0)
        policy.back_off(requests)
        policy.at(requests).plain_steps_left = 0  # the probe is next

    def step(requests: int) -> bool:
        drafted = policy.should_draft(requests)
        spec = policy.cost.draft_s(requests) + policy.cost.target_s(requests * 9)
        policy.predicted_s = spec
        policy.observe_step(drafted, requests, 5 * spec if drafted else spec)
        return drafted

    assert step(16) and policy.probing
    assert all(step(8) for _ in range(_PROBE_STEPS))
    assert all(step(16) for _ in range(_PROBE_STEPS - 1))
    assert policy.at(8).probe_extra > 0 and policy.at(16).probe_extra == 0.0


def test_speculation_that_pays_is_found_after_a_cold_start():
    """Speculative steps at 1.9x their profile (2.9 ms for a 15-node tree) commit 2.4 tokens
    against plain steps' one per 1.37 ms: speculation pays. The first three speculative steps
    run 3x slower (first calls: compiles, allocations), and the one of them that is timed
    judges speculation not to pay; the probe after the back-off brings it back."""
    policy = SpecPolicy(GPU_LIKE, LEVELS)
    budgets, _ = run_steps(policy, SyntheticMachine(GPU_LIKE_PLAIN_S, 1.9, cold_steps=3), 3000)
    late = budgets[-1000:]
    assert sum(b > 0 for b in late) >= 950, "speculation pays but the policy stays plain"


@pytest.mark.parametrize("seed", range(8))
def test_speculation_that_pays_a_tenth_is_kept_whatever_the_draws(seed):
    """Speculative steps 9% faster per committed token than plain ones: a run of low draws
    early on (accepted drafts vary from 0 to 7 a step) must not hold speculation off for the
    rest of the run, as back-offs leave few steps to correct the average."""
    policy = SpecPolicy(GPU_LIKE, LEVELS)
    budgets, _ = run_steps(policy, SyntheticMachine(GPU_LIKE_PLAIN_S, 1.9), 3000, seed)
    assert sum(b > 0 for b in budgets[-1000:]) >= 950


def test_speculation_that_pays_a_tenth_is_kept_through_jittery_step_times():
    """As above, with every step's time jittered (10%, and one step in 50 3-10x slower): the
    forecast is re-tested every step, so its step-time estimates must not let noise cross the
    threshold often, each crossing costing a back-off of a hundred plain steps or more."""
    plain_shares, machine = [], SyntheticMachine(GPU_LIKE_PLAIN_S, 1.9, jitter=0.1)
    for seed in range(8):
        budgets, _ = run_steps(SpecPolicy(GPU_LIKE, LEVELS), machine, 3000, seed)
        plain_shares.append(sum(b == 0 for b in budgets[-2000:]) / 2000)
    assert sum(plain_shares) / len(plain_shares) <= 0.1, plain_shares


def test_speculation_resumes_once_a_stretch_the_drafter_drafts_badly_ends():
    """Acceptance moves with the text: 300 steps at 0.3 (speculation loses), then 900 at 0.7
    (it pays ~30%), and again. The verdict taken in a bad stretch must not outlast it: a
    back-off's probe restarts the acceptance averages' weight (`RecentSpeculation.restart`),
    so the adaptive policy commits nearly as fast as the full tree every step does here
    (0.947 over these seeds, 0.977 while it timed the first plain step after speculative ones:
    each re-timing of plain decoding now runs one plain step more). With the averages kept
    whole, it ran plain on three steps of four and reached 0.87 of it (0.89 now)."""
    machine = SyntheticMachine(GPU_LIKE_PLAIN_S, 1.9, jitter=0.1, stretches=((300, 0.3),
                                                                              (900, 0.7)))
    ratios = [run_steps(SpecPolicy(GPU_LIKE, LEVELS), machine, 6000, seed)[1]
              / run_steps(fixed_policy(GPU_LIKE, LEVELS), machine, 6000, seed)[1]
              for seed in range(8)]
    assert sum(ratios) / len(ratios) >= 0.93, ratios


def test_a_restart_weighs_the_acceptance_so_far_as_a_few_steps():
    """After a restart the averages are a running mean again, the old value counting as
    _PROBE_PRIOR_STEPS steps: 64 steps at 1 then 64 at 3 average to exactly 2."""
    recent = RecentSpeculation()
    for _ in range(1000):
        recent.add(15.0, 1.0)
    recent.restart()
    assert recent.steps == _PROBE_PRIOR_STEPS
    for _ in range(_PROBE_PRIOR_STEPS):
        recent.add(15.0, 3.0)
    assert recent.accepted == pytest.approx(2.0, abs=1e-12)
    assert recent.optimistic_accepted() > recent.accepted  # the doubt granted has widened


def test_the_benefit_of_the_doubt_holds_for_acceptance_that_comes_in_runs():
    """A drafter's acceptance holds for a while (the same requests and text): here each value
    (0 to 3, mean 1.5) holds for 4 steps. The optimistic bound of an engine's first 64 such
    steps must lie below the true mean about as rarely as 1.5 standard errors of 16
    independent values do (7-10%); counting the 64 steps as independent, it did in a quarter
    of the runs."""
    rng, runs = random.Random(0), 2000
    below = 0
    for _ in range(runs):
        recent = RecentSpeculation()
        for _ in range(16):
            accepted = rng.choice((0.0, 1.0, 2.0, 3.0))
            for _ in range(4):
                recent.add(15.0, accepted)
        below += recent.optimistic_accepted() < 1.5
    assert below / runs <= 0.12, below / runs


def test_a_back_off_s_probe_restarts_the_acceptance_averages():
    """Not a recheck or the back-off's plain steps: the probe's first step, which is the
    first to measure acceptance since the verdict."""
    policy = SpecPolicy(_cost(per_token=1e-3, draft=0.05), LEVELS)
    _speculated(policy, requests=1, verified=4.0, accepted=0.02)
    for _ in range(500):
        policy.observe_speculation(1, 4.0, 0.02)
    while not _should_draft_timing_plain(policy, 1):  # a verdict against, its back-off
        assert policy.recent.steps > _PROBE_PRIOR_STEPS
    assert policy.probing and policy.recent.steps == _PROBE_PRIOR_STEPS


def test_speculation_that_does_not_pay_costs_few_steps():
    """Speculative steps at 4x their profile (6 ms) commit 2.4 tokens against one per
    1.37 ms for plain steps: probes, ever rarer, are the only speculative steps."""
    policy = SpecPolicy(GPU_LIKE, LEVELS)
    budgets, _ = run_steps(policy, SyntheticMachine(GPU_LIKE_PLAIN_S, 4.0), 3000)
    assert sum(b > 0 for b in budgets) <= 0.02 * len(budgets)
    assert sum(b > 0 for b in budgets[-1000:]) <= _PROBE_STEPS


def test_calibration_scales_predictions_by_observed_acceptance():
    policy = SpecPolicy(_cost(per_token=1e-6), LEVELS)
    assert policy.scale(7) == pytest.approx(1.0)
    for _ in range(30):
        policy.observe(7, accepted=1, predicted=4.0)  # the drafter claims 4x too much
    assert policy.scale(7) == pytest.approx(0.25, rel=0.05)
    assert policy.scale(8) == pytest.approx(0.25, rel=0.05)  # a new request: the batch's ratio
    policy.forget({8})
    assert 7 not in policy.requests


def test_expected_acceptance_equals_brute_force_tree_sums():
    """best_path_logprobs' first b entries are the nodes of the budget-b tree: their path
    probabilities equal an exhaustive enumeration of all prefixes (V^1..V^L), best first."""
    torch.manual_seed(3)
    vocab, depth, budget = 5, 3, 12
    logits = torch.randn(2, depth, vocab) * 2
    lp = torch.log_softmax(logits.double(), dim=-1)
    got = best_path_logprobs(best_first_levels(topk_logprobs(logits, vocab)[0], budget), budget)
    for r in range(2):
        paths = [sum(lp[r, d, t] for d, t in enumerate(p)).item()
                 for n in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=n)]
        want = sorted(paths, reverse=True)[:budget]
        assert got[r].tolist() == pytest.approx(want, abs=1e-6)
        tree = build_trees(logits[r : r + 1], torch.tensor([0]), 5)
        node_lp = [sum(lp[r, d, tree.tokens[0, a].item()]
                       for d, a in _path(tree.parent[0].tolist(), tree.depth[0].tolist(), v))
                   for v in range(1, 6)]
        assert math.fsum(math.exp(x) for x in node_lp) == pytest.approx(
            got[r, :5].exp().sum().item(), abs=1e-7)  # the depth tie-break: 1e-9


def _path(parent: list[int], depth: list[int], v: int):
    """(depth index, node) pairs from the root's child down to v."""
    nodes = []
    while v:
        nodes.append((depth[v] - 1, v))
        v = parent[v]
    return reversed(nodes)


def test_profile_cache_round_trip_and_key_check(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    cost = _cost(per_token=0.01)
    key = {"target": "x", "device": "cpu"}
    assert load_profile(key) is None
    save_profile(key, cost)
    assert load_profile(key) == cost
    assert load_profile({**key, "device": "other"}) is None


def test_a_noisy_profile_point_is_lowered_to_the_larger_sizes_fastest():
    rng = random.Random(3)
    for _ in range(200):
        sizes = sorted(rng.sample(range(1, 5000), rng.randint(1, 12)))
        points = [(n, rng.uniform(0.5, 2.0)) for n in sizes]
        lowered = lower_envelope(points)
        assert [n for n, _ in lowered] == sizes
        for i, (_, seconds) in enumerate(lowered):  # brute force: the fastest from here on
            assert seconds == min(s for _, s in points[i:])
    # A bump at 32 tokens (T(32) > T(64)) would price budgets 16-31 above 32-63 ones.
    assert lower_envelope([(16, 1.5), (32, 1.745), (64, 1.536)]) == (
        (16, 1.5), (32, 1.536), (64, 1.536))


PROMPTS = TINY_PROMPTS


def _plain_tokens_and_adaptive_engine(small_pair, spec: str, max_tokens: int
                                      ) -> tuple[list[list[int]], SamplingParams, LLM]:
    """Plain decoding's greedy tokens of PROMPTS (`max_tokens` each, on the CPU), their
    sampling parameters, and an adaptive `spec` engine over the same target and drafter."""
    target, drafter = small_pair
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(device="cpu", skip_tokenizer_init=True, page_size=4)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(target), **common).generate(
        PROMPTS, sp)]
    return expected, sp, LLM(model=str(target), draft=str(drafter), spec=spec, **common)


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_adaptive_engine_is_lossless_with_varying_budgets_and_plain_steps(small_pair, spec,
                                                                          tmp_path,
                                                                          monkeypatch):
    """A cost model under which budgets differ by request and step (and some steps run plain)
    must still give exactly plain decoding's greedy tokens, and give every KV page back.
    Trees are chosen every step here (their budgets vary the more)."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(candidates, "_CHOICE_STEPS", 1)
    expected, sp, llm = _plain_tokens_and_adaptive_engine(small_pair, spec, max_tokens=60)
    policy = llm.engine.speculative.policy
    assert policy is not None and policy.levels == budget_levels(7)
    policy.cost = _cost(per_token=0.05, draft=0.2)  # verify grows: budgets must be chosen
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages
    budgets = llm.engine.speculative.stats.budgets
    assert len(budgets) >= 3, budgets  # several levels used, not one fixed budget
    assert sum(budgets.values()) == sum(len(o.outputs[0].spec_accept_lengths) for o in outs)


def test_tree_build_captured_at_start_covers_every_step(small_pair, tmp_path, monkeypatch):
    """On CUDA the DDTree build and the greedy walk replay graphs captured at start for every
    batch bucket and budget the policy can pick: no step may need a shape that was not
    captured (capturing it then would stall that step). Checked with the same padded static
    buffers on CPU, trees chosen every step (their budgets vary the more)."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(candidates, "_CHOICE_STEPS", 1)
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4, max_num_seqs=4)
    spec = llm.engine.speculative
    spec.policy.cost = _cost(per_token=0.05, draft=0.2)  # budgets differ by request and step
    cpu, buckets = torch.device("cpu"), [1, 2, 4]
    planner = spec.planner
    planner.tree_levels = RowGraphs(planner.tree_levels.fn, buckets, cpu, use_cuda_graphs=False)
    planner.tree_nodes = RowGraphs(planner.tree_nodes.fn, buckets, cpu, use_cuda_graphs=False)
    planner.capture_tree_graphs(buckets)
    captured = set(planner.tree_levels._entries), set(planner.tree_nodes._entries)
    assert len(captured[1]) == len(buckets) * (len(spec.policy.levels) - 1)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    walks = spec.tree_verifier.walks = RowGraphs(spec.tree_verifier.walks.fn, buckets, cpu,
                                                 use_cuda_graphs=False)
    spec.tree_verifier.capture([b + 1 for b in spec.policy.levels if b > 0])
    captured_walks = set(walks._entries)
    assert len(captured_walks) == len(buckets) * (len(spec.policy.levels) - 1)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert (set(planner.tree_levels._entries), set(planner.tree_nodes._entries)) == captured
    assert set(walks._entries) == captured_walks
    assert len(spec.stats.budgets) >= 3, spec.stats.budgets


@pytest.mark.parametrize("steady", [False, True])
def test_the_policy_holds_state_of_its_last_speculative_batch_alone(small_pair, tmp_path,
                                                                   monkeypatch, steady):
    """Requests end at different steps and waiting ones take their places: after every
    speculative step the policy holds calibrations, tree reach and paces of that step's
    requests alone, none of a request that left the batch (the engine has it forget them
    only on steps whose batch differs from the last speculative step's). Also where each
    step's outcome is taken in by the next one (`steady` steps), after the batch changed."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))

    def decide(policy, requests, remaining):
        policy.steady = steady
        return True

    monkeypatch.setattr(SpecPolicy, "should_draft", decide)
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4, max_num_seqs=2)
    spec, policy = llm.engine.speculative, llm.engine.speculative.policy
    seen: list[tuple[set[int], set[int]]] = []  # per speculative step: its batch, held state
    step = spec.step

    def recorded(seqs):
        verified = step(seqs)
        held = set(policy.requests) | set(policy.reach) | set(policy.drain.live)
        seen.append(({s.seq_id for s in seqs}, held))
        return verified

    spec.step = recorded
    schedules = record_schedules(llm.engine)
    lengths = (9, 30, 14, 5, 22, 11, 17, 7)
    prompts = (PROMPTS * 2)[: len(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params)
    plain = LLM(model=str(target), device="cpu", skip_tokenizer_init=True, page_size=4)
    # Lossless also where admissions ride on the batch's steps (mixed steps, run plain).
    assert ([o.outputs[0].token_ids for o in outs]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    assert ran_mixed_steps(schedules)
    assert len({frozenset(batch) for batch, _ in seen}) >= 4, seen  # the batch changed
    assert all(held <= batch for batch, held in seen), seen
    # What it holds is checked, not nothing. A steady step's outcome is taken in by the next
    # step: after a steady step the policy holds state of requests that were in the step
    # before too, none where the batch changed whole (which steps that is depends on the
    # budgets, chosen from a start-up profile timed on this machine).
    assert all(held for k, (batch, held) in enumerate(seen)
               if not steady or (k > 0 and batch & seen[k - 1][0])), seen


def test_policy_name_is_checked(small_pair):
    target, drafter = small_pair
    with pytest.raises(ValueError, match="spec_policy='greedy'.*adaptive"):
        LLM(model=str(target), draft=str(drafter), spec_policy="greedy", device="cpu",
            skip_tokenizer_init=True)


@pytest.mark.parametrize("spec, policy", [("dflash", "fixed"), ("ddtree", "fixed"),
                                          ("ddtree", "adaptive")])
def test_seeded_sampling_with_speculation_returns_plain_samples(small_pair, spec, policy,
                                                               tmp_path,
                                                               monkeypatch):
    """Each output position's token is drawn with the uniform of (seed, position), in plain
    decoding and at every tree node alike, so sample-and-match commits exactly the samples
    plain decoding draws, whatever budgets the policy picks (float32, same probabilities)."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    target, drafter = small_pair
    sp = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=s, ignore_eos=True)
          for s in range(len(PROMPTS))]
    common = dict(device="cpu", skip_tokenizer_init=True, page_size=4)
    plain = LLM(model=str(target), **common).generate(PROMPTS, sp)
    llm = LLM(model=str(target), draft=str(drafter), spec=spec, spec_policy=policy, **common)
    if policy == "adaptive":  # judged by a profile where speculation pays, not wall times
        llm.engine.speculative.policy.cost = _cost(per_token=0.005, draft=0.05)
        llm.engine.speculative.policy.timed = False
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert sum(llm.engine.speculative.stats.accepted_per_pos) > 0  # drafts were accepted


def _always_probe(policy: SpecPolicy, requests: int, remaining) -> bool:
    """A should_draft that makes every decode step a probe's (each commits one token)."""
    policy.probing = True
    return True


def _probing_engine(small_pair, tmp_path, monkeypatch) -> tuple[LLMEngine, SpecPolicy]:
    """An adaptive DDTree engine (CPU, pages of 4) whose every decode step is a probe's, and
    its policy."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(SpecPolicy, "should_draft", _always_probe)
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4)
    return llm.engine, llm.engine.speculative.policy


def test_probe_steps_measure_speculation_but_commit_as_plain_decoding(small_pair, tmp_path,
                                                                      monkeypatch):
    """Every step a probe's: trees are drafted and verified, and the policy learns how many
    drafts each step accepted, but a step commits one token per request, the one plain
    decoding commits (so that a probe does not move when requests finish)."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(SpecPolicy, "should_draft", _always_probe)
    target, drafter = small_pair
    common = dict(device="cpu", skip_tokenizer_init=True, page_size=4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(target), **common).generate(PROMPTS, sp)
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", **common)
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(set(o.outputs[0].spec_accept_lengths) == {1} for o in outs)
    recent = llm.engine.speculative.policy.recent
    assert recent.steps >= 20 and recent.accepted > 0.1


def test_measured_step_times_enter_the_forecast():
    """A speculative step that takes far longer than its profiled forwards (host work the
    profile does not see) makes plain decoding the better choice for the same acceptance; a
    plain step is measured before speculation and plain are compared."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _speculated(policy, requests=4, verified=8.0, accepted=2.0)
    assert policy.forecast_pays(4)
    for _ in range(8):
        policy.observe_step(True, 4, policy.predicted_s * 5)
    assert policy.at(4).spec_scale.factor == pytest.approx(5.0) and not policy.forecast_pays(4)
    fresh = SpecPolicy(policy.cost, LEVELS)
    for _ in range(3):  # the first two of a run are not counted
        fresh.observe_step(True, 4, policy.predicted_s)
    assert not fresh.should_draft(4)  # plain steps not measured yet: one is
    fresh.observe_step(False, 4, policy.cost.target_s(4))
    assert fresh.at(4).plain_scale.factor == pytest.approx(1.0)


def test_each_batch_size_is_judged_by_its_own_step_times():
    """Host work weighs differently in small and wide steps: speculative steps of 4 requests
    that take 2x their profile make plain decoding win at 4, while steps of 1 request, at
    their profile, keep speculating there; a batch size not measured yet borrows the nearest
    measured bucket's times (2 from 1's, 8 from 4's)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _speculated(policy, requests=1, verified=8.0, accepted=1.5)
    _speculated(policy, requests=4, verified=8.0, accepted=1.5, time_factor=2.0)
    assert policy.at(1).spec_scale.factor == pytest.approx(1.0)
    assert policy.forecast_pays(1) and not policy.forecast_pays(4)
    assert policy.forecast_pays(2) and not policy.forecast_pays(8)
    assert policy.should_draft(1) and not policy.should_draft(3)


def test_a_profile_taken_on_a_busy_machine_is_corrected_by_measured_steps():
    """The cached profile says plain steps take 3x what they take now, and speculative steps
    what they take: measured plain steps make plain decoding win again."""
    policy = SpecPolicy(_cost(per_token=1e-3, base=0.03, draft=0.01), LEVELS)
    _speculated(policy, requests=1, verified=8.0, accepted=1.0)
    assert policy.forecast_pays(1)
    for _ in range(8):
        policy.observe_step(False, 1, policy.cost.target_s(1) / 3)
    assert not policy.forecast_pays(1)


def test_forecast_skips_drafting_where_recent_steps_did_not_pay():
    """Once speculative steps have been timed, a batch size where verifying their budgets
    costs more than they commit runs plain without drafting (no costly probe): a back-off,
    and a probe after it; a small batch still drafts."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    for _ in range(_TRUSTED_PLAIN):  # a bucket's own plain steps come first
        assert not _should_draft_timing_plain(policy, 256)
    assert policy.should_draft(256)  # no speculative step measured yet: a probe
    _speculated(policy, requests=8, verified=4.0, accepted=1.0, time_factor=1.2)
    _plain_steps_at(policy, 1, 1.0)
    assert policy.forecast_pays(1) and not policy.forecast_pays(256)
    assert policy.should_draft(1)
    plain = 0
    while not _should_draft_timing_plain(policy, 256):
        plain += 1
    assert plain == policy.at(256).backoff >= _MIN_BACKOFF
    assert policy.at(256).probe_steps_left == _PROBE_STEPS - 1


def test_one_cold_step_does_not_hold_speculation_off():
    """Step times are a median of recent steps: a speculative step that took a second longer
    (a preempted process) stops counting once a few normal steps are measured."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _speculated(policy, requests=4, verified=8.0, accepted=2.0, steps=4)
    policy.observe_step(True, 4, policy.predicted_s + 1.0)
    assert policy.forecast_pays(4)  # the median of three
    policy.observe_step(True, 4, policy.predicted_s)
    assert policy.at(4).spec_scale.factor == pytest.approx(1.0)


def test_switching_steps_do_not_time_speculation():
    """The first _WARM_STEPS speculative steps after plain ones (the drafter runs cold, and
    catches up on deferred context) take 3x a run's later steps; only those are timed, so
    speculation resumes where its runs pay. Were switching steps timed, their median would
    say plain decoding wins."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _speculated(policy, requests=4, verified=8.0, accepted=2.0, steps=0)
    policy.predicted_s = policy.cost.draft_s(4) + policy.cost.target_s(36)
    steady = policy.predicted_s
    for _ in range(8):  # runs of _WARM_STEPS speculative steps between plain steps
        policy.observe_step(False, 4, policy.cost.target_s(4))
        for _ in range(_WARM_STEPS):
            policy.observe_step(True, 4, 3 * steady)
    assert not policy.at(4).spec_scale.seen
    policy.observe_speculation(4, 32, 8)
    policy.observe_step(True, 4, steady)  # a run's first step past its switching ones
    assert policy.at(4).spec_scale.factor == pytest.approx(1.0) and policy.forecast_pays(4)
    policy.at(4).spec_scale.add(3 * steady, steady)  # the probes' times
    policy.at(4).spec_scale.add(3 * steady, steady)
    assert not policy.forecast_pays(4)


def _forecast_gain(policy: SpecPolicy, requests: int, gain: float) -> None:
    """An established acceptance average (a full window of speculative steps, 8 drafts
    verified per request) and measured step times at their profile, such that the forecast
    at `requests` expects speculation to commit `gain` times the tokens per second of plain
    decoding."""
    plain = policy.cost.target_s(requests)
    spec = policy.cost.draft_s(requests) + policy.cost.target_s(requests * 9)
    for _ in range(round(1 / _RECENT_RATE)):
        policy.observe_speculation(requests, 8.0 * requests, (gain * spec / plain - 1) * requests)
    policy.observe_step(False, requests, plain)
    policy.predicted_s = spec
    for _ in range(_WARM_STEPS + 3):
        policy.observe_step(True, requests, spec)


def _plain_steps_at(policy: SpecPolicy, requests: int, factor: float) -> None:
    """Enough plain steps of `requests`, each `factor` x its profile, to be the median."""
    for _ in range(32):
        policy.observe_step(False, requests, factor * policy.cost.target_s(requests))


def _decode(policy: SpecPolicy, requests: int, steps: int, plain_factor: float,
            spec_factor: float, cold_plain: float = 1.0) -> list[bool]:
    """`steps` decode steps as the engine runs them (acceptance as it was): each speculative
    one (8 drafts verified per request) timed at `spec_factor` x its profile, each plain one
    at `plain_factor` x its profile (`cold_plain` x that right after a speculative step).
    Returns whether each step speculated."""
    spec = policy.cost.draft_s(requests) + policy.cost.target_s(requests * 9)
    drafted = []
    for _ in range(steps):
        drafted.append(policy.should_draft(requests))
        policy.predicted_s = spec
        plain = plain_factor * (cold_plain if policy.run_length else 1.0)
        policy.observe_step(drafted[-1], requests, spec_factor * spec if drafted[-1]
                            else plain * policy.cost.target_s(requests))
    return drafted


def _runs(drafted: list[bool]) -> list[tuple[bool, int]]:
    """(speculated, steps) of each run of equal steps, in order."""
    return [(k, len(list(g))) for k, g in itertools.groupby(drafted)]


def test_speculation_starts_on_a_clear_gain_and_goes_on_while_it_breaks_even():
    """With the acceptance average established, a batch size starts speculating only where
    the forecast gains _MARGIN (a 3% gain is within what the forecast does not see: it stays
    plain); one that speculates goes on while the forecast breaks even, and stops where it
    does not, resuming only where the gain is _MARGIN again."""
    assert _MARGIN > 0.03
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.03)
    assert policy.forecast_pays(4) and not policy.forecast_pays(4, _MARGIN)
    assert not policy.should_draft(4)

    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.08)
    assert all(_decode(policy, 4, 20, plain_factor=1.0, spec_factor=1.0))
    _plain_steps_at(policy, 4, 1.03 / 1.08)  # the forecast gain is now 3%
    assert all(_decode(policy, 4, 30, plain_factor=1.03 / 1.08, spec_factor=1.0))
    _plain_steps_at(policy, 4, 0.97 / 1.08)  # and now a 3% loss: plain, then probes
    runs = _runs(_decode(policy, 4, 600, plain_factor=0.97 / 1.08, spec_factor=1.0))
    assert runs[0][0] is False and runs[0][1] > _MIN_BACKOFF
    assert max(n for speculated, n in runs if speculated) == _PROBE_STEPS
    _plain_steps_at(policy, 4, 1.03 / 1.08)  # back to a 3% gain: not enough to resume
    runs = _runs(_decode(policy, 4, 1000, plain_factor=1.03 / 1.08, spec_factor=1.0))
    # (the longest run: a window of steps can cut a probe short)
    assert max(n for speculated, n in runs if speculated) == _PROBE_STEPS


def test_a_verdict_against_running_speculation_is_rechecked_on_fresh_plain_steps():
    """Plain steps are timed once every _PLAIN_PROBE speculative ones: when the whole
    machine slows down by a fifth, speculative steps show it first, and the forecast turns
    against speculation. The verdict is taken again after _TRUSTED_PLAIN plain steps timed
    afresh (after _COLD_PLAIN_STEPS untimed), and speculation resumes; where speculative
    steps alone slowed down, the back-off follows."""
    for plain_factor, resumes in ((1.2, True), (1.0, False)):
        policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
        _forecast_gain(policy, requests=4, gain=1.08)
        assert all(_decode(policy, 4, 20, plain_factor=1.0, spec_factor=1.0))
        runs = _runs(_decode(policy, 4, 60, plain_factor=plain_factor, spec_factor=1.2))
        assert runs[0][0] is True and runs[1][0] is False
        if resumes:
            assert runs[1][1] == _COLD_PLAIN_STEPS + _TRUSTED_PLAIN and runs[2][0] is True
            assert all(n == _COLD_PLAIN_STEPS + 1 for speculated, n in runs[2:]
                       if not speculated)  # plain probes
        else:
            assert runs[1][1] > _TRUSTED_PLAIN


def test_the_first_plain_step_after_speculative_ones_is_not_timed():
    """On an H200 the first plain step after speculative ones took 11% more than the next
    ones at 16 and 64 requests, and up to 30% after long runs: a plain probe timed only such
    steps, and plain decoding looked that much slower than it was. Here it takes 1.3x:
    speculation that gains 8% runs, then slows down to lose 3% against warm plain steps. The
    plain probes time their second step alone, so the forecast sees the loss and speculation
    backs off; timing their first step, it saw a gain of 26% and went on."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.08)
    paying = _decode(policy, 4, 200, plain_factor=1.0, spec_factor=1.0, cold_plain=1.3)
    assert not all(paying)  # plain probes ran
    _decode(policy, 4, 400, plain_factor=1.0, spec_factor=1.08 / 0.97, cold_plain=1.3)
    assert list(policy.at(4).plain_scale.samples) == pytest.approx(
        [1.0] * len(policy.at(4).plain_scale.samples))
    assert policy.at(4).backoff > 0 and not policy.at(4).speculating


def test_plain_steps_come_further_apart_while_speculation_pays_clearly():
    """One plain step (after _COLD_PLAIN_STEPS untimed ones) re-measures plain decoding after
    _PLAIN_PROBE speculative ones; while the forecast on its time favours speculation by
    _WIDE_GAIN, the next comes twice as many steps later, up to _PLAIN_PROBE_DOUBLINGS
    doublings; where it favours speculation by less, every _PLAIN_PROBE steps. A verdict
    against speculation starts over."""
    assert 1.08 < 1 + _WIDE_GAIN < 1.3 and _PLAIN_PROBE_DOUBLINGS >= 1
    widest = _PLAIN_PROBE << _PLAIN_PROBE_DOUBLINGS
    for gain, gaps in ((1.08, [_PLAIN_PROBE] * 5), (1.3, [
            _PLAIN_PROBE << d for d in range(_PLAIN_PROBE_DOUBLINGS)] + [widest, widest])):
        policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
        _forecast_gain(policy, requests=4, gain=gain)
        probe = _COLD_PLAIN_STEPS + 1
        runs = _runs(_decode(policy, 4, sum(gaps) + probe * len(gaps), plain_factor=1.0,
                             spec_factor=1.0))
        assert runs == [r for gap in gaps for r in ((True, gap), (False, probe))], (gain, runs)
    assert policy.at(4).plain_probe_doublings == _PLAIN_PROBE_DOUBLINGS
    _decode(policy, 4, 40, plain_factor=1.0, spec_factor=2.0)  # speculation stops paying
    assert not policy.at(4).speculating and policy.at(4).plain_probe_doublings == 0


def test_a_bucket_with_few_plain_steps_borrows_the_nearest_well_measured_times():
    """A bucket that speculates times a plain step only every so often: until it has
    _TRUSTED_PLAIN of them, its plain step time is the nearest well-measured bucket's, not
    one step's (here a slow one). Speculative times are a probe's own bucket's from its
    first timed step."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _plain_steps_at(policy, 16, 1.0)
    _plain_steps_at(policy, 1, 1.2)
    policy.observe_step(False, 8, 1.5 * policy.cost.target_s(8))
    assert policy.plain_s(8) == pytest.approx(policy.cost.target_s(8))  # 16's, the nearest
    # 4 is as near to 1 as to 16: the larger's time (1's overstates 4's host work)
    assert policy.plain_s(4) == pytest.approx(policy.cost.target_s(4))
    for _ in range(_TRUSTED_PLAIN - 1):
        policy.observe_step(False, 8, 1.5 * policy.cost.target_s(8))
    assert policy.plain_s(8) == pytest.approx(1.5 * policy.cost.target_s(8))
    _speculated(policy, requests=1, verified=8.0, accepted=1.0, steps=20)
    _speculated(policy, requests=64, verified=8.0, accepted=1.0, time_factor=3.0,
                steps=_PROBE_STEPS)  # a probe
    assert policy.spec_s(64) == pytest.approx(3.0 * policy.spec_profile_s(64))


def test_the_remembered_choice_of_bucket_follows_every_change_of_the_step_times():
    """`_factor` remembers which bucket's scale it reads until a scale is made or given one of
    its first samples; after random steps, back-offs, rechecks and new buckets, its answer is
    always the brute-force search's over all buckets."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    rng = random.Random(5)

    def brute_force(requests: int, spec: bool, trusted: int, larger_first: bool) -> float:
        bits = (1 << (requests - 1).bit_length()).bit_length()
        ranked = sorted(
            ((len(scale.samples) < trusted, abs(bucket.bit_length() - bits),
              -bucket if larger_first else bucket), scale)
            for bucket, size in policy.sizes.items()
            for scale in [size.spec_scale if spec else size.plain_scale] if scale.samples)
        return statistics.median(ranked[0][1].samples) if ranked else 1.0

    for _ in range(3000):
        requests = rng.choice([1, 2, 3, 5, 8, 16, 30])
        event = rng.random()
        if event < 0.05:
            policy.back_off(requests)
        elif event < 0.08:
            policy.recheck(requests)
        else:
            policy.observe_step(event < 0.5, requests, rng.uniform(0.5, 2.0) * 1e-3)
        asked = rng.choice([1, 2, 4, 7, 16, 32, 64])
        for spec, trusted, larger_first in [(True, 1, False), (False, _TRUSTED_PLAIN, True),
                                            (False, 1, False)]:
            kind = _spec_scale if spec else _plain_scale
            assert policy._factor(asked, kind, trusted, larger_first) == pytest.approx(
                brute_force(asked, spec, trusted, larger_first))
        assert policy._measured(_spec_scale) == any(
            size.spec_scale.samples for size in policy.sizes.values())


def test_a_new_bucket_times_its_own_plain_steps_before_its_first_verdict():
    """Plain steps of 4 requests take 1.5x their profile (host work weighs more in small
    steps), those of 16 their profile, and speculation at 16 would lose 5%. Judged on 4's
    plain times, speculation would start at 16; 16 first times _TRUSTED_PLAIN plain steps of
    its own, and its verdict on them is against speculation: no speculative step until the
    probe after the back-off."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    cost = policy.cost

    def spec_over_plain(requests: int) -> float:  # 8 drafts verified per request
        return (cost.draft_s(requests) + cost.target_s(9 * requests)) / cost.target_s(requests)

    _forecast_gain(policy, requests=4, gain=0.95 * spec_over_plain(16) / spec_over_plain(4))
    _plain_steps_at(policy, 4, 1.5)
    assert policy.forecast_pays(16, _MARGIN) and not policy.at(16).plain_scale.seen
    drafted = _decode(policy, 16, 300, plain_factor=1.0, spec_factor=1.0)
    assert not policy.forecast_pays(16)
    first = drafted.index(True)  # the probe's first step
    assert first > _TRUSTED_PLAIN + _MIN_BACKOFF
    assert _runs(drafted[first:])[0] == (True, _PROBE_STEPS)


@pytest.mark.parametrize("last_backoff", [0, 8])
def test_the_verdict_after_a_probe_compares_plain_steps_of_its_own_time(last_backoff):
    """Plain steps timed at 1.5x their profile (a slower machine: a GPU's first seconds),
    then a back-off (of 8 steps, or of 16 after one of 8); since then the machine runs at
    its profile, where speculation loses 5%. The back-off's last _TRUSTED_PLAIN steps
    re-time plain decoding, so the verdict after the probe is against speculation: on the
    older plain times speculation would gain two fifths."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=0.95)
    _plain_steps_at(policy, 4, 1.5)
    assert policy.forecast_pays(4, _MARGIN)
    policy.at(4).backoff = last_backoff
    policy.back_off(4)
    assert policy.at(4).backoff == max(_MIN_BACKOFF, 2 * last_backoff)
    runs = _runs(_decode(policy, 4, 400, plain_factor=1.0, spec_factor=1.0))
    assert runs[0] == (False, max(_MIN_BACKOFF, 2 * last_backoff))
    assert runs[1] == (True, _PROBE_STEPS) and runs[2][0] is False
    assert not policy.forecast_pays(4)


def test_a_probe_s_times_replace_those_of_the_slow_stretch_its_back_off_began_in():
    """Speculation gains 10%; then speculative steps run at 1.2x their time for a while (a
    GPU host's slow stretch): a verdict against, rechecked on fresh plain steps, and a
    back-off. The stretch is over by the probe: the verdict after it is taken on the probe's
    times alone, and speculation resumes. Joined to the stretch's times in one median, the
    probe's would have been outvoted, probe after probe."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.10)
    assert all(_decode(policy, 4, 20, plain_factor=1.0, spec_factor=1.0))
    while policy.at(4).probe_steps_left == 0:  # the slow stretch, until a back-off
        _decode(policy, 4, 1, plain_factor=1.0, spec_factor=1.2)
    runs = _runs(_decode(policy, 4, 200, plain_factor=1.0, spec_factor=1.0))
    assert runs[0][0] is False and runs[1][0] is True and runs[1][1] > _PROBE_STEPS
    assert policy.at(4).backoff == 0
    assert list(policy.at(4).spec_scale.samples) == pytest.approx(
        [1.0] * len(policy.at(4).spec_scale.samples))  # the probe's times and later ones


def test_a_probe_slower_than_the_steps_before_its_back_off_joins_their_times():
    """A probe's few steps can be slow by chance, and a verdict against speculation stands
    until the next probe: where the probe is slower than the speculative steps before the
    back-off, its times join theirs and the verdict is taken on all of them (speculation
    resumes here, gaining 10% on the older times and losing 8% on the probe's)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.10)
    assert all(_decode(policy, 4, 20, plain_factor=1.0, spec_factor=1.0))
    before = list(policy.at(4).spec_scale.samples)
    policy.back_off(4)
    runs = _runs(_decode(policy, 4, policy.at(4).backoff + _PROBE_STEPS, plain_factor=1.0,
                         spec_factor=1.2))
    assert runs == [(False, policy.at(4).backoff), (True, _PROBE_STEPS)]
    assert policy.should_draft(4)
    assert list(policy.at(4).spec_scale.samples) == pytest.approx(
        before + [1.2] * (_PROBE_STEPS - _WARM_STEPS))


def test_the_first_plain_probe_after_a_back_off_comes_a_whole_interval_after_its_probe():
    """Speculation gains 10%, and has run 60 speculative steps since its last plain step when
    a back-off comes: the back-off's plain steps re-time plain decoding, so the interval to
    the next plain step starts over with the probe (whose steps count in it)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=1.10)
    assert all(_decode(policy, 4, 60, plain_factor=1.0, spec_factor=1.0))
    policy.back_off(4)
    backoff = policy.at(4).backoff
    runs = _runs(_decode(policy, 4, backoff + _PLAIN_PROBE + 1, plain_factor=1.0,
                         spec_factor=1.0))
    assert runs == [(False, backoff), (True, _PLAIN_PROBE), (False, 1)]


def test_speculation_resumed_on_plain_times_of_a_loaded_stretch_re_times_them_soon():
    """Speculation loses 10%. A back-off's last plain steps run 3x slower (another process
    took the cores), so the verdict after its probe resumes speculation. Its first plain
    probe then re-times _TRUSTED_PLAIN plain steps, not one: the loaded steps no longer
    make the median, and speculation stops within _PLAIN_PROBE + 2 * _TRUSTED_PLAIN steps.
    With one step a probe it ran 9 probes' worth (~600 steps) on the loaded times (on a
    2-core CPU, 85% of the steps at 16 requests where speculation lost 58%)."""
    policy = SpecPolicy(_cost(per_token=1e-4, base=0.01, draft=0.002), LEVELS)
    _forecast_gain(policy, requests=4, gain=0.90)
    _plain_steps_at(policy, 4, 1.0)
    policy.back_off(4)
    backoff = policy.at(4).backoff
    assert not any(_decode(policy, 4, backoff - _TRUSTED_PLAIN, plain_factor=1.0,
                           spec_factor=1.0))
    assert not any(_decode(policy, 4, _TRUSTED_PLAIN, plain_factor=3.0, spec_factor=1.0))
    runs = _runs(_decode(policy, 4, 400, plain_factor=1.0, spec_factor=1.0))
    assert runs[0] == (True, _PLAIN_PROBE)  # the probe, then speculation resumed
    # the re-timing, a recheck, then a back-off, with probes alone after it
    assert runs[1][0] is False and runs[1][1] >= 2 * _TRUSTED_PLAIN + _MIN_BACKOFF
    assert all(n == _PROBE_STEPS for speculated, n in runs[2:] if speculated)


def test_the_shortest_back_off_re_times_all_of_its_steps_after_the_verdicts_own():
    """Speculation costs 1.4% more than it commits (nothing accepted, a nearly free draft and
    verify): the verdict, taken by should_draft, backs off _MIN_BACKOFF steps, the verdict's
    own step first (untimed: it follows speculative steps), and plain steps then take 1.1x
    what they took before. The verdict after the probe is taken on the back-off's other 8
    steps alone, and speculation gains 8.5% on them; among the older times (32 at 1.0x) it
    would lose again."""
    policy = SpecPolicy(_cost(per_token=1e-6, base=0.01, draft=1e-4), LEVELS)
    spec = policy.cost.draft_s(4) + policy.cost.target_s(36)
    _forecast_gain(policy, requests=4, gain=policy.cost.target_s(4) / spec)  # 0 accepted
    _plain_steps_at(policy, 4, 1.0)
    assert not policy.forecast_pays(4)
    runs = _runs(_decode(policy, 4, 40, plain_factor=1.1, spec_factor=1.0))
    assert runs[0] == (False, _MIN_BACKOFF) == (False, _COLD_PLAIN_STEPS + _TRUSTED_PLAIN)
    assert runs[1][0] is True and runs[1][1] > _PROBE_STEPS  # speculation resumed
    assert list(policy.at(4).plain_scale.samples) == [pytest.approx(1.1)] * _TRUSTED_PLAIN


def test_recent_reach_weighs_a_step_of_several_trees_as_one_tree_at_a_time():
    """A step's trees enter the recent-reach average (a new request's expected gains) as
    their mean, with the weight they would have had one by one; a step without trees leaves
    it as it was."""
    policy = SpecPolicy(_cost(per_token=0.05, base=1.0, draft=0.2), LEVELS)
    low, high = _chain_gains(0.1), _chain_gains(0.9)
    policy.note_reach({1: low})
    policy.note_reach({2: high, 3: high, 4: low})
    weight = 1 - (1 - _RECENT_RATE) ** 3
    expected = [a + weight * ((2 * b + a) / 3 - a) for a, b in zip(low, high)]
    assert policy.expected_gains(9) == pytest.approx(expected)
    policy.note_reach({})
    assert policy.expected_gains(9) == pytest.approx(expected)
    assert policy.expected_gains(2) == high and policy.expected_gains(4) == low


def test_trees_are_chosen_from_each_requests_last_tree_before_drafting():
    """DDTree budgets are chosen before the drafter runs (no wait for the draft): from the
    request's last tree's gains; for a new request, from recent trees' average; before any
    tree, from every node accepted (so the first steps speculate and measure). A request's
    history goes with it."""
    policy = SpecPolicy(_cost(per_token=0.05, base=1.0, draft=0.2), LEVELS)
    assert policy.expected_gains(7) == [float(b) for b in LEVELS]
    assert max(policy.choose([7], [policy.expected_gains(7)])) == 15
    policy.note_reach({7: _chain_gains(0.05)})
    assert policy.expected_gains(7) == _chain_gains(0.05)
    assert policy.expected_gains(8) == _chain_gains(0.05)  # the only tree so far
    policy.note_reach({8: _chain_gains(0.95)})
    budgets = policy.choose([7, 8], [policy.expected_gains(7), policy.expected_gains(8)])
    assert budgets[0] == 0 and budgets[1] > 0
    mixed = policy.expected_gains(9)
    assert _chain_gains(0.05)[-1] < mixed[-1] < _chain_gains(0.95)[-1]
    policy.forget({8})
    assert policy.expected_gains(7) == mixed and policy.expected_gains(8) == _chain_gains(0.95)


def test_tree_budgets_are_kept_for_a_few_steps_and_chosen_again_when_the_batch_changes(
        small_pair, tmp_path, monkeypatch):
    """DDTree budgets are chosen on every _CHOICE_STEPS-th drafting step of a batch and on
    the first step after its requests change; the steps in between keep them. Only a step
    that chose reads its trees' reach (the next choice's input and the calibration's).
    Probe steps commit one token each, so the first request ends after a known step."""
    engine, policy = _probing_engine(small_pair, tmp_path, monkeypatch)
    calls: list[tuple[str, tuple[int, ...]]] = []
    choose, note_reach = policy.choose, policy.note_reach

    def counted_choose(ids, gains):
        calls.append(("choose", tuple(ids)))
        return choose(ids, gains)

    def counted_note_reach(reach):
        calls.append(("reach", tuple(reach)))
        note_reach(reach)

    policy.choose, policy.note_reach = counted_choose, counted_note_reach
    short, long = (engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                        ignore_eos=True))
                   for p, n in zip(PROMPTS, (7, 15)))
    engine.step()  # both prompts: the first token each
    steps = []
    while engine.has_unfinished():
        calls.clear()
        engine.step()
        steps.append(list(calls))
    assert short.is_finished and len(short.output_ids) == 7 and len(long.output_ids) == 15
    both, alone = (short.seq_id, long.seq_id), (long.seq_id,)
    chose = [("choose", both), ("reach", both)]
    chose_alone = [("choose", alone), ("reach", alone)]
    # 6 steps of both requests, then 8 of the long one alone.
    expected = [chose if i % 4 == 0 else [] for i in range(6)]
    expected += [chose_alone if i % 4 == 0 else [] for i in range(8)]
    assert candidates._CHOICE_STEPS == 4 and steps == expected


def test_deferred_context_rows_skip_requests_freed_since(small_pair, tmp_path, monkeypatch):
    """A plain step's context rows wait for the next draft with the target batch's own slots.
    Freeing pages injects nothing; at the flush, rows of a request freed since (finished, or
    preempted and given new pages) are dropped, as their slots may be another's by then, and
    every other row goes to its slot, each once. Held rows stay bounded."""
    from flashtree.spec import dflash
    from flashtree.spec.dflash import ContextRows

    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4)
    proposer, pages = llm.engine.proposer, llm.engine.pages
    width = proposer.draft.fc.in_features  # len(target_layer_ids) * hidden

    def rows(spans: list[tuple[int, int, int]]) -> ContextRows:  # (seq_id, start, count)
        positions = [i for _, start, count in spans for i in range(start, start + count)]
        slots = [v for seq_id, start, count in spans for v in pages.slots(seq_id, start, count)]
        return ContextRows(torch.ones(len(positions), width), positions=torch.tensor(positions),
                           slots=torch.tensor(slots),
                           leases=pages.leases([seq_id for seq_id, _, _ in spans]),
                           counts=(None if all(count == 1 for *_, count in spans)  # decode
                                   else tuple(count for *_, count in spans)))

    for seq_id in (5, 6, 7):
        pages.reserve(seq_id, 8)
        pages.set_length(seq_id, 4)
    old_slots = {seq_id: pages.slots(seq_id, 0, 4) for seq_id in (5, 6, 7)}
    written = []
    monkeypatch.setattr(proposer, "write_context",
                        lambda f, pos, slots: written.append((pos.tolist(), slots.tolist())))
    proposer.defer(rows([(5, 0, 3), (6, 0, 2), (7, 0, 1)]))
    pages.free(6)  # finished
    pages.free(7)  # preempted, then admitted again with new pages
    pages.reserve(7, 4)
    pages.set_length(7, 1)
    proposer.defer(rows([(5, 3, 1), (7, 0, 1)]))
    assert written == []  # freeing pages injects nothing
    proposer.flush()
    assert written == [([0, 1, 2, 3, 0], old_slots[5] + pages.slots(7, 0, 1))]
    proposer.flush()
    assert len(written) == 1  # nothing is injected twice
    monkeypatch.setattr(dflash, "_MAX_DEFERRED_ROWS", 4)
    proposer.defer(rows([(5, 0, 3)]))
    assert len(written) == 1
    proposer.defer(rows([(5, 3, 1), (7, 0, 1)]))
    assert written[1] == ([0, 1, 2, 3, 0], pages.slots(5, 0, 4) + pages.slots(7, 0, 1))
    proposer.defer(rows([(5, 3, 1), (7, 0, 1)]))  # a decode step's rows: one per request
    pages.free(7)
    proposer.flush()
    assert written[2] == ([3], pages.slots(5, 3, 1))
    proposer.defer(rows([(5, 0, 4)]))
    pages.free(5)
    proposer.flush()
    assert len(written) == 3  # every row stale: no drafter forward at all


@torch.inference_mode()
def test_plain_steps_chosen_by_the_policy_fill_the_draft_cache(small_pair, tmp_path,
                                                              monkeypatch):
    """While the adaptive policy decodes plain, each step's context rows (the prompt's, then
    one per token) wait; the flush before the next draft puts them in the draft cache at the
    request's slots: the drafter's context K/V of the target's features for every committed
    token, as a fresh prefill of them computes it."""
    from flashtree.engine.forward_batch import BatchItem, Mode
    from flashtree.spec.policy import SpecPolicy

    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(SpecPolicy, "should_draft", lambda self, requests, remaining: False)
    target, drafter = small_pair
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device="cpu",
              skip_tokenizer_init=True, page_size=4)
    engine, pages = llm.engine, llm.engine.pages
    prompt = [1, 2, 3, 4, 0, 1]
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))
    for _ in range(9):
        engine.step()
    assert not seq.is_finished and seq.spec_accept_lengths == [1] * 8  # every step was plain
    engine.proposer.flush()  # as the next speculative step does before drafting
    tokens = prompt + seq.output_ids[:-1]  # committed: the last has no KV yet
    assert seq.num_computed == len(tokens)
    slots = torch.tensor(pages.slots(seq.seq_id, 0, len(tokens)))

    pages.reserve(99, len(tokens))
    _, features = engine.runner.forward(Mode.PREFILL, [BatchItem(99, 0, tokens)])
    expected = engine.proposer.draft.context_kv(features, torch.arange(len(tokens)))
    for layer, (k, v) in enumerate(expected):
        torch.testing.assert_close(engine.proposer.cache.k[layer][slots], k, atol=1e-4, rtol=0)
        torch.testing.assert_close(engine.proposer.cache.v[layer][slots], v, atol=1e-4, rtol=0)


def test_speculation_without_free_pages_runs_plain_instead_of_preempting(small_pair, tmp_path,
                                                                         monkeypatch):
    """12 pages of 4 tokens hold both requests' tokens (5 pages each) but not a 16-node tree's
    lookahead beside them: those steps decode plain, nobody is preempted, and once the short
    request is done the long one speculates. Tokens equal plain decoding's."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    target, drafter = small_pair
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[0][::-1]]  # 7 tokens each
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 13)]
    common = dict(device="cpu", skip_tokenizer_init=True, page_size=4, kv_cache_pages=12)
    plain = LLM(model=str(target), **common).generate(prompts, params)
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", spec_policy="fixed",
              tree_budget=15, **common)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    engine = llm.engine
    assert engine.scheduler.num_preemptions == 0
    budgets = engine.speculative.stats.budgets
    assert budgets.get(0, 0) > 0 and budgets.get(15, 0) > 0, budgets
    # Every request of a speculative step verified the full tree: the speculative steps by
    # batch size account for the budget-15 request-steps.
    by_batch = engine.speculative.stats.speculative_steps
    assert set(by_batch) <= {1, 2} and sum(b * n for b, n in by_batch.items()) == budgets[15]
    assert engine.pages.num_free == engine.pages.num_pages


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_chunked_prefill_leaving_the_last_prompt_token_speculates_from_it(small_pair, tmp_path,
                                                                          monkeypatch, spec):
    """A 6-token prefill budget computes 6 of a 7-token prompt; the next step decodes from the
    last prompt token (no output yet), speculatively: its root is that prompt token."""
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    target, drafter = small_pair
    prompt = TINY_PROMPTS[0]
    assert len(prompt) == 7
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(device="cpu", skip_tokenizer_init=True, page_size=4,
                  max_num_batched_tokens=6)
    expected = LLM(model=str(target), **common).generate([prompt], sp)[0].outputs[0]
    llm = LLM(model=str(target), draft=str(drafter), spec=spec, spec_policy="fixed", **common)
    out = llm.generate([prompt], sp)[0].outputs[0]
    assert out.token_ids == expected.token_ids
    # Every decode step speculated, the first one included (12 tokens, no plain budget).
    assert len(out.spec_accept_lengths) == llm.engine.speculative.stats.num_drafts
