"""On a CUDA device the engine replays CUDA graphs for decode, prompt chunks, draft and verify
by default: its tokens equal the eager engine's (`enforce_eager=True`) for plain, DFlash and
DDTree decoding, fixed and adaptive budgets, greedy and seeded sampling, with batches that run
padded in a larger bucket; its decode and prompt graphs keep the drafter's context as the eager
engine's deferred rows do. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.graphs.schema import GraphMode
from flashtree.speculative.policy import FixedPolicy
from tests.helpers import ran_mixed_steps, record_schedules
from tests.tiny import TINY_PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Five requests: decode replays the bucket of six, padded.
PROMPTS = [*TINY_PROMPTS, [4, 1, 1, 3, 2, 0]]


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("spec,policy", [("none", "fixed"), ("dflash", "fixed"),
                                         ("dflash", "adaptive"), ("ddtree", "fixed"),
                                         ("ddtree", "adaptive")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_engine_equals_eager_engine(small_pair, spec, policy, temperature):
    target, drafter = map(str, small_pair)
    kw = dict(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
              page_size=4, max_num_seqs=8, spec=spec, spec_policy=policy)
    if spec != "none":
        kw["draft"] = drafter
    params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
    graphed = LLM(**kw)
    runner = graphed.engine.runner
    assert runner.graphs is not None and runner.graphs.bucket(GraphMode.DECODE, 5, 1).batch == 6
    longest = max(map(len, PROMPTS))
    assert runner.graphs.bucket(GraphMode.PREFILL, len(PROMPTS), longest) is not None
    if spec != "none":
        assert graphed.engine.proposer.runner.graphs is not None
    assert _tokens(graphed, params) == _tokens(LLM(**kw, enforce_eager=True), params)
    assert graphed.engine.pages.num_free == graphed.engine.pages.num_pages


def test_admissions_mix_with_decode_tokens_where_a_prompt_graph_holds_them(small_pair):
    """A mixed step (prompt chunks with the running requests' decode tokens) replays a prompt
    graph padded to its longest chunk: it is refused only where the prompt chunks alone would
    replay one and the mixed batch would not. Requests of staggered lengths, two at a time,
    admit mixed and give the eager engine's tokens."""
    target, drafter = map(str, small_pair)
    kw = dict(model=target, draft=drafter, spec="ddtree", device="cuda", dtype="float32",
              skip_tokenizer_init=True, page_size=4, max_num_seqs=16)
    mixes = LLM(**kw).engine.scheduler.mixes  # runner/capture.py mixes_in_graphs
    assert mixes(1, 15, 60)  # 16 x 64 rows: captured
    assert not mixes(1, 15, 200)  # 16 x 256 rows: not captured, where 1 x 256 is
    assert mixes(1, 15, 300)  # no prompt graph holds 300 tokens: eager either way
    kw["max_num_seqs"] = 2
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (9, 30, 14, 5, 22)]
    graphed = LLM(**kw)
    schedules = record_schedules(graphed.engine)
    tokens = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params)]
    assert ran_mixed_steps(schedules)
    eager = LLM(**kw, enforce_eager=True)
    assert tokens == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]


def test_graphs_write_the_drafters_context(small_pair):
    """A drafter engine's decode and prompt graphs write their tokens' context K/V to the
    draft cache themselves (no features come back to be deferred): after the prompts and plain
    steps, the draft cache holds at every request's committed slots what the eager engine's
    deferred rows inject."""
    target, drafter = map(str, small_pair)
    kw = dict(model=target, draft=drafter, spec="ddtree", device="cuda", dtype="float32",
              skip_tokenizer_init=True, page_size=4, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    caches = []
    for llm in (LLM(**kw), LLM(**kw, enforce_eager=True)):
        engine = llm.engine
        engine.policy = FixedPolicy(0)  # plain steps only
        seqs = [engine.add_request(p, params) for p in PROMPTS]
        for _ in range(12):  # the prompts, then plain decode steps
            engine.step()
        assert all(s.num_computed > len(s.prompt_ids) + 8 for s in seqs)
        deferred = engine.proposer.deferred_rows
        engine.proposer.flush()  # as the next draft would
        slots = torch.tensor([v for s in seqs for v in engine.pages.slots(s.seq_id, 0,
                                                                          s.num_computed)],
                             device="cuda")
        caches.append((deferred, engine.proposer.cache.k[:, slots],
                       engine.proposer.cache.v[:, slots]))
    (graph_deferred, *graph_kv), (eager_deferred, *eager_kv) = caches
    assert graph_deferred == 0
    assert eager_deferred == sum(s.num_computed for s in seqs)
    for got, expected in zip(graph_kv, eager_kv):
        assert expected.abs().amax() > 0
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
