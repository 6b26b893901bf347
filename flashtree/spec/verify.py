"""Candidates for one verify forward (a chain or a tree) and the walk that accepts them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Candidates:
    """One request's verify input: node 0 is the root (the bonus token), node order is
    topological. `children[v]` maps a token to the child of v that carries it."""

    tokens: list[int]  # [n] node tokens
    children: list[dict[int, int]]
    parents: list[int]  # [n] parent node of each node; the root points at itself (0)
    positions: list[int] | None = None  # [n] committed length + depth; None: a chain
    visible: torch.Tensor | None = None  # [n, n] ancestor-or-self mask; None: causal chain

    @staticmethod
    def chain(bonus: int, drafts: list[int]) -> Candidates:
        children = [{d: j + 1} for j, d in enumerate(drafts)] + [{}]
        return Candidates([bonus, *drafts], children, [0, *range(len(drafts))])

    @staticmethod
    def tree(
        tokens: list[int], parents: list[int], depths: list[int], start: int,
        visible: torch.Tensor,
    ) -> Candidates:
        children: list[dict[int, int]] = [{} for _ in tokens]
        for node in range(1, len(tokens)):
            assert parents[node] < node, f"node {node} has parent {parents[node]}: not topological"
            assert tokens[node] not in children[parents[node]], f"duplicate sibling at {node}"
            children[parents[node]][tokens[node]] = node
        return Candidates(tokens, children, list(parents), [start + d for d in depths], visible)


def walk(
    children: list[dict[int, int]], target_token: Callable[[int, list[int]], int]
) -> tuple[list[int], list[int]]:
    """Accept candidates with the target's own decision.

    `target_token(v, committed_so_far)` is the target's decision at node v: its argmax, or a
    sample from exactly the distribution plain decoding would use after v's path (penalties
    see the committed context plus that path), drawn independently for every node. From the
    root, follow the child carrying that token; stop at the first node without one. Every
    committed token IS the target's decision at its node, so the output is distributed exactly
    as plain decoding (sample-and-match; never min(1, p/q) on deterministic candidates).
    Returns (accepted nodes, root first, ascending; committed tokens: the accepted nodes'
    tokens plus the bonus, the decision at the deepest accepted node)."""
    node, path, out = 0, [0], []
    while True:
        token = target_token(node, out)
        out.append(token)
        child = children[node].get(token)
        if child is None:
            return path, out
        path.append(child)
        node = child


@dataclass
class GreedyWalk:
    """The greedy walk of R requests' candidates, as device tensors."""

    path: torch.Tensor  # [R, N] accepted nodes first (root, then ascending), then N as padding
    num_accepted: torch.Tensor  # [R] accepted nodes, root included (>= 1)
    bonus: torch.Tensor  # [R] the target's argmax at the deepest accepted node


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                target: torch.Tensor) -> GreedyWalk:
    """`walk` with argmax decisions for a batch, as tensor ops without host syncs.

    tokens, parents, target: [R, N] int64, nodes in topological order (parent < node, root 0
    pointing at itself); target[r, v] is the target's argmax at node v; nodes at or past
    num_nodes[r] are padding and never accepted. A node is accepted when its token is the
    decision at its parent and its parent is accepted; siblings carry distinct tokens, so the
    accepted nodes form one root path. log2(N) pointer-jumping rounds AND every node's matches
    along its ancestors."""
    r, n = tokens.shape
    assert parents.shape == (r, n) and target.shape == (r, n) and num_nodes.shape == (r,), (
        f"tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)}, target "
        f"{tuple(target.shape)}, num_nodes {tuple(num_nodes.shape)}"
    )
    node = torch.arange(n, device=tokens.device)
    ok = (node < num_nodes[:, None]) & (tokens == target.gather(1, parents))  # [R, N]
    ok[:, 0] = True
    up = parents  # [R, N] the 2^k-th ancestor (the root is its own)
    for _ in range(max(n - 1, 1).bit_length()):
        ok = ok & ok.gather(1, up)
        up = up.gather(1, up)
    path = torch.where(ok, node, n).sort(dim=1).values
    deepest = torch.where(ok, node, 0).amax(dim=1)  # a descendant has a larger index
    return GreedyWalk(path, ok.sum(dim=1), target.gather(1, deepest[:, None]).squeeze(1))
