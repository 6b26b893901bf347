"""Prefix caching composes with speculation: the default model with its shipped drafter, with
caching on and off, gives the same tokens and the same per-step acceptance lengths (the drafter
read the same context) for `none`, DFlash and DDTree, greedy and with seeded sampling, over
multi-turn conversations sharing a system prompt (turn-one requests arrive together, so they
share a prefix still being computed), and in a pool so small that requests are preempted and
cached pages evicted. The cache must really be used (hits, evictions), and after every run the
pool is whole: every page free or cached and held by no request."""

from __future__ import annotations

import random

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.sampling import uniform

SYSTEM = 70  # tokens shared by every conversation: four full 16-token pages and a part
CONVERSATIONS = 3
TURNS = 2
NEW_TOKENS = 20
# float32 logits of one prompt computed in other chunks (or by transformers) differ by up to
# this share of the largest logit: sums of ~1e3 products rounded in another order
# (tests/models/test_gguf.py derives it).
LOGIT_ERROR = 1e-4


def _conversation_prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(200, 20000) for _ in range(SYSTEM)]
    users = [[rng.randrange(200, 20000) for _ in range(9 + 5 * i)] for i in range(CONVERSATIONS)]
    return system, users


def _chat(llm: LLM, params: SamplingParams, seed: int
          ) -> list[tuple[list[int], list[int], list[int]]]:
    """A request on the system prompt that ends at its first token (its drafter context rows
    are still held back then: the cache must not lose them), then every conversation's turns,
    each turn's requests together; a later turn's prompt is the earlier prompt, its answer and a
    new user message. -> (prompt, tokens, acceptance lengths) of every request."""
    system, users = _conversation_prompts(seed)
    first = llm.generate([system + [201]], SamplingParams(max_tokens=1, ignore_eos=True))
    prompts = [system + u for u in users]
    results = [(system + [201], first[0].outputs[0].token_ids, [])]
    for turn in range(TURNS):
        outs = llm.generate(prompts, params)
        results += [(p, o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths)
                    for p, o in zip(prompts, outs)]
        rng = random.Random(seed * 10 + turn)
        prompts = [p + o.outputs[0].token_ids + [rng.randrange(200, 20000) for _ in range(6)]
                   for p, o in zip(prompts, outs)]
    return results


def _boundary_distance(logits: torch.Tensor, params: SamplingParams, position: int,
                       tokens: tuple[int, int]) -> float:
    """How far the seeded uniform of output `position` lies from the CDF boundary between the
    two tokens two runs drew there, by the reference `logits` [vocab]."""
    cdf = torch.softmax(logits.double() / params.temperature, dim=-1).cumsum(-1)
    return abs(float(cdf[min(tokens)]) - uniform(params.seed, position))


def _assert_same_answers(uncached, cached, params: SamplingParams, request) -> None:
    """Equal tokens and acceptance lengths, but where a seeded draw parts the runs at a CDF
    boundary: caching prefills a prompt in other chunks, whose float32 logits round otherwise
    (up to LOGIT_ERROR of the largest logit each way), so a uniform within 4 LOGIT_ERROR
    largest / T of a boundary may take the neighbouring token. That request's rest, and its
    conversation's later turns, are then not compared."""
    parted = set()  # conversations whose answers parted
    for i, ((prompt, ours, lengths), (prompt_c, theirs, lengths_c)) in enumerate(
            zip(uncached, cached)):
        conversation = (i - 1) % CONVERSATIONS if i else None
        if conversation in parted:
            continue
        assert prompt == prompt_c
        if ours == theirs:
            assert lengths == lengths_c, f"request {i}: same tokens, other steps"
            continue
        j = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        assert params.temperature > 0, f"request {i}: greedy runs part at token {j}"
        with torch.no_grad():  # transformers' reading of the same GGUF: the reference
            logits = request.getfixturevalue("hf_gguf_model")(
                torch.tensor([prompt + ours[:j]])).logits[0, -1]
        margin = 4 * LOGIT_ERROR * float(logits.abs().max()) / params.temperature
        distance = _boundary_distance(logits, params, j, (ours[j], theirs[j]))
        assert distance < margin, (f"request {i} parts at token {j} ({ours[j]} vs {theirs[j]})"
                                   f" with its draw {distance:.2e} from the boundary")
        parted.add(conversation)


def _assert_pool_whole(llm: LLM) -> None:
    pages = llm.engine.pages
    assert not llm.engine.scheduler.has_work()
    assert pages.num_free == pages.num_pages
    assert not pages._tables and not pages._chains


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_turn_outputs_equal_with_and_without_caching(spec, temperature, request):
    params = SamplingParams(temperature=temperature, max_tokens=NEW_TOKENS, ignore_eos=True,
                            seed=None if temperature == 0 else 7)
    runs = {}
    for caching in (False, True):
        llm = LLM(model="default", spec=spec, spec_policy="fixed", skip_tokenizer_init=True,
                  device="cpu", dtype="float32", max_model_len=256, page_size=16,
                  enable_prefix_caching=caching)
        runs[caching] = _chat(llm, params, seed=1)
        _assert_pool_whole(llm)
        if caching:
            prefix = llm.engine.pages.prefix
            # Turn one reuses the system prompt's pages of whichever request computed them
            # first at most; turn two reuses each conversation's whole first turn.
            assert prefix.hit_tokens >= CONVERSATIONS * (SYSTEM + NEW_TOKENS) // 16 * 16
    _assert_same_answers(runs[False], runs[True], params, request)


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_preemption_and_eviction_in_a_small_pool(spec):
    """Four 110-token requests in a 24-page pool (27 pages wanted): requests are preempted and
    readmitted from the cache, and cached pages are evicted for new ones. Tokens only: a
    readmitted request recomputes less with caching, so its steps differ (a recompute whose
    last token only is left runs as a decode step)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rng = random.Random(3)
    shared = [rng.randrange(200, 20000) for _ in range(48)]
    prompts = [shared + [rng.randrange(200, 20000) for _ in range(60 + 4 * i)]
               for i in range(4)]
    runs = {}
    for caching in (False, True):
        llm = LLM(model="default", spec=spec, spec_policy="fixed", skip_tokenizer_init=True,
                  device="cpu", dtype="float32", max_model_len=256, page_size=16,
                  kv_cache_pages=24, enable_prefix_caching=caching)
        outs = llm.generate(prompts, params)
        runs[caching] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_pool_whole(llm)
        if caching:
            assert llm.engine.pages.prefix.evictions > 0
            assert llm.engine.pages.prefix.hit_tokens > 0
    assert runs[True] == runs[False]


def test_requests_arriving_together_wait_for_the_shared_prefix_and_reuse_it():
    """Three requests on one 70-token system prompt arrive together, with prompts prefilled
    in 32-token chunks: the first computes the prompt's four full pages, the others are
    admitted once it has and reuse them, and every answer is what it is without caching."""
    system, users = _conversation_prompts(seed=5)
    prompts = [system + u for u in users]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = LLM(model="default", spec="none", skip_tokenizer_init=True, device="cpu",
                  dtype="float32", max_model_len=256, page_size=16, max_num_batched_tokens=32,
                  enable_prefix_caching=caching)
        runs[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        _assert_pool_whole(llm)
    assert runs[True] == runs[False]
    assert llm.engine.pages.prefix.hit_tokens == (CONVERSATIONS - 1) * 64
