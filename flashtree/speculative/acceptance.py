"""Acceptance: which of a step's candidates the target commits, decided in one place.

`accept` walks every request of a verify forward with the target's own rule: the argmax at
temperature 0 (`greedy_walk`, batched on the device), sample-and-match on deterministic
candidates at temperature > 0 (`walk`: the target's sample at each node, drawn with the uniform
plain decoding would use for that output position, decides which child to follow), and
recursive rejection sampling on sampled candidates (`walk_rrs`). Each returns per request the
accepted nodes (root first) and the committed tokens (the accepted drafts, then the target's
token at the deepest accepted node)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from flashtree.distributed.vocab import vocab_argmax
from flashtree.runner.forward_batch import causal_mask
from flashtree.sampling import inverse_cdf, penalize_rows, probabilities, uniform
from flashtree.sequence import Sequence
from flashtree.speculative.types import Candidates, Walk
from flashtree.transfer import lists_to_device, to_device


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


class Draws(Protocol):
    """The random primitives the walks use, so that tests can enumerate their outcomes."""

    def categorical(self, probs: torch.Tensor) -> int: ...

    def bernoulli(self, prob: float) -> bool: ...


class GeneratorDraws:
    """Draws from a request's own torch.Generator (reproducible per-request seeds)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def categorical(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def bernoulli(self, prob: float) -> bool:
        u = torch.rand((), generator=self.generator, device=self.generator.device)
        return bool(u < prob)


def walk_rrs(
    children: list[dict[int, int]],
    depth_of: list[int],
    target_probs: Callable[[int, list[int]], torch.Tensor],
    draft_probs: torch.Tensor,
    draws: Draws,
    *,
    renormalize_q: bool = True,
) -> tuple[list[int], list[int]]:
    """Walk sampled candidates with recursive rejection sampling.

    children[v]: token -> child, in draw order; depth_of[v]: depth of node v;
    target_probs(v, committed_so_far): the processed target distribution at v [V];
    draft_probs: [L, V], q for children at depth d is row d - 1.
    `renormalize_q=False` drops the q update after a rejection; it exists only as the negative
    control the tests use to show that update is necessary.
    Returns (accepted nodes from the root, committed tokens incl. the bonus)."""
    node, path, out = 0, [0], []
    while True:
        p = target_probs(node, out).double()
        kids = children[node]
        if kids:
            q = draft_probs[depth_of[node]].to(p.device).double().clone()
        accepted = None
        for token, child in kids.items():
            if draws.bernoulli(min(1.0, float(p[token] / q[token]))):
                accepted = token, child
                break
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            # (p - q)+ vanishes only when p <= q everywhere, i.e. p == q: keep p off the tried
            # token instead.
            p = residual / total if total > 1e-12 else _without(p, token)
            if renormalize_q:
                q = _without(q, token)
        if accepted is None:
            out.append(draws.categorical(p))
            return path, out
        out.append(accepted[0])
        path.append(accepted[1])
        node = accepted[1]


def _without(probs: torch.Tensor, token: int) -> torch.Tensor:
    probs = probs.clone()
    probs[token] = 0
    return probs / probs.sum()


def accept(seqs: list[Sequence], cands: list[Candidates], logits: torch.Tensor,
           vocab_start: int) -> list[Walk]:
    """Every request's walk over its candidates; logits: the verify forward's rows, request
    after request ([sum of candidates, V]: this TP rank's vocab slice when every request is
    greedy, else the whole vocabulary)."""
    if all(s.params.argmax_only for s in seqs):
        return _greedy_walks(cands, logits, vocab_start)
    rows, base = [], 0
    for seq, cand in zip(seqs, cands):
        n = len(cand.tokens)
        rows.append(_processed_rows(seq, cand, logits[base : base + n]))
        base += n
    decisions = _node_decisions(seqs, cands, rows)
    walks = []
    for seq, cand, seq_rows, seq_decisions in zip(seqs, cands, rows, decisions):
        if cand.draft_probs is not None:
            walks.append(walk_rrs(cand.children, cand.depths,
                                  lambda v, _prev, r=seq_rows: r[v], cand.draft_probs,
                                  GeneratorDraws(seq.generator)))
        else:
            walks.append(walk(cand.children, lambda v, _prev, d=seq_decisions: d[v]))
    return walks


def _greedy_walks(cands: list[Candidates], logits: torch.Tensor, vocab_start: int
                  ) -> list[Walk]:
    """Every request's greedy walk as one batch of device ops (TP ranks reduce their vocab
    slices for the argmax) and one host sync for the result."""
    device = logits.device
    sizes = [len(c.tokens) for c in cands]
    n, starts = max(sizes), [0]
    for size in sizes:
        starts.append(starts[-1] + size)

    def padded(rows: list[list[int]]) -> list[int]:  # [R * n], row-major
        return [v for r in rows for v in r + [0] * (n - len(r))]

    # Padding nodes read any real row of their request: they are never accepted.
    rows, tokens, parents, num_nodes = lists_to_device([
        padded([[s + min(v, size - 1) for v in range(n)] for s, size in zip(starts, sizes)]),
        padded([c.tokens for c in cands]), padded([c.parents for c in cands]),
        sizes], device)
    argmax = vocab_argmax(logits, vocab_start)  # [sum(sizes)]
    w = greedy_walk(tokens.view(-1, n), parents.view(-1, n), num_nodes, argmax[rows.view(-1, n)])
    result = torch.cat([w.num_accepted[:, None], w.bonus[:, None], w.path], 1).tolist()
    walks = []
    for cand, (count, bonus, *path) in zip(cands, result):
        path = path[:count]
        walks.append((path, [cand.tokens[v] for v in path[1:]] + [bonus]))
    return walks


def _processed_rows(seq: Sequence, cand: Candidates, logits: torch.Tensor) -> torch.Tensor:
    """What plain decoding would sample from at every node, all nodes at once: penalties count
    the committed tokens plus the node's own path (its ancestors below the root, and itself).
    logits: [n, V] -> penalized logits (greedy) or probabilities [n, V]."""
    n, vocab = logits.shape
    visible = cand.visible
    if visible is None:  # a chain: each node's path is every node up to it
        visible = causal_mask(n, logits.device)
    path_tokens = to_device(cand.tokens[1:], logits.device)
    one_hot = torch.nn.functional.one_hot(path_tokens, vocab).to(logits.dtype)  # [n-1, V]
    path_counts = visible[:, 1:].to(device=logits.device, dtype=logits.dtype) @ one_hot
    rows = penalize_rows(logits, seq.params, seq.prompt_ids, seq.output_ids, path_counts)
    return rows if seq.params.greedy else probabilities(rows, seq.params)


def _node_decisions(seqs: list[Sequence], cands: list[Candidates], rows: list[torch.Tensor]
                    ) -> list[list[int] | None]:
    """The target's decision at every node of every request but RRS ones (None): argmax, or a
    draw from the node's own distribution with the uniform of the output position it decides
    (plain decoding draws that position with the same uniform). One device read."""
    picks = []
    for seq, cand, seq_rows in zip(seqs, cands, rows):
        if cand.draft_probs is not None:
            continue
        if seq.params.greedy:
            picks.append(seq_rows.argmax(dim=-1))
        else:
            base = len(seq.output_ids)  # the root decides output position base
            picks.append(inverse_cdf(seq_rows, [uniform(seq.seed, base + d) for d in cand.depths]))
    flat = iter(torch.cat(picks).tolist() if picks else [])
    return [None if cand.draft_probs is not None
            else list(itertools.islice(flat, len(cand.tokens))) for cand in cands]
