"""Tensor parallelism over gloo with real worker processes: TP=2 returns exactly TP=1's tokens
(greedy and seeded sampling, every speculative mode), the model really is sharded, and a dead
worker stops the engine with an error naming its rank instead of hanging."""

from __future__ import annotations

import os
import signal

import pytest

from flashtree import LLM, SamplingParams
from flashtree.distributed.tp import TPGroupStopped, WorkerDied
from tests.tiny import save_reference_drafter, save_tiny_llama

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Llama with one KV head (replicated across the 2 ranks) and an odd vocabulary (67:
    shards of 34 and 33 rows), plus a drafter for it."""
    root = tmp_path_factory.mktemp("tp")
    target = save_tiny_llama(root / "target", seed=5, vocab_size=67, num_attention_heads=4,
                             num_key_value_heads=1, hidden_size=64, intermediate_size=128)
    drafter = save_reference_drafter(root / "drafter", target, block_size=4)
    return target, drafter


def _llm(tiny, spec: str, tp: int) -> LLM:
    target, drafter = tiny
    extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec, "spec_policy": "fixed"}
    return LLM(model=str(target), device="cpu", skip_tokenizer_init=True,
               tensor_parallel_size=tp, **extra)


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_tp2_equals_tp1(tiny, spec):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=10 + i,
                              ignore_eos=True) for i in range(len(PROMPTS))]
    one = _llm(tiny, spec, 1)
    want = [[o.outputs[0].token_ids for o in one.generate(PROMPTS, p)]
            for p in (greedy, sampled)]
    two = _llm(tiny, spec, 2)
    try:
        attn = two.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # 4 heads split, 1 KV head copied
        assert two.model.lm_head.weight.shape[0] == 34
        got = [[o.outputs[0].token_ids for o in two.generate(PROMPTS, p)]
               for p in (greedy, sampled)]
    finally:
        two.shutdown()
    assert got == want


def test_tp2_with_overlapped_decoding_equals_tp1(tiny):
    """Every rank queues each greedy decode step before its read (`decode_ahead`, forced on
    where only CUDA turns it on) and takes it the next step, or the rows of the requests
    going on where others ended: TP=1's tokens, which it computes without the overlap."""
    target, _ = tiny
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    one = LLM(model=str(target), device="cpu", skip_tokenizer_init=True, overlap_decode=False)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    two = LLM(model=str(target), device="cpu", skip_tokenizer_init=True,
              tensor_parallel_size=2, overlap_decode=True)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)]
        assert two.engine.overlapped_decode_steps == 18  # every decode step of the longest
    finally:
        two.shutdown()
    assert got == want


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_tp2_reuses_cached_prefixes_like_tp1_computes_them(tiny, spec):
    """Prompts sharing three full pages, sent twice: TP=2 with prefix caching (every rank
    keeps the same page tables) returns what TP=1 computes without it."""
    shared = [(7 * i) % 60 + 1 for i in range(50)]
    prompts = [shared + [i + 1, i + 2] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    target, drafter = tiny
    extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec, "spec_policy": "fixed"}
    one = LLM(model=str(target), device="cpu", skip_tokenizer_init=True,
              enable_prefix_caching=False, **extra)
    want = [o.outputs[0].token_ids for o in one.generate(prompts + prompts, params)]
    two = _llm(tiny, spec, 2)
    try:
        got = [o.outputs[0].token_ids for _ in range(2) for o in two.generate(prompts, params)]
        # All but the first request find the shared 48 tokens (the first round's others wait
        # a step for the first to compute them).
        assert two.engine.pages.prefix.hit_tokens == 5 * 48
    finally:
        two.shutdown()
    assert got == want


def test_killed_worker_stops_the_engine_naming_its_rank(tiny):
    llm = _llm(tiny, "ddtree", 2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="already running in this process"):
        _llm(tiny, "none", 1)  # its layers would join the live group
    worker = llm._tp.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"rank 1 \(pid {worker.pid}\) died"):
        llm.generate([[1, 2, 3]], params)
    with pytest.raises(TPGroupStopped, match="stopped"):  # and stays stopped
        llm.generate([[4]], params)
    llm.shutdown()


def test_shapes_that_do_not_shard_are_refused(tmp_path):
    target = save_tiny_llama(tmp_path / "t", num_attention_heads=4, num_key_value_heads=2,
                             hidden_size=32)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not fit 4 attention"):
        LLM(model=str(target), device="cpu", skip_tokenizer_init=True, tensor_parallel_size=3)
