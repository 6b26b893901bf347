"""DDTree: the tree builder against brute-force enumeration, the tree forward against causal
forwards of every root-to-node path (transformers), KV compaction, and greedy equivalence."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.speculative.tree import (
    DraftTrees,
    ancestor_mask,
    best_first_levels,
    build_trees_from_topk,
    topk_logprobs,
    tree_from_levels,
)
from tests.tiny import TINY_PROMPTS, save_tiny_qwen3


def build_trees(
    draft_logits: torch.Tensor, roots: torch.Tensor, budget: int, topk_cap: int | None = None
) -> DraftTrees:
    """The engine's tree build from raw drafter logits: draft_logits [R, L, V] of block slots
    1..L, roots [R] bonus tokens; up to `budget` non-root nodes per request."""
    vocab = draft_logits.shape[-1]
    k = min(budget, vocab, topk_cap or vocab)
    return build_trees_from_topk(*topk_logprobs(draft_logits, k), roots, budget)


def _brute_force_top(logp: torch.Tensor, budget: int, cap: int | None) -> set[tuple[int, ...]]:
    """Enumerate every prefix of every depth; keep the `budget` most probable."""
    depth, vocab = logp.shape
    allowed = [set(logp[d].topk(min(cap or vocab, vocab)).indices.tolist()) for d in range(depth)]
    scored = []
    for d in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            if all(t in allowed[i] for i, t in enumerate(prefix)):
                scored.append((sum(float(logp[i, t]) for i, t in enumerate(prefix)), prefix))
    scored.sort(key=lambda x: (-x[0], len(x[1])))
    return {p for _, p in scored[:budget]}


def _tree_prefixes(trees, i: int) -> dict[int, tuple[int, ...]]:
    n = int(trees.num_nodes[i])
    tokens, parent = trees.tokens[i].tolist(), trees.parent[i].tolist()
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for v in range(1, n):
        assert parent[v] < v
        paths[v] = paths[parent[v]] + (tokens[v],)
    return paths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 2])
def test_builder_selects_the_most_probable_prefixes(seed, cap):
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = 1 + seed % 4, 3 + seed % 4
    logits = torch.randn(3, depth, vocab, generator=gen) * 2
    budget = [1, 5, 30][seed % 3]
    trees = build_trees(logits, torch.tensor([7, 8, 9]), budget, topk_cap=cap)
    logp = torch.log_softmax(logits.double(), -1)
    for i in range(3):
        paths = _tree_prefixes(trees, i)
        got = set(paths.values()) - {()}
        expected = _brute_force_top(logp[i], budget, cap)
        assert got == expected
        assert trees.tokens[i, 0] == 7 + i
        for v, path in paths.items():
            assert trees.depth[i, v] == len(path)
        siblings = [(trees.parent[i, v].item(), trees.tokens[i, v].item())
                    for v in range(1, len(paths))]
        assert len(siblings) == len(set(siblings)), "duplicate sibling tokens"


@pytest.mark.parametrize("seed", range(4))
def test_smaller_budgets_from_shared_levels_are_the_best_prefixes(seed):
    """Levels computed once at the largest width give, for every smaller budget, the brute-force
    best prefixes (the engine builds every budget the policy picks from one set of levels)."""
    gen = torch.Generator().manual_seed(seed)
    depth, vocab, width = 3, 4, 12
    logits = torch.randn(2, depth, vocab, generator=gen) * 2
    top_lp, top_tok = topk_logprobs(logits, vocab)
    levels = best_first_levels(top_lp, width)
    logp = torch.log_softmax(logits.double(), -1)
    for budget in (1, 2, 5, width):
        trees = tree_from_levels(levels, top_tok, torch.tensor([3, 4]), budget)
        for i in range(2):
            got = set(_tree_prefixes(trees, i).values()) - {()}
            assert got == _brute_force_top(logp[i], budget, None)


@pytest.mark.parametrize("seed", range(4))
def test_the_nodes_ranked_within_a_budget_are_that_budgets_tree(seed):
    """A walk of the largest tree tells what a smaller budget's tree would have accepted (the
    adaptive policy's acceptance per budget): the nodes of selection rank <= b are the
    brute-force best b prefixes, and every node ranks after its parent."""
    gen = torch.Generator().manual_seed(seed)
    depth, vocab, budget = 4, 5, 40
    logits = torch.randn(3, depth, vocab, generator=gen) * 2
    trees = build_trees(logits, torch.tensor([1, 2, 3]), budget)
    logp = torch.log_softmax(logits.double(), -1)
    for i in range(3):
        paths, rank = _tree_prefixes(trees, i), trees.rank[i].tolist()
        assert sorted(rank) == list(range(budget + 1))
        assert all(rank[v] > rank[int(trees.parent[i, v])] for v in range(1, budget + 1))
        for b in (1, 3, 10, 25):
            within = {paths[v] for v in paths if 0 < rank[v] <= b}
            assert within == _brute_force_top(logp[i], b, None)


@pytest.mark.parametrize("budget", [63, 255])
def test_float32_trees_are_the_float64_trees_up_to_rounding(budget):
    """The engine scores prefixes in float32; a float64 build of the same drafts selects the
    same prefixes but where keys at the selection's edge lie within float32 rounding (at most
    16 roundings of a sum of 15 log-probabilities and a normaliser), node for node."""
    gen = torch.Generator().manual_seed(budget)
    rows, depth, k = 6, 15, 16
    logits = torch.randn(rows, depth, 4000, generator=gen) * 3
    logp = torch.log_softmax(logits.double(), -1)
    lp64, tok64 = logp.topk(k, dim=-1)
    lp32, tok32 = topk_logprobs(logits, k)
    assert lp32.dtype == torch.float32 and torch.equal(tok32, tok64)
    roots = torch.arange(rows)
    t32 = build_trees_from_topk(lp32, tok32, roots, budget)
    t64 = build_trees_from_topk(lp64, tok64, roots, budget)
    exact = 0
    for i in range(rows):
        paths32, paths64 = _tree_prefixes(t32, i), _tree_prefixes(t64, i)
        assert len(paths32) == len(paths64) == budget + 1
        score = {p: sum(logp[i, d, t].item() for d, t in enumerate(p))
                 for p in set(paths32.values()) | set(paths64.values())}
        edge = min(score[p] for p in paths64.values() if p)
        tol = 16 * 2**-24 * (1 + abs(edge))
        for p in set(paths32.values()) ^ set(paths64.values()):
            assert abs(score[p] - edge) <= tol, (i, p, score[p], edge)
        if paths32 == paths64:  # node for node: same tokens, parents and depths
            exact += 1
            for name in ("tokens", "parent", "depth"):
                assert torch.equal(getattr(t32, name)[i], getattr(t64, name)[i]), name
    assert exact >= rows - 1  # near-ties at the edge are rare


def test_certain_drafts_keep_parents_before_children():
    """A drafter sure of every slot gives log-probabilities that round to 0 in float32: keys tie
    along the path unless each child is kept below its parent, and a budget would then select
    deep nodes without their parents."""
    logits = torch.full((1, 6, 5), -60.0)
    logits[0, :, 2] = 60.0
    for budget in (1, 3, 6):
        trees = build_trees(logits, torch.tensor([0]), budget)
        assert _tree_prefixes(trees, 0)[budget] == (2,) * budget  # the chain, in order


@pytest.mark.parametrize("budget, depth", [(30, 3), (63, 4)])
def test_masked_drafts_never_select_a_node_without_its_parent(budget, depth):
    """A grammar masks most tokens to -inf: with fewer possible prefixes than the budget the
    tree takes impossible ones too, each still one level below its parent (a key kept below
    -inf would tie with it)."""
    from tests.speculative.tree_cases import drafts

    top_lp, top_tok = drafts("masked", 3, depth, 64, 16, seed=budget + depth)
    trees = build_trees_from_topk(top_lp, top_tok, torch.arange(3), budget)
    child = trees.depth[:, 1:]
    assert torch.equal(child, trees.depth.gather(1, trees.parent[:, 1:]) + 1)


def _naive_ancestors(parents: list[int], v: int) -> set[int]:
    seen = {v}
    while v:
        v = parents[v]
        seen.add(v)
    return seen


@pytest.mark.parametrize("n", [1, 2, 17, 40])
def test_ancestor_mask_on_deep_trees(n):
    """Pointer doubling against walking up the parents, on random trees and a chain of n."""
    rng = random.Random(n)
    trees = [[0] + [rng.randrange(v) for v in range(1, n)], [0] + list(range(n - 1))]
    vis = ancestor_mask(torch.tensor(trees))
    for r, parents in enumerate(trees):
        for v in range(n):
            assert set(torch.nonzero(vis[r, v]).flatten().tolist()) == _naive_ancestors(parents, v)


def test_budget_equal_to_block_is_not_always_a_chain():
    # q_1 = [0.55, 0.45, ...], later positions near-uniform: the second depth-1 token beats
    # any depth-2 node, so a budget of L gives a bushy tree.
    logits = torch.log(torch.tensor([[[0.55, 0.45, 1e-9, 1e-9]] + [[0.3, 0.3, 0.2, 0.2]] * 2]))
    trees = build_trees(logits, torch.tensor([0]), budget=3)
    assert sorted(trees.depth[0].tolist()) == [0, 1, 1, 2]


def test_visibility_is_ancestors_and_self():
    parent = torch.tensor([[0, 0, 0, 1, 3, 2]])
    vis = ancestor_mask(parent)[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for v, anc in expected.items():
        assert set(torch.nonzero(vis[v]).flatten().tolist()) == anc
    chain = ancestor_mask(torch.tensor([[0, 0, 1, 2, 3]]))[0]
    assert torch.equal(chain, torch.ones(5, 5, dtype=torch.bool).tril())


VOCAB = 11


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("t"), seed=2, vocab_size=VOCAB,
                           initializer_range=0.3)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _random_tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """Random topological tree of n nodes with unique sibling tokens."""
    parents, tokens = [0], [rng.randrange(VOCAB)]
    for v in range(1, n):
        p = rng.randrange(v)
        used = {tokens[c] for c in range(1, v) if parents[c] == p}
        tokens.append(rng.choice([t for t in range(VOCAB) if t not in used]))
        parents.append(p)
    return tokens, parents


def _depths(parents: list[int]) -> list[int]:
    depth = [0]
    for v in range(1, len(parents)):
        depth.append(depth[parents[v]] + 1)
    return depth


def _verify(llm: LLM, seq, tokens, parents) -> torch.Tensor:
    engine = llm.engine
    start = seq.num_computed
    engine.pages.reserve(seq.seq_id, start + len(tokens))
    visible = ancestor_mask(torch.tensor([parents]))[0]
    item = BatchItem(seq.seq_id, start, tokens, all_logits=True,
                     positions=[start + d for d in _depths(parents)], visible=visible)
    logits, _ = engine.runner.forward(Mode.VERIFY, [item])
    return logits


def _prefilled(llm: LLM, prompt: list[int]):
    seq = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=50))
    llm.engine.step()
    return seq


def test_node_logits_equal_causal_path_logits_and_siblings_are_isolated(target_dir, hf_target):
    llm = LLM(model=str(target_dir), device="cpu", skip_tokenizer_init=True, page_size=4)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    seq = _prefilled(llm, prompt)
    committed = prompt + seq.output_ids[:-1]
    tokens, parents = _random_tree(rng, 14)
    tokens[0] = seq.output_ids[-1]
    logits = _verify(llm, seq, tokens, parents)
    for v in range(len(tokens)):
        path, node = [], v
        while True:
            path.append(tokens[node])
            if node == 0:
                break
            node = parents[node]
        with torch.no_grad():
            ref = hf_target(torch.tensor([committed + path[::-1]])).logits[0, -1]
        assert torch.allclose(logits[v], ref, atol=1e-5), (v, (logits[v] - ref).abs().max())

    # Change one leaf-less sibling's token: nodes outside its subtree keep their logits.
    changed = next(v for v in range(2, len(tokens)) if v not in parents)
    other = tokens.copy()
    used = {tokens[c] for c in range(1, len(tokens)) if parents[c] == parents[changed]}
    other[changed] = next(t for t in range(VOCAB) if t not in used)
    llm.engine.pages.set_length(seq.seq_id, seq.num_computed)
    logits2 = _verify(llm, seq, other, parents)
    keep = [v for v in range(len(tokens)) if v != changed]
    assert torch.equal(logits[keep], logits2[keep])
    assert not torch.allclose(logits[changed], logits2[changed])


@pytest.mark.parametrize("path_kind", ["root", "leaf", "random"])
def test_kv_compaction_equals_fresh_prefill(target_dir, hf_target, path_kind):
    llm = LLM(model=str(target_dir), device="cpu", skip_tokenizer_init=True, page_size=4)
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(6)]
    seq = _prefilled(llm, prompt)
    tokens, parents = _random_tree(rng, 12)
    tokens[0] = seq.output_ids[-1]
    _verify(llm, seq, tokens, parents)
    leaf = max(range(len(tokens)), key=lambda v: _depths(parents)[v])
    end = {"root": 0, "leaf": leaf, "random": rng.randrange(len(tokens))}[path_kind]
    path = [end]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    start = seq.num_computed
    llm.engine.pages.keep(llm.engine.cache, [(seq.seq_id, start, path)])
    assert llm.engine.pages.lengths[seq.seq_id] == start + len(path)
    committed = prompt + seq.output_ids[:-1] + [tokens[v] for v in path]
    next_token = rng.randrange(VOCAB)
    item = BatchItem(seq.seq_id, start + len(path), [next_token])
    llm.engine.pages.reserve(seq.seq_id, start + len(path) + 1)
    logits, _ = llm.engine.runner.forward(Mode.DECODE, [item])
    with torch.no_grad():
        ref = hf_target(torch.tensor([committed + [next_token]])).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=1e-5)


PROMPTS = TINY_PROMPTS


@pytest.mark.parametrize("budget, cap", [(3, None), (7, None), (24, None), (24, 2)])
def test_ddtree_greedy_equals_plain(small_pair, budget, cap):
    target, drafter = small_pair
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(target), device="cpu", skip_tokenizer_init=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
    tree = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
               spec="ddtree", tree_budget=budget,
               topk_cap=cap, device="cpu", skip_tokenizer_init=True, page_size=4)
    outs = tree.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    lengths = [x for o in outs for x in o.outputs[0].spec_accept_lengths]
    assert max(lengths) >= 3, "no multi-token accepts exercised"
    assert tree.engine.pages.num_free == tree.engine.pages.num_pages

    # Stops landing inside an accepted path end the output exactly where plain decoding does.
    for k, o in enumerate(outs):
        done = 1
        for length in o.outputs[0].spec_accept_lengths:
            if length >= 3:
                cut = done + 1
                stop = expected[k][cut - 1]
                got = tree.generate([PROMPTS[k]], SamplingParams(
                    temperature=0, max_tokens=40, stop_token_ids=[stop]))[0].outputs[0]
                assert got.token_ids == expected[k][: expected[k].index(stop) + 1]
                short = tree.generate([PROMPTS[k]], SamplingParams(
                    temperature=0, max_tokens=cut, ignore_eos=True))[0].outputs[0]
                assert short.token_ids == expected[k][:cut]
                break
            done += length
    assert tree.engine.pages.num_free == tree.engine.pages.num_pages


def test_ddtree_budget_raises_acceptance(small_pair):
    """A larger tree commits more tokens per target forward, both giving plain decoding's
    tokens; a one-node tree commits that node and the bonus at most, and the commits of each
    request add up to its tokens after the prefill's."""
    target, drafter = small_pair
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(target), device="cpu", skip_tokenizer_init=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
    mean, commits = {}, {}
    for budget in (1, 24):
        llm = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
                  spec="ddtree", tree_budget=budget,
                  device="cpu", skip_tokenizer_init=True)
        outs = llm.generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in outs] == expected, budget
        per_request = [o.outputs[0].spec_accept_lengths for o in outs]
        assert [sum(n) for n in per_request] == [len(t) - 1 for t in expected], budget
        commits[budget] = [x for n in per_request for x in n]
        mean[budget] = sum(commits[budget]) / len(commits[budget])
    assert set(commits[1]) == {1, 2}, commits[1]
    assert mean[24] > mean[1] * 1.2


