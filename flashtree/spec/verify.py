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
    positions: list[int] | None = None  # [n] committed length + depth; None: a chain
    visible: torch.Tensor | None = None  # [n, n] ancestor-or-self mask; None: causal chain

    @staticmethod
    def chain(bonus: int, drafts: list[int]) -> Candidates:
        children = [{d: j + 1} for j, d in enumerate(drafts)] + [{}]
        return Candidates([bonus, *drafts], children)

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
        return Candidates(tokens, children, [start + d for d in depths], visible)


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
