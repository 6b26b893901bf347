"""The DDTree candidate build as the engine runs it through RowGraphs (levels at the full
budget, then a tree per budget), against the same functions called directly."""

from __future__ import annotations

import torch

from flashtree.graphs.rows import RowGraphs
from flashtree.speculative.tree import (
    BestFirstLevels,
    best_first_levels,
    topk_logprobs,
    tree_from_levels,
)

DEPTH, VOCAB, WIDTH = 5, 50, 7


def levels(logits: torch.Tensor, *, width: int) -> tuple[torch.Tensor, ...]:
    top_lp, top_tok = topk_logprobs(logits, width)
    lv = best_first_levels(top_lp, width)
    return lv.keys, lv.flat, top_tok


def nodes(keys, flat, top_tok, roots, *, budget: int) -> tuple[torch.Tensor, ...]:
    t = tree_from_levels(BestFirstLevels(keys, flat), top_tok, roots, budget)
    return t.tokens, t.parent, t.depth, t.visible


def check_rows_match_direct(device: torch.device, use_cuda_graphs: bool) -> None:
    """Batches of 1..9 rows (padded into buckets 1, 2, 4, 8; 9 runs unpadded) and budgets
    1..WIDTH: the replayed outputs equal the direct calls, row for row, and stay valid after
    later replays of the same bucket."""
    gen = torch.Generator().manual_seed(0)
    level_graphs = RowGraphs(levels, [1, 2, 4, 8], device, use_cuda_graphs)
    node_graphs = RowGraphs(nodes, [1, 2, 4, 8], device, use_cuda_graphs)
    kept = []
    for rows in range(1, 10):
        logits = (torch.randn(rows, DEPTH, VOCAB, generator=gen) * 3).to(device)
        roots = torch.randint(0, VOCAB, (rows,), generator=gen).to(device)
        got = level_graphs(logits, width=WIDTH)
        want = levels(logits, width=WIDTH)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        for budget in range(1, WIDTH + 1):
            got_nodes = node_graphs(*want, roots, budget=budget)
            for g, w in zip(got_nodes, nodes(*want, roots, budget=budget)):
                assert torch.equal(g, w), (rows, budget)
            kept.append((got_nodes[0], got_nodes[0].clone()))
    for returned, copy in kept:
        assert torch.equal(returned, copy), "a later replay overwrote returned outputs"