def test_surrogate_objective_equals_expected_acceptance():
    """sum over tree nodes of q(u) equals E_{y ~ Q}[longest accepted prefix] (Monte Carlo)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 3, 4, generator=gen) * 1.5
    trees = build_trees(logits, torch.tensor([0]), budget=9)
    q = torch.softmax(logits[0].double(), -1)
    paths = set(_tree_prefixes(trees, 0).values()) - {()}
    surrogate = sum(math.prod(float(q[i, t]) for i, t in enumerate(p)) for p in paths)
    samples = torch.multinomial(q, 200_000, replacement=True, generator=gen).T  # [M, L]
    alpha = torch.zeros(samples.shape[0])
    alive = torch.ones(samples.shape[0], dtype=torch.bool)
    for d in range(1, 4):
        prefix_in = torch.tensor([tuple(row[:d].tolist()) in paths for row in samples])
        alive &= prefix_in
        alpha += alive
    se = alpha.std() / math.sqrt(len(alpha))
    assert abs(alpha.mean() - surrogate) < 3 * se + 1e-9


def test_tree_forced_to_a_chain_equals_dflash(small_pair):
    target, drafter = small_pair
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    chain = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
                spec="dflash", device="cpu",
                skip_tokenizer_init=True).generate(PROMPTS, sp)
    forced = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
                 spec="ddtree", tree_budget=7,
                 topk_cap=1, device="cpu", skip_tokenizer_init=True).generate(PROMPTS, sp)
    for a, b in zip(chain, forced):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # Identical steps until the chain's last blocks shrink near max_tokens.
        assert a.outputs[0].spec_accept_lengths[:20] == b.outputs[0].spec_accept_lengths[:20]


def test_ddtree_accepts_at_least_the_chain(small_pair):
    target, drafter = small_pair
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    means = {}
    for spec in ("dflash", "ddtree"):
        llm = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
                  spec=spec, device="cpu",
                  skip_tokenizer_init=True)
        lengths = [x for o in llm.generate(PROMPTS, sp) for x in o.outputs[0].spec_accept_lengths]
        means[spec] = sum(lengths) / len(lengths)
        assert llm.engine.pages.num_free == llm.engine.pages.num_pages
    assert means["ddtree"] >= means["dflash"]
