"""DDTree: the `budget` most probable continuations under the drafter's per-position marginals,
selected best-first and compiled for one target forward.

A prefix u = (u_1..u_d) scores q(u) = prod_i q_i(u_i). Every ancestor scores at least as much as
its descendants, so the top-`budget` prefixes form a prefix-closed tree (DDTree, Prop. 2), and
only the top-K tokens of each position can appear (Lemma 1, K = min(budget, vocab, topk_cap)).
The selection runs level by level as tensor ops: any selected node at depth d has its parent
among the top-`budget` nodes of depth d - 1, so keeping the top `budget` candidates per depth and
then the top `budget` overall is exact (ties broken towards shallower nodes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tie-break: a node's key is its log-probability minus depth * this, so a parent always ranks
# strictly above its children even when a child has probability one.
_DEPTH_TIEBREAK = 1e-9


@dataclass
class DraftTrees:
    """Trees of R requests, padded to N = budget + 1 nodes; node 0 is the root (the bonus
    token). Node order is depth-major and topological (parent index < child index)."""

    tokens: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64, root 0
    parent: torch.Tensor  # [R, N] int64, root and padding point at 0
    num_nodes: torch.Tensor  # [R] int64, root included
    visible: torch.Tensor  # [R, N, N] bool: node a sees node b iff b is a or an ancestor of a


def topk_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> the k largest full-vocabulary log-probabilities (float64) and ids."""
    return torch.log_softmax(draft_logits.double(), dim=-1).topk(k, dim=-1)


def build_trees(
    draft_logits: torch.Tensor, roots: torch.Tensor, budget: int, topk_cap: int | None = None
) -> DraftTrees:
    """draft_logits: [R, L, V] raw drafter logits of block slots 1..L; roots: [R] bonus tokens.
    Selects up to `budget` non-root nodes per request."""
    vocab = draft_logits.shape[-1]
    k = min(budget, vocab, topk_cap or vocab)
    return build_trees_from_topk(*topk_logprobs(draft_logits, k), roots, budget)


def build_trees_from_topk(
    top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, budget: int
) -> DraftTrees:
    """top_lp, top_tok: [R, L, K] the K most likely tokens of each depth and their
    log-probabilities, sorted descending (`topk_logprobs`, or its TP-sharded twin)."""
    assert budget >= 1, f"budget must be >= 1, got {budget}"
    r, depth_max, k = top_lp.shape
    device = top_lp.device

    keys, flat = _best_first_levels(top_lp, budget)
    tokens, parents, depths = [], [], []
    offset_prev = 0  # index of the previous level's first entry in the concatenation
    offset = 0
    for d, idx in enumerate(flat):
        tokens.append(top_tok[:, d].gather(1, idx % k))
        # Parent as an index into the concatenation of all levels; -1 marks the root.
        parents.append(idx // k + offset_prev if d > 0 else torch.full_like(idx, -1))
        depths.append(torch.full_like(idx, d + 1))
        offset_prev, offset = offset, offset + idx.shape[1]
    all_keys = torch.cat(keys, dim=1)  # [R, total]
    total = all_keys.shape[1]
    n_sel = min(budget, total)
    chosen = all_keys.topk(n_sel, dim=-1).indices  # [R, n_sel]
    selected = torch.zeros(r, total, dtype=torch.bool, device=device)
    selected.scatter_(1, chosen, True)
    # Node index of each selected entry: its rank in concatenation (depth-major) order.
    node_of = torch.cumsum(selected.long(), dim=1) * selected  # [R, total], 0 = not selected
    order = torch.sort(torch.where(selected, torch.arange(total, device=device), total),
                       dim=1).indices[:, :n_sel]  # concatenation index of node 1..n_sel

    all_tokens = torch.cat(tokens, dim=1).gather(1, order)
    all_depths = torch.cat(depths, dim=1).gather(1, order)
    parent_entry = torch.cat(parents, dim=1).gather(1, order)
    parent_node = torch.where(
        parent_entry < 0, 0, node_of.gather(1, parent_entry.clamp(min=0))
    )
    assert bool((parent_node < torch.arange(1, n_sel + 1, device=device)).all()), (
        "tree is not topological / prefix-closed"
    )
    n = n_sel + 1
    zero = torch.zeros(r, 1, dtype=torch.long, device=device)
    tree_tokens = torch.cat([roots.to(device).long()[:, None], all_tokens], dim=1)
    depth = torch.cat([zero, all_depths], dim=1)
    parent = torch.cat([zero, parent_node], dim=1)
    return DraftTrees(
        tokens=tree_tokens,
        depth=depth,
        parent=parent,
        num_nodes=torch.full((r,), n, dtype=torch.long, device=device),
        visible=ancestor_mask(parent, int(depth.max())),
    )


def _best_first_levels(
    top_lp: torch.Tensor, budget: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per depth d, the keys (path log-probability, minus the depth tie-break) of the best
    `budget` prefixes of length d + 1, sorted descending [R, keep_d], and their flat indices
    parent_rank * K + k into the previous level's kept prefixes times the K tokens."""
    r, depth_max, k = top_lp.shape
    keys, flat = [], []
    prev = torch.zeros(r, 1, dtype=torch.float64, device=top_lp.device)  # root key
    for d in range(depth_max):
        cand = prev[:, :, None] + top_lp[:, d, None, :] - _DEPTH_TIEBREAK  # [R, P, K]
        key, idx = cand.flatten(1).topk(min(budget, cand.shape[1] * k), dim=-1)
        keys.append(key)
        flat.append(idx)
        prev = key
    return keys, flat


def best_path_logprobs(top_lp: torch.Tensor, budget: int) -> torch.Tensor:
    """[R, L, K] (as `build_trees_from_topk` takes) -> [R, budget] the path log-probabilities
    of the nodes a tree of `budget` selects, best first (-inf where it has fewer): the first b
    of them are the tree of budget b."""
    keys = torch.cat(_best_first_levels(top_lp, budget)[0], dim=1)  # [R, total]
    best = keys.topk(min(budget, keys.shape[1]), dim=-1).values
    return torch.nn.functional.pad(best, (0, budget - best.shape[1]), value=-torch.inf)


def ancestor_mask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parent: [R, N] (root at 0 points to itself) -> [R, N, N] bool, row a = {a} + ancestors."""
    r, n = parent.shape
    eye = torch.eye(n, dtype=torch.bool, device=parent.device).expand(r, n, n)
    visible = eye.clone()
    for _ in range(max_depth):
        visible = eye | torch.gather(visible, 1, parent[:, :, None].expand(r, n, n))
    return visible
