"""The DDTree build of `tree.build_trees_from_topk` in one Triton launch, one program per request
row: the torch build is about a hundred small kernels per step, whose launches, not their
arithmetic, are its time.

Per depth the best W = budget prefixes are kept (sorted descending, ties to the lower flat index
parent_rank * K + token, as the levels of `tree.best_first_levels`); the tree is the top
`budget` of all kept entries, ties taken depth-major, so a parent (its key >= its child's, at a
lower depth) is always taken with its children without clamping keys below it. Keys are
compared as order-preserving int32 bits of the float32 log-probability sums.

Scratch (global memory, per row): the kept keys and flat indices of every depth, the chosen
nodes' packed rank keys and every node's ancestors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtree.speculative.tree import real_entries

_LOWEST = tl.constexpr(-9223372036854775808)  # below every packed key (their low half is >= 1)


@triton.jit
def _order_bits(bits):
    """int32 bits of a float32 <-> int32 whose signed order is the float order (an
    involution: negatives flip their 31 low bits)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _pack(key, index):
    """float32 key and int32 index -> int64 whose descending order is the key's, ties to the
    lower index."""
    order = _order_bits(key.to(tl.int32, bitcast=True))
    return (order.to(tl.int64) << 32) | (4294967295 - index.to(tl.int64))


