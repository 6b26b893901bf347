"""The one-launch DDTree build (`speculative/tree_kernel.py`) on CPU through Triton's interpreter:
its per-depth levels against brute-force enumeration of every prefix; its trees node for node
against an independent reference of its selection and against the torch build
(`tree.build_trees_from_topk`) where no keys tie; and on drafts full of ties (bf16-rounded,
uniform, certain, grammar-masked) what every best-first tree satisfies and the torch build's
multiset of keys. Skipped where triton is not installed (a failure under CI=true) and where CUDA
exists: there tests/gpu/test_tree_kernel_cuda.py runs the kernel compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from flashtree.speculative.tree import real_entries, tree_nodes  # noqa: E402
from flashtree.speculative.tree_kernel import (  # noqa: E402
    build_trees_in_one_launch,
    launch_tree_kernel,
)
from tests.speculative.tree_cases import (  # noqa: E402
    brute_force_levels,
    check_against_torch,
    check_tree,
    drafts,
    reference,
)


@pytest.mark.parametrize("kind", ["float32", "bf16"])
@pytest.mark.parametrize("depth, k, width", [(4, 4, 5), (4, 4, 40), (5, 3, 100), (3, 5, 2),
                                             (3, 7, 9)])
def test_levels_are_each_depths_best_prefixes(kind, depth, k, width):
    """Each depth keeps the keys of the best `width` of all K^d prefixes, each an existing
    prefix (its parent's key plus its token's log-probability), none twice, ties to the lower
    flat index parent_rank * K + token."""
    top_lp, top_tok = drafts(kind, 2, depth, k + 3, k, seed=width)
    levels = launch_tree_kernel(top_lp, top_tok, torch.arange(2), width)
    for i in range(2):
        parent_keys = torch.zeros(1)
        for d, best in enumerate(brute_force_levels(top_lp[i], width)):
            n = len(best)
            keys, flat = levels.keys[i, d, :n], levels.flat[i, d, :n].long()
            assert torch.equal(keys, best), (i, d)
            assert len(flat.unique()) == n and (flat // k < len(parent_keys)).all()
            assert torch.equal(parent_keys[flat // k] + top_lp[i, d, flat % k], keys)
            ties = keys[1:] == keys[:-1]
            assert (flat[1:][ties] > flat[:-1][ties]).all(), (i, d, "ties not in flat order")
            parent_keys = keys


@pytest.mark.parametrize("budget, depth, k", [(1, 15, 16), (3, 15, 16), (63, 15, 16),
                                              (255, 15, 16), (100, 4, 5), (20, 2, 3)])
def test_float32_trees_equal_the_torch_build(budget, depth, k):
    """Continuous drafts (no ties): the torch build's trees node for node, at the engine's
    shape (15 depths, the top 16; K > budget for the small ones), at budgets and K that are not
    powers of two, and (20, 2, 3) with fewer prefixes (3 + 9) than the budget."""
    top_lp, top_tok = drafts("float32", 3, depth, 64, k, seed=budget)
    roots = torch.tensor([5, 6, 7])
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    assert nodes.shape == (3, 4, min(budget, real_entries(depth, k, budget)) + 1)
    assert nodes.dtype == torch.int64 and visible.dtype == torch.bool
    assert check_against_torch(nodes, visible, top_lp, top_tok, roots, budget) == 3


@pytest.mark.parametrize("budget, rows", [(3, 3), (63, 3), (255, 2)])
def test_bf16_drafts_tie_and_keep_the_best_keys(budget, rows):
    """bf16-rounded drafter logits: many keys tie, so the torch build may pick other nodes of
    the same keys; the trees still hold the best keys (the torch build's multiset) and every
    best-first tree's invariants, and the reference's choice among ties node for node."""
    top_lp, top_tok = drafts("bf16", rows, 15, 64, 16, seed=budget)
    roots = torch.arange(rows)
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    check_against_torch(nodes, visible, top_lp, top_tok, roots, budget)
    assert any(tied for tied in reference(top_lp, top_tok, roots, budget)[1]), "no ties"


@pytest.mark.parametrize("budget", [3, 63])
def test_uniform_drafts_fill_depths_in_flat_order(budget):
    """All siblings tie: whole depths first, the last one's prefixes in (parent, token) order."""
    top_lp, top_tok = drafts("uniform", 2, 15, 64, 16, seed=budget)
    roots = torch.tensor([1, 2])
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    check_against_torch(nodes, visible, top_lp, top_tok, roots, budget)
    first = min(budget, 16)
    second = torch.arange(budget - first)  # depth-2 nodes: flat indices 0, 1, ...
    for i in range(2):
        tokens, parents, depths, _ = nodes[i]
        assert depths.tolist() == [0] + [1] * first + [2] * len(second)
        assert torch.equal(tokens[1:first + 1], top_tok[i, 0, :first])
        assert torch.equal(parents[first + 1:], 1 + second // 16)
        assert torch.equal(tokens[first + 1:], top_tok[i, 1, second % 16])


@pytest.mark.parametrize("budget, depth, vocab", [(1, 6, 5), (3, 6, 5), (6, 6, 5), (20, 6, 5),
                                                  (63, 15, 64)])
def test_certain_drafts_keep_parents_before_children(budget, depth, vocab):
    """Log-probabilities that round to 0.0: the certain chain's keys all tie at 0 (the torch
    build keeps each child below its parent instead); the chain ranks first, in order."""
    top_lp, top_tok = drafts("certain", 2, depth, vocab, min(vocab, 16), seed=budget)
    roots = torch.tensor([3, 4])
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    check_against_torch(nodes, visible, top_lp, top_tok, roots, budget)
    chain = min(budget, depth)
    for i in range(2):
        tokens, parents, _, ranks = nodes[i]
        by_rank = ranks.argsort()[:chain + 1]  # the root, then the chain's nodes
        assert torch.equal(tokens[by_rank[1:]], top_tok[i, :chain, 0])
        assert torch.equal(parents[by_rank[1:]], by_rank[:-1])
    if budget <= depth:  # a chain: no choice among ties
        assert torch.equal(nodes, tree_nodes(top_lp, top_tok, roots, budget=budget)[0])


@pytest.mark.parametrize("budget, depth", [(30, 3), (63, 4), (63, 15)])
def test_masked_drafts_place_impossible_prefixes_last(budget, depth):
    """Grammar-masked drafts (1 to 3 tokens allowed per depth, the rest -inf): with fewer
    possible prefixes than the budget the tree ends in -inf nodes, every one under its parent."""
    top_lp, top_tok = drafts("masked", 3, depth, 64, 16, seed=budget + depth)
    roots = torch.arange(3)
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    assert torch.equal(nodes, reference(top_lp, top_tok, roots, budget)[0])
    keys = check_tree(nodes, visible, top_lp, top_tok, roots)
    impossible = [sum(k == -torch.inf for k in row) for row in keys]
    assert (max(impossible) > 0) == (depth < 15), impossible
