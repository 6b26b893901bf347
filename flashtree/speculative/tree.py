"""DDTree: the `budget` most probable continuations under the drafter's per-position marginals,
selected best-first and compiled for one target forward.

A prefix u = (u_1..u_d) scores q(u) = prod_i q_i(u_i). Every ancestor scores at least as much as
its descendants, so the top-`budget` prefixes form a prefix-closed tree (DDTree, Prop. 2), and
only the top-K tokens of each position can appear (Lemma 1, K = min(budget, vocab, topk_cap)).
The selection runs level by level as tensor ops: any selected node at depth d has its parent
among the top-`budget` nodes of depth d - 1, so keeping the top `budget` candidates per depth and
then the top `budget` overall is exact. Scores are float32, the drafter's working precision or
finer; a child's key is kept strictly below its parent's, so a tie never selects a node without
its parent, and trees equal float64 trees up to keys within float32 rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A masked token's log-probability in the levels: 15 depths of it stay finite in float32.
IMPOSSIBLE_LOGPROB = -1.0e30


@dataclass
class DraftTrees:
    """Trees of R requests, padded to N = budget + 1 nodes; node 0 is the root (the bonus
    token). Node order is depth-major and topological (parent index < child index)."""

    tokens: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64, root 0
    parent: torch.Tensor  # [R, N] int64, root and padding point at 0
    # [R, N] int64: k for the k-th node selected (root 0). The tree of any budget b below this
    # one is its nodes of rank <= b, so a walk tells what each smaller tree would have accepted.
    rank: torch.Tensor
    num_nodes: torch.Tensor  # [R] int64, root included
    visible: torch.Tensor  # [R, N, N] bool: node a sees node b iff b is a or an ancestor of a


def topk_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> the k largest full-vocabulary log-probabilities (float32) and ids.
    The top-k runs on the logits as given (the log-softmax keeps their order); only the winners
    and the normaliser are float32."""
    value, index = draft_logits.topk(k, dim=-1)
    return value.float() - torch.logsumexp(draft_logits.float(), dim=-1, keepdim=True), index


def build_trees_from_topk(
    top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, budget: int
) -> DraftTrees:
    """top_lp, top_tok: [R, L, K] the K most likely tokens of each depth and their
    log-probabilities, sorted descending (`topk_logprobs`, or its TP-sharded twin)."""
    return tree_from_levels(best_first_levels(top_lp, budget), top_tok, roots, budget)


@dataclass
class BestFirstLevels:
    """Per depth d, the keys (path log-probability, kept strictly below the parent's) of the
    best W prefixes of length d + 1, sorted descending, and their flat indices parent_rank * K + k
    into the previous depth's kept prefixes times the K tokens. Where fewer than W prefixes
    exist (shallow depths when K < W), the rest are padding with key -inf. The trees of every
    budget b <= W select from these (their nodes at any depth are among its best b)."""

    keys: torch.Tensor  # [R, L, W], top_lp's dtype
    flat: torch.Tensor  # [R, L, W] int64


