"""Cases for the one-launch DDTree build (`speculative/tree_kernel.py`), shared by the CPU
interpreter test and tests/gpu/: drafts of several kinds, an independent reference of the
selection the kernel documents (per depth the best W pairs, then the best `budget` entries, ties
to the lower index, by torch's stable sorts), brute-force levels, and the checks of a tree."""

from __future__ import annotations

import torch

from flashtree.speculative.tree import ancestor_mask, topk_logprobs, tree_nodes

DRAFTS = ("float32", "bf16", "uniform", "certain", "masked")


def drafts(kind: str, rows: int, depth: int, vocab: int, k: int, seed: int,
           device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(top_lp [rows, depth, k] float32, top_tok) from drafter logits of one kind: float32
    (no ties), bf16-rounded (many ties), uniform (all siblings tie), certain (one token per
    depth, its log-probability rounds to 0.0) or masked (a random number of tokens allowed,
    the rest -inf, as a grammar leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, depth, vocab)
    logits = torch.randn(shape, generator=gen) * 3
    if kind == "bf16":
        logits = (logits * 2 / 3).bfloat16()
    elif kind == "uniform":
        logits = torch.zeros(shape)
    elif kind == "certain":
        logits = torch.full(shape, -60.0)
        logits.scatter_(2, torch.randint(vocab, (rows, depth, 1), generator=gen), 60.0)
    elif kind == "masked":
        allowed = torch.randint(1, 4, (rows, depth, 1), generator=gen)
        ranked = torch.rand(shape, generator=gen).argsort(-1).argsort(-1)
        logits = logits.masked_fill(ranked >= allowed, -torch.inf)
    top_lp, top_tok = topk_logprobs(logits.to(device), k)
    return top_lp.contiguous(), top_tok.contiguous()


def brute_force_levels(top_lp: torch.Tensor, width: int) -> list[torch.Tensor]:
    """top_lp [L, K] of one row -> per depth the best `width` keys of ALL K^(d+1) prefixes
    (float32 sums from the root down, as the kernel adds), descending."""
    keys, levels = torch.zeros(1), []
    for lp in top_lp.cpu():
        keys = (keys[:, None] + lp[None, :]).flatten()
        levels.append(keys.sort(descending=True).values[:width])
    return levels


def reference_row(top_lp: torch.Tensor, top_tok: torch.Tensor, root: int, budget: int
                  ) -> tuple[torch.Tensor, bool]:
    """One row's nodes [4, N] (tokens, parents, depths, ranks) as the kernel defines them, and
    whether keys tie where the selection looks (then the torch build, whose top-k orders ties
    as it likes, may pick other nodes of the same keys)."""
    top_lp, top_tok = top_lp.cpu(), top_tok.cpu()
    k = top_lp.shape[-1]
    prev, keys, flats, looked_at = torch.zeros(1), [], [], []
    for lp in top_lp:
        cand = (prev[:, None] + lp[None, :]).flatten()  # flat = parent rank * K + token
        flat = torch.sort(cand, descending=True, stable=True).indices[:budget]
        prev = cand[flat]
        keys.append(prev)
        flats.append(flat)
        looked_at.append(cand)
    entries = torch.cat(keys)  # depth-major
    n_sel = min(budget, len(entries))
    chosen = torch.sort(entries, descending=True, stable=True).indices[:n_sel]  # rank order
    depth_of = torch.cat([torch.full((len(f),), d) for d, f in enumerate(flats)])
    rank_in_depth = torch.cat([torch.arange(len(f)) for f in flats])
    node_of = {int(e): v + 1 for v, e in enumerate(chosen.sort().values)}
    nodes = torch.zeros(4, n_sel + 1, dtype=torch.long)
    nodes[0, 0] = root
    for rank, e in enumerate(chosen.tolist(), start=1):
        d, r = int(depth_of[e]), int(rank_in_depth[e])
        flat = int(flats[d][r])
        parent = 0 if d == 0 else node_of[sum(map(len, keys[:d - 1])) + flat // k]
        nodes[:, node_of[e]] = torch.tensor([int(top_tok[d, flat % k]), parent, d + 1, rank])
    cut = entries[chosen[-1]]
    near = torch.cat(looked_at)
    near = near[near >= cut]
    return nodes, len(near.unique()) < len(near)


def reference(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, budget: int
              ) -> tuple[torch.Tensor, list[bool]]:
    """`reference_row` of every row: ([R, 4, N] nodes, per row whether keys tie)."""
    rows = [reference_row(top_lp[i], top_tok[i], int(roots[i]), budget)
            for i in range(len(roots))]
    return torch.stack([n for n, _ in rows]), [t for _, t in rows]


def path_keys(nodes: torch.Tensor, top_lp: torch.Tensor, top_tok: torch.Tensor) -> list[float]:
    """One row's node keys (root 0): the float32 sum of its path's log-probabilities, from the
    root down. nodes [4, N]; top_lp, top_tok [L, K]."""
    tokens, parents, depths, _ = nodes.cpu().tolist()
    keys = [torch.tensor(0.0)]
    for v in range(1, len(tokens)):
        at = (top_tok[depths[v] - 1].cpu() == tokens[v]).nonzero()
        assert len(at) == 1, f"node {v}: token {tokens[v]} is not a top-k token of its depth"
        keys.append(keys[parents[v]] + top_lp[depths[v] - 1, int(at)].cpu())
    return [float(x) for x in keys]


def check_tree(nodes: torch.Tensor, visible: torch.Tensor, top_lp: torch.Tensor,
               top_tok: torch.Tensor, roots: torch.Tensor) -> list[list[float]]:
    """What any best-first tree satisfies, ties or not -> every row's node keys. nodes
    [R, 4, N], visible [R, N, N]."""
    nodes, visible = nodes.cpu(), visible.cpu()
    tokens, parents, depths, ranks = nodes.unbind(1)
    assert torch.equal(visible, ancestor_mask(parents))
    assert torch.equal(tokens[:, 0], roots.cpu()) and not depths[:, 0].any()
    all_keys = []
    for i in range(len(nodes)):
        keys = path_keys(nodes[i], top_lp[i], top_tok[i])
        n = len(keys)
        for v in range(1, n):
            p = int(parents[i, v])
            assert p < v and depths[i, v] == depths[i, p] + 1, (i, v, p)
            assert depths[i, v] >= depths[i, v - 1], f"row {i}: not depth-major at node {v}"
            assert keys[v] <= keys[p], (i, v, keys[v], keys[p])
            assert ranks[i, v] > ranks[i, p], (i, v, p)
        assert sorted(ranks[i].tolist()) == list(range(n))
        by_rank = [keys[v] for v in ranks[i].argsort().tolist()]
        assert by_rank == sorted(by_rank, reverse=True), f"row {i}: ranks do not order the keys"
        siblings = list(zip(parents[i, 1:].tolist(), tokens[i, 1:].tolist()))
        assert len(siblings) == len(set(siblings)), f"row {i}: a token twice under one parent"
        all_keys.append(keys)
    return all_keys


def check_against_torch(nodes: torch.Tensor, visible: torch.Tensor, top_lp: torch.Tensor,
                        top_tok: torch.Tensor, roots: torch.Tensor, budget: int) -> int:
    """The kernel's trees equal the reference node for node, hold `check_tree`, have the torch
    build's multiset of keys, and equal the torch build node for node on rows without ties
    -> the number of such rows."""
    want, tied = reference(top_lp, top_tok, roots, budget)
    assert torch.equal(nodes.cpu(), want)
    keys = check_tree(nodes, visible, top_lp, top_tok, roots)
    torch_nodes, torch_visible = tree_nodes(top_lp, top_tok, roots, budget=budget)
    torch_keys = check_tree(torch_nodes, torch_visible, top_lp, top_tok, roots)
    assert [sorted(k) for k in keys] == [sorted(k) for k in torch_keys]
    for i in (i for i, t in enumerate(tied) if not t):
        assert torch.equal(nodes[i].cpu(), torch_nodes[i].cpu()), f"row {i}"
        assert torch.equal(visible[i].cpu(), torch_visible[i].cpu()), f"row {i}"
    return tied.count(False)
