"""The speculative step's data types, passed between its stages (building candidates,
verifying, accepting, committing). A leaf module: it imports nothing of flashtree's, so every
stage can import it without importing another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

Walk = tuple[list[int], list[int]]  # a request's accepted nodes (root first), committed tokens


@dataclass
class Candidates:
    """One request's candidates on the host: node 0 is the root (the bonus token), node order
    is topological. `children[v]` maps a token to the child of v that carries it."""

    tokens: list[int]  # [n] node tokens
    children: list[dict[int, int]]
    parents: list[int]  # [n] parent node of each node; the root points at itself (0)
    depths: list[int]  # [n] root 0
    visible: torch.Tensor | None = None  # [n, n] ancestor-or-self mask; None: causal chain
    draft_probs: torch.Tensor | None = None  # [L, V] q rows when the candidates were sampled
    ranks: list[int] | None = None  # best-first trees: each node's selection rank (`DraftTrees`)

    def positions(self, start: int) -> list[int] | None:
        """Each node's position after `start` committed tokens, start + depth (None for a
        chain, whose nodes sit at consecutive positions)."""
        return None if self.visible is None else [start + d for d in self.depths]

    @staticmethod
    def chain(bonus: int, drafts: list[int], draft_probs: torch.Tensor | None = None
              ) -> Candidates:
        children = [{d: j + 1} for j, d in enumerate(drafts)] + [{}]
        return Candidates([bonus, *drafts], children, [0, *range(len(drafts))],
                          list(range(len(drafts) + 1)), draft_probs=draft_probs)

    @staticmethod
    def tree(tokens: list[int], parents: list[int], depths: list[int], visible: torch.Tensor,
             draft_probs: torch.Tensor | None = None, ranks: list[int] | None = None
             ) -> Candidates:
        children: list[dict[int, int]] = [{} for _ in tokens]
        for node in range(1, len(tokens)):
            assert parents[node] < node, f"node {node} has parent {parents[node]}: not topological"
            assert tokens[node] not in children[parents[node]], f"duplicate sibling at {node}"
            children[parents[node]][tokens[node]] = node
        return Candidates(tokens, children, list(parents), depths, visible, draft_probs, ranks)


@dataclass
class DeviceCandidates:
    """Candidates of every request of a greedy step, kept on the device: DDTrees (N = budget + 1
    nodes, root first, topological order) or DFlash chains (N = block size, `visible` None)."""

    tokens: torch.Tensor  # [R, N] int64
    parent: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64
    visible: torch.Tensor | None  # [R, N, N] bool; None: causal chains
    rank: torch.Tensor | None  # [R, N] int64 DDTrees' selection ranks (`DraftTrees`)


class Verified(NamedTuple):
    """What one request's speculative step commits."""

    tokens: list[int]  # accepted drafts + the target's next token
    num_candidates: int  # draft nodes verified (tree nodes or chain drafts)
    # The target's logits that decided each token [len(tokens), vocab], for a request that
    # asked for log-probs (else None).
    logits: torch.Tensor | None = None
    # A best-first DDTree's accepted drafts' selection ranks: a tree of budget b would have
    # accepted those <= b (None: a chain or a sampled tree).
    accepted_ranks: list[int] | None = None
