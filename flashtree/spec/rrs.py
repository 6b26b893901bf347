"""Recursive rejection sampling (RRS) over sampled siblings: the second lossless tree mode.

Candidates are SAMPLED from the drafter: at each depth the siblings are drawn without
replacement (Gumbel top-w) from q_d = softmax(draft_logits_d / T), the topology (how many
children each node gets) being fixed before any identity is drawn. The walk accepts child x of
the current node with probability min(1, p(x) / q(x)); on rejection it moves to the residual
p <- (p - q)+ / Z and removes x from q (q(x) <- 0, renormalised), exactly the law of the next
sibling drawn without replacement. When no child is accepted the bonus is drawn from the
current p. Every emitted token is thus distributed as the target's processed distribution
(RSD / Sequoia); with one child per node it is standard speculative sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


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


def sample_spine_tree(
    draft_probs: torch.Tensor, width: int, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """A tree whose shape is fixed before identities are drawn: at every depth d = 1..L the
    spine node gets `width` children drawn without replacement from q_d (Gumbel top-w), in
    draw order; the spine continues through the first-drawn child.
    draft_probs: [L, V] q_d rows. Returns (tokens, parents) of the non-root nodes, node i+1
    being entry i (root = node 0)."""
    depth, vocab = draft_probs.shape
    width = min(width, vocab)
    u = torch.rand(depth, vocab, generator=generator, device=generator.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
    keys = torch.log(draft_probs.to(gumbel.device)) + gumbel
    drawn = keys.topk(width, dim=-1).indices.tolist()  # [L, w] in draw order
    tokens, parents, spine = [], [], 0
    for d in range(depth):
        first = len(tokens) + 1
        tokens += drawn[d]
        parents += [spine] * width
        spine = first
    return tokens, parents


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
