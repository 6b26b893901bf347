"""Random-weight pairs built in memory (flashtree/bench/random_pair.py) and LLM.from_modules:
the target is decisive and follows its permutation, speculative outputs equal plain decoding
on it (and, with a drafter edited to agree, commit the blocks a brute-force walk predicts),
the drafter's logits spread as asked, and from_modules refuses what it cannot run."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.random_pair import TINY, random_drafter, random_target, top2_gaps
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.speculative.proposer import ContextRows

BLOCK = 8
VOCAB = TINY["vocab_size"]
_rng = random.Random(0)
# Token ids only; the drafter's mask token (the last id) is left out.
PROMPTS = [[_rng.randrange(VOCAB - 1) for _ in range(n)] for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def pair():
    target, cfg = random_target(TINY, torch.float32, "cpu", seed=1)
    drafter = random_drafter(cfg, TINY, torch.float32, "cpu", layers=2, block_size=BLOCK,
                             logit_std=10.0, seed=2)
    return target, cfg, drafter


def _llm(pair, spec: str, **options) -> LLM:
    target, cfg, drafter = pair
    return LLM.from_modules(target, cfg, drafter, spec=spec, max_num_seqs=4, max_model_len=512,
                            **options)


def _successor(target) -> torch.Tensor:
    """[V] int64: the LM head row that is each token's embedding (the permutation's image)."""
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    succ = (emb @ head.T).argmax(-1)  # the matching row has score |e|^2, far above the rest
    assert torch.equal(head[succ], emb), "lm_head is not the embedding table reordered"
    assert torch.equal(succ.sort().values, torch.arange(emb.shape[0])), "not a permutation"
    return succ


def test_target_is_decisive_and_follows_its_permutation(pair):
    target, cfg, _ = pair
    llm = _llm(pair, "none")
    succ = _successor(target)
    tokens = [_rng.randrange(VOCAB) for _ in range(96)]
    sid = 10**6
    llm.engine.pages.reserve(sid, len(tokens))
    try:
        logits, _ = llm.engine.runner.forward(
            Mode.PREFILL, [BatchItem(sid, 0, tokens, all_logits=True)])
    finally:
        llm.engine.pages.free(sid)
    assert logits.shape == (len(tokens), VOCAB)
    gaps = top2_gaps(logits)
    assert gaps.min().item() > cfg.hidden_size / 4, gaps.min().item()
    top = logits.argmax(-1)
    # The greedy row of the LM head is the current token's embedding, at every position.
    head, emb = target.lm_head.weight, target.embed_tokens.weight
    assert torch.equal(head[top], emb[torch.tensor(tokens)])
    assert top.tolist() == succ[torch.tensor(tokens)].tolist()


def test_top2_gaps_is_top1_minus_top2():
    logits = torch.tensor([[1.0, 5.0, 3.0], [-2.0, -1.0, -7.0]])
    assert top2_gaps(logits).tolist() == [2.0, 1.0]


def test_speculative_outputs_equal_plain_and_follow_the_permutation(pair):
    target = pair[0]
    succ = _successor(target)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in _llm(pair, "none").generate(PROMPTS, params)]
    for prompt, out in zip(PROMPTS, plain):
        assert len(out) == 30
        chain = [prompt[-1]] + out
        assert out == [succ[t].item() for t in chain[:-1]]
    for spec in ("dflash", "ddtree"):
        llm = _llm(pair, spec, spec_policy="fixed")
        outs = llm.generate(PROMPTS, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == plain, spec
        # The speculative path ran: every decode step verified drafts (one round per request
        # and step), and the steps' commits account for every token after the prefill's.
        lengths = [o.outputs[0].spec_accept_lengths for o in outs]
        assert [sum(n) for n in lengths] == [len(out) - 1 for out in plain], (spec, lengths)
        stats = llm.engine.spec_stats
        assert stats.num_drafts == sum(map(len, lengths)), (spec, stats, lengths)


MASK = VOCAB - 1  # the random drafter's mask token
FIXED = 7  # the token that the agreeing pair's target follows by itself and its drafter drafts


@pytest.fixture(scope="module")
def agreeing_pair(pair):
    """The pair edited so that the drafter agrees with the target on one token: the target's
    LM head takes FIXED's embedding as its row FIXED (FIXED is followed by FIXED; the row that
    had it takes FIXED's old row, still a permutation); the drafter's layers write nothing (its
    output projections zero), so each slot scores its own input's embedding, and the mask
    token's embedding is FIXED's: every draft is FIXED."""
    target, cfg, drafter = copy.deepcopy(pair)
    with torch.no_grad():
        head, emb = target.lm_head.weight, target.embed_tokens.weight
        after = _successor(target)[FIXED].item()
        head[[FIXED, after]] = head[[after, FIXED]].clone()
        emb[MASK] = emb[FIXED]
        for name, p in drafter.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    return target, cfg, drafter


def _commits_of_fixed_drafts(out: list[int]) -> list[int]:
    """Brute force: the tokens each target forward commits when every draft is FIXED and the
    target decodes `out` (its first token from the prefill): the drafts matching `out` in a
    row, up to BLOCK - 1, then the target's own token; the last step cut at the length."""
    commits, done = [], 1
    while done < len(out):
        accepted = 0
        while accepted < BLOCK - 1 and done + accepted < len(out) and (
                out[done + accepted] == FIXED):
            accepted += 1
        commits.append(min(accepted + 1, len(out) - done))
        done += commits[-1]
    return commits


