"""Exact laws of one speculative round on a toy Markov target, by enumerating every random
choice the production walks make. Each round's output, continued by plain sampling, must have
exactly the target's joint law; the RRS variant without the q update must not."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashtree.speculative.acceptance import Candidates, walk, walk_rrs
from flashtree.speculative.tree import ancestor_mask

V = 6


class _NeedChoice(Exception):
    def __init__(self, outcomes):
        self.outcomes = outcomes  # [(value, probability)]


class ScriptedDraws:
    """Replays a script of choices; asks for a new branch at the first unscripted draw."""

    def __init__(self, script):
        self.script, self.pos, self.weight = script, 0, 1.0

    def _next(self, outcomes):
        if self.pos == len(self.script):
            raise _NeedChoice([(v, p) for v, p in outcomes if p > 0])
        value, prob = self.script[self.pos]
        self.pos += 1
        self.weight *= prob
        return value

    def categorical(self, probs):
        return self._next([(i, float(p)) for i, p in enumerate(probs.tolist())])

    def bernoulli(self, prob):
        return self._next([(True, prob), (False, 1.0 - prob)])


def enumerate_law(run) -> dict[tuple[int, ...], float]:
    """Law of run(draws) over every choice sequence (depth-first over the choices)."""
    law: dict[tuple[int, ...], float] = {}
    stack = [[]]
    while stack:
        script = stack.pop()
        draws = ScriptedDraws(script)
        try:
            out = tuple(run(draws))
        except _NeedChoice as need:
            stack += [script + [(v, p)] for v, p in need.outcomes]
            continue
        law[out] = law.get(out, 0.0) + draws.weight
    return law


def markov_table(seed: int, temperature: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=gen, dtype=torch.float64) * 2 / temperature,
                         dim=-1)


def continue_to(law, table, root, length):
    """Extend each emitted prefix with plain Markov sampling to `length` tokens (exactly)."""
    full: dict[tuple[int, ...], float] = {}
    for prefix, w in law.items():
        tails = itertools.product(range(V), repeat=length - len(prefix))
        for tail in tails:
            seq = prefix + tail
            prob, prev = w, prefix[-1] if prefix else root
            for t in tail:
                prob *= float(table[prev, t])
                prev = t
            full[seq[:length]] = full.get(seq[:length], 0.0) + prob
    return full


def target_joint(table, root, length):
    joint = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, root
        for t in seq:
            prob *= float(table[prev, t])
            prev = t
        joint[seq] = prob
    return joint


def tv(a, b):
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


FIXED_TREES = {
    "chain": ([3, 1, 4], [0, 1, 2]),
    "bushy": ([2, 5, 0, 1, 2, 4], [0, 0, 0, 1, 1, 4]),
    "deep": ([1, 0, 2, 3, 5, 1], [0, 1, 1, 2, 4, 5]),
}


@pytest.mark.parametrize("name", list(FIXED_TREES))
@pytest.mark.parametrize("seed", [0, 1])
def test_sample_and_match_is_exact_on_fixed_trees(name, seed):
    tokens, parents = FIXED_TREES[name]
    root = 2
    table = markov_table(seed)
    all_tokens, all_parents = [root, *tokens], [0, *parents]
    depths = [0]
    for v in range(1, len(all_tokens)):
        depths.append(depths[all_parents[v]] + 1)
    cand = Candidates.tree(all_tokens, all_parents, depths, 0,
                           ancestor_mask(torch.tensor([all_parents]))[0])

    def run(draws):
        return walk(cand.children, lambda v, _c: draws.categorical(table[all_tokens[v]]))[1]

    length = max(depths) + 1
    law = enumerate_law(run)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert tv(continue_to(law, table, root, length), target_joint(table, root, length)) < 1e-9


def swor_orders(q: torch.Tensor, width: int):
    """Every ordered draw of `width` distinct tokens without replacement, with its law."""
    for order in itertools.permutations(range(V), width):
        prob, left = 1.0, 1.0
        for t in order:
            prob *= float(q[t]) / left
            left -= float(q[t])
        yield order, prob


def rrs_round_law(table, draft_q, root, width, renormalize_q=True):
    """Law of one RRS round: spine tree with `width` SWOR siblings per depth, identities
    enumerated exactly, each walked by the production walk_rrs with enumerated coins."""
    depth = draft_q.shape[0]
    law: dict[tuple[int, ...], float] = {}
    per_depth = [list(swor_orders(draft_q[d], width)) for d in range(depth)]
    for combo in itertools.product(*per_depth):
        w_tree = 1.0
        tokens, parents, spine = [root], [0], 0
        for order, prob in combo:
            w_tree *= prob
            first = len(tokens)
            tokens += list(order)
            parents += [spine] * width
            spine = first
        depths = [0]
        for v in range(1, len(tokens)):
            depths.append(depths[parents[v]] + 1)
        children = [{} for _ in tokens]
        for v in range(1, len(tokens)):
            children[parents[v]][tokens[v]] = v

        def run(draws, tokens=tokens, children=children, depths=depths):
            return walk_rrs(children, depths, lambda node, _c: table[tokens[node]], draft_q, draws,
                            renormalize_q=renormalize_q)[1]

        for out, w in enumerate_law(run).items():
            law[out] = law.get(out, 0.0) + w_tree * w
    return law


@pytest.mark.parametrize("width, depth", [(1, 2), (2, 2), (3, 1)])
@pytest.mark.parametrize("seed", [0, 3])
def test_rrs_is_exact_and_the_q_update_is_necessary(width, depth, seed):
    table = markov_table(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    # A deliberately mismatched drafter: its own random marginals.
    draft_q = torch.softmax(torch.randn(depth, V, generator=gen, dtype=torch.float64), dim=-1)
    root = 1
    law = rrs_round_law(table, draft_q, root, width)
    assert abs(sum(law.values()) - 1) < 1e-9
    joint = target_joint(table, root, depth + 1)
    assert tv(continue_to(law, table, root, depth + 1), joint) < 1e-9
    if (width, depth) == (2, 2):  # negative control: there the update matters for any seed
        biased = rrs_round_law(table, draft_q, root, width, renormalize_q=False)
        assert tv(continue_to(biased, table, root, depth + 1), joint) > 1e-3