@triton.jit
def _unpack_key(packed):
    return _order_bits((packed >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_index(packed):
    return (4294967295 - (packed & 4294967295)).to(tl.int32)


@triton.jit
def _candidates(lp_ptr, parent_keys_ptr, has_parents, n_prev, k, width, c):
    """Packed keys of the pairs (parent rank i < n_prev, token j < k) with
    (i + 1) * (j + 1) <= width, candidate c being pair (c - start_j, j), token-major; the rest
    lowest. Any other pair is beaten by the >= width pairs (i' <= i, j' <= j): parent keys and
    log-probabilities are each sorted descending."""
    j = c * 0
    start = c * 0
    end = n_prev * 0
    for t in range(1, k):  # end of token t - 1's run of parents
        end += tl.minimum(n_prev, width // t)
        past = c >= end
        j += past.to(tl.int32)
        start = tl.where(past, end, start)
    end += tl.minimum(n_prev, width // k)
    i = c - start
    valid = c < end
    parent_key = tl.load(parent_keys_ptr + i, mask=valid & has_parents, other=0.0)
    key = parent_key + tl.load(lp_ptr + j, mask=valid, other=0.0)
    return tl.where(valid, _pack(key, i * k + j), _LOWEST)


@triton.jit
def _best_per_depth(lp_ptr, keys_ptr, flat_ptr, depth, k, width, L_PAD: tl.constexpr,
                    C_PAD: tl.constexpr):
    """Store each depth's best min(width, K^(d+1)) prefixes (keys and flat indices, sorted
    descending) at keys_ptr / flat_ptr + d * width -> those counts per depth [L_PAD]."""
    c = tl.arange(0, C_PAD)
    levels = tl.arange(0, L_PAD)
    real = levels * 0
    n_prev = tl.full([], 1, tl.int32)
    for d in range(depth):
        parent_keys = keys_ptr + (d - 1) * width
        packed = _candidates(lp_ptr + d * k, parent_keys, d > 0, n_prev, k, width, c)
        packed = tl.sort(packed, descending=True)
        n_prev = tl.minimum(n_prev * k, width)
        kept = c < n_prev
        tl.store(keys_ptr + d * width + c, _unpack_key(packed), mask=kept)
        tl.store(flat_ptr + d * width + c, _unpack_index(packed), mask=kept)
        tl.debug_barrier()  # the next depth reads these parents
        real = tl.where(levels == d, n_prev, real)
    return real


@triton.jit
def _chosen_per_depth(keys_ptr, real, n_sel, width, L_PAD: tl.constexpr, W_PAD: tl.constexpr):
    """How many of each depth's kept entries the tree takes [L_PAD] (a prefix of each
    depth's ranks): the n_sel best of all, ties in depth-major entry order."""
    levels = tl.arange(0, L_PAD)[:, None]
    ranks = tl.arange(0, W_PAD)[None, :]
    valid = ranks < real[:, None]
    keys = tl.load(keys_ptr + levels * width + ranks, mask=valid, other=0.0)
    bits = _order_bits(keys.to(tl.int32, bitcast=True))  # [L_PAD, W_PAD]
    # The largest threshold t with n_sel entries >= t: count(>= lo) >= n_sel > count(>= hi).
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483648, tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        enough = tl.sum((valid & (bits >= mid.to(tl.int32))).to(tl.int32)) >= n_sel
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    threshold = lo.to(tl.int32)
    above = tl.sum((valid & (bits > threshold)).to(tl.int32), 1)
    tied = tl.sum((valid & (bits == threshold)).to(tl.int32), 1)
    tied_before = tl.cumsum(tied, 0) - tied
    need = n_sel - tl.sum(above, 0)
    return above + tl.minimum(tl.maximum(need - tied_before, 0), tied)


@triton.jit
def _write_nodes(tok_ptr, keys_ptr, flat_ptr, nodes_ptr, order_ptr, root, chosen, depth, k,
                 width, n_nodes, L_PAD: tl.constexpr, W_PAD: tl.constexpr):
    """Nodes [4, n_nodes] (tokens, parents, depths; ranks later), node 1 + (chosen entries
    before it, depth-major), and each node's packed rank key at order_ptr + node - 1."""
    levels = tl.arange(0, L_PAD)
    first = tl.cumsum(chosen, 0) - chosen + 1  # node of each depth's best entry
    r = tl.arange(0, W_PAD)
    for d in range(depth):
        base = tl.sum(tl.where(levels == d, first, 0))
        parent_base = tl.sum(tl.where(levels == d - 1, first, 0))  # 0: the root's children
        taken = r < tl.sum(tl.where(levels == d, chosen, 0))
        flat = tl.load(flat_ptr + d * width + r, mask=taken, other=0)
        node = base + r
        token = tl.load(tok_ptr + d * k + flat % k, mask=taken)
        tl.store(nodes_ptr + node, token, mask=taken)
        tl.store(nodes_ptr + n_nodes + node, (parent_base + flat // k).to(tl.int64), mask=taken)
        tl.store(nodes_ptr + 2 * n_nodes + node, (r * 0 + d + 1).to(tl.int64), mask=taken)
        key = tl.load(keys_ptr + d * width + r, mask=taken)
        tl.store(order_ptr + node - 1, _pack(key, node), mask=taken)
    q = tl.arange(0, 4)
    tl.store(nodes_ptr + q * n_nodes, tl.where(q == 0, root, 0))


@triton.jit
def _write_ranks(order_ptr, nodes_ptr, n_sel, n_nodes, B_PAD: tl.constexpr):
    """Selection ranks: k for the k-th best node (descending key, ties to the lower node)."""
    b = tl.arange(0, B_PAD)
    packed = tl.sort(tl.load(order_ptr + b, mask=b < n_sel, other=_LOWEST), descending=True)
    node = _unpack_index(packed)
    tl.store(nodes_ptr + 3 * n_nodes + node, (b + 1).to(tl.int64), mask=b < n_sel)


@triton.jit
def _ancestors(nodes_ptr, up_ptr, n_nodes, tree_depth, N_PAD: tl.constexpr):
    """up_ptr[s - 1, a] = the node s levels above node a, s = 1..tree_depth (the root's
    parent is the root): the one chain of dependent loads, for all nodes at once."""
    a = tl.arange(0, N_PAD)
    up = a
    for s in range(tree_depth):
        up = tl.load(nodes_ptr + n_nodes + up, mask=a < n_nodes, other=0).to(tl.int32)
        tl.store(up_ptr + s * n_nodes + a, up, mask=a < n_nodes)


@triton.jit
def _write_visible(up_ptr, visible_ptr, n_nodes, tree_depth, L_PAD: tl.constexpr,
                   BLOCK_A: tl.constexpr, N_PAD: tl.constexpr):
    """visible [n_nodes, n_nodes] uint8, BLOCK_A rows at a time: row a = {a} + ancestors.
    The ancestor loads of a block are independent (unrolled, issued together)."""
    b = tl.arange(0, N_PAD)[None, :]
    for a0 in range(0, n_nodes, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        seen = b == a[:, None]
        for s in tl.static_range(L_PAD):  # past tree_depth: the root, visible anyway
            up = tl.load(up_ptr + s * n_nodes + a, mask=(a < n_nodes) & (s < tree_depth),
                         other=0)
            seen |= b == up[:, None]
        tl.store(visible_ptr + a[:, None] * n_nodes + b, seen.to(tl.uint8),
                 mask=(a[:, None] < n_nodes) & (b < n_nodes))


@triton.jit
def _tree_kernel(lp_ptr, tok_ptr, roots_ptr, keys_ptr, flat_ptr, order_ptr, up_ptr, nodes_ptr,
                 visible_ptr, depth, k, width, n_sel, L_PAD: tl.constexpr, C_PAD: tl.constexpr,
                 W_PAD: tl.constexpr, B_PAD: tl.constexpr, N_PAD: tl.constexpr,
                 BLOCK_A: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_nodes = n_sel + 1
    lp_ptr += row * depth * k
    tok_ptr += row * depth * k
    keys_ptr += row * depth * width
    flat_ptr += row * depth * width
    order_ptr += row * n_sel
    up_ptr += row * depth * n_nodes
    nodes_ptr += row * 4 * n_nodes
    visible_ptr += row * n_nodes * n_nodes
    real = _best_per_depth(lp_ptr, keys_ptr, flat_ptr, depth, k, width, L_PAD, C_PAD)
    chosen = _chosen_per_depth(keys_ptr, real, n_sel, width, L_PAD, W_PAD)
    _write_nodes(tok_ptr, keys_ptr, flat_ptr, nodes_ptr, order_ptr, tl.load(roots_ptr + row),
                 chosen, depth, k, width, n_nodes, L_PAD, W_PAD)
    tl.debug_barrier()  # ranks and visibility read what other threads wrote
    _write_ranks(order_ptr, nodes_ptr, n_sel, n_nodes, B_PAD)
    tree_depth = tl.sum((chosen > 0).to(tl.int32), 0)
    _ancestors(nodes_ptr, up_ptr, n_nodes, tree_depth, N_PAD)
    tl.debug_barrier()
    _write_visible(up_ptr, visible_ptr, n_nodes, tree_depth, L_PAD, BLOCK_A, N_PAD)


def launch_sizes(depth: int, k: int, budget: int) -> dict[str, int]:
    """The kernel's block sizes (powers of two) for L = depth, K = k and W = budget."""
    n_sel = min(budget, real_entries(depth, k, budget))
    candidates = sum(budget // m for m in range(1, k + 1))  # pairs with (i+1)(j+1) <= W
    n_pad = triton.next_power_of_2(n_sel + 1)
    return dict(L_PAD=triton.next_power_of_2(depth), C_PAD=triton.next_power_of_2(candidates),
                W_PAD=triton.next_power_of_2(budget), B_PAD=triton.next_power_of_2(n_sel),
                N_PAD=n_pad, BLOCK_A=min(n_pad, 256 * num_warps(budget) // n_pad))


def num_warps(budget: int) -> int:
    """One program per row has its SM to itself: more warps share the larger tiles."""
    return 4 if budget < 128 else 8


@dataclass
class OneLaunchTrees:
    """The launch's outputs and the per-depth levels it kept on the way."""

    nodes: torch.Tensor  # [R, 4, N] int64: tokens, parents, depths, selection ranks
    visible: torch.Tensor  # [R, N, N] bool: node a sees node b iff b is a or an ancestor of a
    # [R, L, W]: each depth's best min(W, K^(d+1)) prefixes, keys descending (ties to the lower
    # flat index parent_rank * K + token), as `tree.BestFirstLevels`; entries past them unset.
    keys: torch.Tensor  # float32
    flat: torch.Tensor  # int32


def launch_tree_kernel(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor,
                       budget: int) -> OneLaunchTrees:
    """The trees of `tree.build_trees_from_topk` in one launch: top_lp [R, L, K] float32 sorted
    descending, top_tok [R, L, K] int64, roots [R]; N = 1 + min(budget, prefixes that exist)."""
    assert budget >= 1, f"budget must be >= 1, got {budget}"
    assert top_lp.dtype == torch.float32 and top_tok.dtype == torch.int64, (top_lp.dtype,
                                                                             top_tok.dtype)
    assert top_lp.shape == top_tok.shape, (top_lp.shape, top_tok.shape)
    r, depth, k = top_lp.shape
    n_sel = min(budget, real_entries(depth, k, budget))
    device = top_lp.device
    trees = OneLaunchTrees(
        nodes=torch.empty(r, 4, n_sel + 1, dtype=torch.int64, device=device),
        visible=torch.empty(r, n_sel + 1, n_sel + 1, dtype=torch.bool, device=device),
        keys=torch.empty(r, depth, budget, dtype=torch.float32, device=device),
        flat=torch.empty(r, depth, budget, dtype=torch.int32, device=device))
    order = torch.empty(r, n_sel, dtype=torch.int64, device=device)  # scratch: rank keys
    up = torch.empty(r, depth, n_sel + 1, dtype=torch.int32, device=device)  # scratch: ancestors
    if r:
        _tree_kernel[(r,)](top_lp.contiguous(), top_tok.contiguous(), roots.long().contiguous(),
                           trees.keys, trees.flat, order, up, trees.nodes,
                           trees.visible.view(torch.uint8), depth, k, budget, n_sel,
                           num_warps=num_warps(budget), **launch_sizes(depth, k, budget))
    return trees


def build_trees_in_one_launch(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor,
                              budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch_tree_kernel` as `candidate_builder._tree_nodes` returns trees: ([R, 4, N] int64
    tokens, parents, depths, selection ranks; [R, N, N] bool visibility)."""
    trees = launch_tree_kernel(top_lp, top_tok, roots, budget)
    return trees.nodes, trees.visible
