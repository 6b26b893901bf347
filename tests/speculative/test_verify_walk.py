"""The batched greedy walk on tensors against the reference walk over children dicts: random
trees and chains of different sizes in one batch, decisions biased to follow deep paths, and
padding nodes whose tokens would match if they were walked."""

from __future__ import annotations

import random

import torch

from flashtree.speculative.acceptance import greedy_walk, walk
from flashtree.speculative.device_verifier import walk_and_keep
from flashtree.speculative.types import Candidates


def _random_candidates(rng: random.Random, n: int, vocab: int) -> Candidates:
    if rng.random() < 0.3:
        return Candidates.chain(rng.randrange(vocab), [rng.randrange(vocab) for _ in range(n - 1)])
    tokens, parents = [rng.randrange(vocab)], [0]
    used: dict[int, set[int]] = {}
    for v in range(1, n):
        p = rng.randrange(v)
        free = sorted(set(range(vocab)) - used.setdefault(p, set()))
        if not free:
            break
        tokens.append(rng.choice(free))
        parents.append(p)
        used[p].add(tokens[-1])
    depths = [0]
    for v in range(1, len(tokens)):
        depths.append(depths[parents[v]] + 1)
    return Candidates.tree(tokens, parents, depths, torch.ones(1))


def test_greedy_walk_matches_reference_walk():
    rng = random.Random(0)
    vocab = 5
    for _ in range(200):
        cands = [_random_candidates(rng, rng.randint(1, 12), vocab)
                 for _ in range(rng.randint(1, 5))]
        n = max(len(c.tokens) for c in cands) + rng.randint(0, 3)  # padded nodes past each tree
        decisions = []
        for c in cands:
            # Mostly follow an existing child, so that deep paths get accepted.
            row = [rng.choice(list(ch)) if ch and rng.random() < 0.8 else rng.randrange(vocab)
                   for ch in c.children]
            decisions.append(row + [rng.randrange(vocab) for _ in range(n - len(row))])
        # Padding nodes hang under the root with the root's decision: walked, they would match.
        tokens = torch.tensor([c.tokens + [d[0]] * (n - len(c.tokens))
                               for c, d in zip(cands, decisions)])
        parents = torch.tensor([c.parents + [0] * (n - len(c.parents)) for c in cands])
        sizes = torch.tensor([len(c.tokens) for c in cands])
        w = greedy_walk(tokens, parents, sizes, torch.tensor(decisions))
        for i, (c, d) in enumerate(zip(cands, decisions)):
            path, out = walk(c.children, lambda v, _prev, d=d: d[v])
            count = int(w.num_accepted[i])
            assert w.path[i, :count].tolist() == path, (c, d)
            assert (w.path[i, count:] == n).all()
            assert [c.tokens[v] for v in path[1:]] + [int(w.bonus[i])] == out


def test_walk_and_keep_moves_exactly_the_accepted_nodes_into_place():
    """The device commit of a tree batch: per request, row j < accepted count moves the KV of
    accepted node path[j] (its verify slot) to row j's slot at position start + j; every
    other row moves scratch onto scratch. Oracle: the reference walk on the host."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    vocab, scratch = 4, 10_000
    for _ in range(100):
        n = rng.randint(1, 10)
        cands = []
        while len(cands) < rng.randint(1, 4):
            c = _random_candidates(rng, n, vocab)
            if len(c.tokens) == n:  # a tree batch: every tree has the same node count
                cands.append(c)
        decisions = [[rng.choice(list(ch)) if ch and rng.random() < 0.8 else rng.randrange(vocab)
                      for ch in c.children] for c in cands]
        slots = torch.randperm(1000, generator=gen)[: len(cands) * n].view(len(cands), n)
        starts = torch.randint(0, 500, (len(cands),), generator=gen)
        ranks = torch.stack([torch.randperm(n, generator=gen) for _ in cands])
        result, path, src, dst, positions = walk_and_keep(
            torch.tensor([c.tokens for c in cands]), torch.tensor([c.parents for c in cands]),
            ranks, torch.tensor(decisions), slots, starts, scratch=scratch)
        for i, (c, d) in enumerate(zip(cands, decisions)):
            nodes, out = walk(c.children, lambda v, _prev, d=d: d[v])
            count, bonus, *rest = result[i].tolist()
            assert count == len(nodes) and rest[:count] == nodes
            assert rest[n : n + count] == [c.tokens[v] for v in nodes]
            assert rest[2 * n : 2 * n + count] == [int(ranks[i, v]) for v in nodes]
            assert [c.tokens[v] for v in nodes[1:]] + [bonus] == out
            assert path[i, :count].tolist() == nodes
            assert src[i, :count].tolist() == [int(slots[i, v]) for v in nodes]
            assert dst[i, :count].tolist() == slots[i, :count].tolist()
            assert (src[i, count:] == scratch).all() and (dst[i, count:] == scratch).all()
            assert positions[i].tolist() == list(range(int(starts[i]), int(starts[i]) + n))