def test_drafts_that_agree_commit_whole_blocks(agreeing_pair):
    """Plain decoding of a prompt ending in FIXED repeats FIXED; speculation, whose drafts are
    all FIXED, returns plain decoding's tokens while committing whole blocks per target
    forward, which plain decoding never does; the other prompts' FIXED drafts are rejected."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [PROMPTS[2] + [FIXED], PROMPTS[1], PROMPTS[3]]
    plain = _llm(agreeing_pair, "none").generate(prompts, params)
    tokens = [list(o.outputs[0].token_ids) for o in plain]
    assert tokens[0] == [FIXED] * 30
    assert all(o.outputs[0].spec_accept_lengths == [1] * 29 for o in plain)
    expected = [_commits_of_fixed_drafts(out) for out in tokens]
    assert expected[0] == [BLOCK] * 3 + [5]
    for spec in ("dflash", "ddtree"):
        outs = _llm(agreeing_pair, spec, spec_policy="fixed").generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == tokens, spec
        assert [o.outputs[0].spec_accept_lengths for o in outs] == expected, spec


WIDE = dict(TINY, vocab_size=4096)  # vocab >> hidden: the sample std over the vocab is tight


@pytest.fixture(scope="module")
def wide_target():
    return random_target(WIDE, torch.float32, "cpu", seed=4)


def _draft_logits(target, cfg, logit_std: float, ctx: int = 24) -> torch.Tensor:
    """One block drafted by a fresh random drafter through the engine's proposer, after
    injecting `ctx` rows of random target features: [BLOCK - 1, V] float32."""
    drafter = random_drafter(cfg, WIDE, torch.float32, "cpu", layers=2, block_size=BLOCK,
                             logit_std=logit_std, seed=3)
    llm = LLM.from_modules(target, cfg, drafter, spec="dflash", spec_policy="fixed",
                           max_num_seqs=4, max_model_len=512)
    prop, pages, sid = llm.engine.proposer, llm.engine.pages, 10**6
    pages.reserve(sid, ctx + BLOCK)
    try:
        gen = torch.Generator().manual_seed(0)
        feats = torch.randn(ctx, drafter.fc.in_features, generator=gen)
        prop.inject([ContextRows(feats, ((sid, 0, ctx),))])
        logits = prop.draft_logits([(sid, ctx, 7, BLOCK)])
    finally:
        pages.free(sid)
    assert logits.shape == (BLOCK - 1, cfg.vocab_size)
    return logits


@pytest.mark.parametrize("logit_std", [3.0, 10.0])
def test_drafter_logits_spread_with_the_asked_std(wide_target, logit_std):
    stds = _draft_logits(*wide_target, logit_std).std(dim=-1)
    # 4096 logits per row: sampling error about 1%; the self-match below adds about 1%.
    assert ((stds / logit_std - 1).abs() < 0.05).all(), stds.tolist()


def test_drafter_top_token_is_not_a_fixed_outlier(wide_target):
    target, cfg = wide_target
    logit_std = 10.0
    logits = _draft_logits(target, cfg, logit_std)
    # N(0, logit_std^2) over 4096 tokens: the max is about 3.6 std, above 6 std almost never.
    assert logits.max().item() < 6 * logit_std, logits.max().item()


def test_from_modules_defaults_and_refusals(pair):
    target, cfg, drafter = pair
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM.from_modules(target, cfg, drafter, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        LLM.from_modules(target, cfg, None, spec="dflash")
    with pytest.raises(ValueError, match="needs a drafter"):
        LLM.from_modules(target, cfg, spec="ddtree")
    with_drafter = LLM.from_modules(target, cfg, drafter, max_num_seqs=2, max_model_len=128)
    assert with_drafter.spec == "ddtree" and with_drafter.engine.proposer is not None
    assert with_drafter.tokenizer is None
    assert with_drafter.dtype == torch.float32 and with_drafter.device.type == "cpu"
    without = LLM.from_modules(target, cfg, max_num_seqs=2, max_model_len=128)
    assert without.spec == "none" and without.engine.proposer is None
    # Token ids only: text prompts need a tokenizer.
    with pytest.raises(ValueError, match="token ids"):
        without.generate("hello", SamplingParams(max_tokens=2))