def tree_nodes(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, *,
               budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`build_trees_from_topk` as the engine takes trees: ([R, 4, N] tokens, parents, depths
    and selection ranks, [R, N, N] visibility)."""
    trees = build_trees_from_topk(top_lp, top_tok, roots, budget)
    return (torch.stack([trees.tokens, trees.parent, trees.depth, trees.rank], dim=1),
            trees.visible)


def best_first_levels(top_lp: torch.Tensor, width: int) -> BestFirstLevels:
    """top_lp: [R, L, K] (as `build_trees_from_topk` takes) -> the best `width` prefixes per
    depth; L tensor steps, no host sync."""
    r, depth_max, k = top_lp.shape
    # Masked tokens (-inf) become finite but far below any real key, so that a child can still
    # be kept strictly below its parent (nothing lies below -inf).
    top_lp = top_lp.clamp_min(IMPOSSIBLE_LOGPROB)
    keys, flat = [], []
    prev = torch.zeros(r, 1, dtype=top_lp.dtype, device=top_lp.device)  # root key
    for d in range(depth_max):
        below_parent = torch.nextafter(prev, torch.full_like(prev, -torch.inf))[:, :, None]
        cand = torch.minimum(prev[:, :, None] + top_lp[:, d, None, :], below_parent).flatten(1)
        if cand.shape[1] < width:
            cand = torch.nn.functional.pad(cand, (0, width - cand.shape[1]), value=-torch.inf)
        key, idx = cand.topk(width, dim=-1)
        keys.append(key)
        flat.append(idx)
        prev = key
    return BestFirstLevels(torch.stack(keys, 1), torch.stack(flat, 1))


def real_entries(depth: int, k: int, width: int) -> int:
    """Prefixes that exist among the levels' entries: min(W, K^(d+1)) at depth index d."""
    total, level = 0, 1
    for _ in range(depth):
        level = min(width, level * k)
        total += level
    return total


def tree_from_levels(levels: BestFirstLevels, top_tok: torch.Tensor, roots: torch.Tensor,
                     budget: int) -> DraftTrees:
    """The best-first tree of `budget` non-root nodes (fewer where fewer prefixes exist) from
    levels of width >= budget; nodes in depth-major order. Tensor ops only (no host sync)."""
    assert budget >= 1, f"budget must be >= 1, got {budget}"
    r, depth_max, width = levels.keys.shape
    assert width >= budget, f"levels of width {width} cannot give a tree of {budget} nodes"
    k = top_tok.shape[-1]
    device = levels.keys.device
    total = depth_max * width
    n_sel = min(budget, real_entries(depth_max, k, width))
    chosen = levels.keys.flatten(1).topk(n_sel, dim=-1).indices  # [R, n_sel]
    selected = torch.zeros(r, total, dtype=torch.bool, device=device)
    selected.scatter_(1, chosen, True)
    # Node index of each selected entry: its rank in depth-major entry order.
    node_of = torch.cumsum(selected.long(), dim=1) * selected  # [R, total], 0 = not selected
    entry = torch.arange(total, device=device)
    order = torch.sort(torch.where(selected, entry, total), dim=1).indices[:, :n_sel]
    depth_of = entry // width  # [total]: entry e sits at depth index e // W
    tokens = top_tok.gather(2, levels.flat % k).flatten(1)  # [R, total]
    # Parent as an entry index of the previous depth; -1 marks the root's children.
    parent_entry = torch.where(depth_of == 0, -1,
                               (levels.flat // k).flatten(1) + (depth_of - 1) * width)
    parent_entry = parent_entry.gather(1, order)
    parent_node = torch.where(parent_entry < 0, 0,
                              node_of.gather(1, parent_entry.clamp(min=0)))
    zero = torch.zeros(r, 1, dtype=torch.long, device=device)
    parent = torch.cat([zero, parent_node], dim=1)
    rank_of_entry = torch.zeros(r, total, dtype=torch.long, device=device).scatter_(
        1, chosen, torch.arange(1, n_sel + 1, device=device).expand(r, n_sel))
    return DraftTrees(
        tokens=torch.cat([roots.to(device).long()[:, None], tokens.gather(1, order)], dim=1),
        depth=torch.cat([zero, (depth_of + 1)[order]], dim=1),
        parent=parent,
        rank=torch.cat([zero, rank_of_entry.gather(1, order)], dim=1),
        num_nodes=torch.full((r,), n_sel + 1, dtype=torch.long, device=device),
        visible=ancestor_mask(parent),
    )


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """parent: [R, N] (root at 0 points to itself) -> [R, N, N] bool, row a = {a} + ancestors.
    Pointer doubling: after step i, rows hold the ancestors closer than 2^i and `jump` points
    2^i up; ceil(log2 N) steps cover any depth without reading the tree on the host."""
    r, n = parent.shape
    visible = torch.eye(n, dtype=torch.bool, device=parent.device).expand(r, n, n).clone()
    jump = parent
    for _ in range(max(1, (n - 1).bit_length())):
        visible = visible | torch.gather(visible, 1, jump[:, :, None].expand(r, n, n))
        jump = torch.gather(jump, 1, jump)
    return visible
