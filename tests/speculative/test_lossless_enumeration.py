"""Exact laws of one speculative round on a toy Markov target, by enumerating every random
choice the production walks make, on chains of a whole block of 4 and trees of depth 3 to 5.
Each round's output, continued by plain sampling, must have exactly the target's joint law; the
RRS variant without the q update must not."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashtree.speculative.acceptance import walk, walk_rrs
from flashtree.speculative.tree import ancestor_mask
from flashtree.speculative.types import Candidates

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


def markov_table(seed: int, vocab: int = V) -> torch.Tensor:
    """[vocab, vocab] the target's next-token law after each token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * 2,
                         dim=-1)


def continue_to(law, table, root, length):
    """Extend each emitted prefix with plain Markov sampling to `length` tokens (exactly)."""
    full: dict[tuple[int, ...], float] = {}
    for prefix, w in law.items():
        tails = itertools.product(range(len(table)), repeat=length - len(prefix))
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
    for seq in itertools.product(range(len(table)), repeat=length):
        prob, prev = 1.0, root
        for t in seq:
            prob *= float(table[prev, t])
            prev = t
        joint[seq] = prob
    return joint


def tv(a, b):
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


# (tokens, parents) of the non-root nodes, node i + 1 being entry i. The check sums over all
# 6^(depth + 1) continuations, about a second for the depth-5 tree.
FIXED_TREES = {
    "block4_chain": ([3, 1, 4], [0, 1, 2]),  # a DFlash block of 4: the bonus and 3 drafts
    "bushy_depth3": ([2, 5, 0, 1, 2, 4], [0, 0, 0, 1, 1, 4]),
    "wide_depth4": ([1, 3, 0, 5, 2, 4, 1], [0, 0, 1, 1, 3, 3, 5]),  # siblings at depths 1-3
    "deep_depth5": ([1, 0, 2, 3, 5, 1], [0, 1, 1, 2, 4, 5]),
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
    cand = Candidates.tree(all_tokens, all_parents, depths,
                           ancestor_mask(torch.tensor([all_parents]))[0])

    def run(draws):
        return walk(cand.children, lambda v, _c: draws.categorical(table[all_tokens[v]]))[1]

    length = max(depths) + 1
    law = enumerate_law(run)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert tv(continue_to(law, table, root, length), target_joint(table, root, length)) < 1e-9


def swor_orders(q: torch.Tensor, width: int):
    """Every ordered draw of `width` distinct tokens without replacement, with its law."""
    for order in itertools.permutations(range(len(q)), width):
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


# (vocab, width, depth) of RRS spine trees. The enumeration walks every SWOR draw of the
# siblings, (vocab! / (vocab - width)!) ** depth trees, so deeper cases take fewer tokens:
# 6^3 = 216 chains, 30^2 = 900 and 120 trees over 6 tokens; 12^3 = 1728 over 4; 6^4 = 1296 over 3.
RRS_CASES = {
    "block4_chain": (6, 1, 3),  # DFlash's RRS chain: one draw per depth of a block of 4
    "width2_depth2": (6, 2, 2),
    "width3_depth1": (6, 3, 1),
    "width2_depth3": (4, 2, 3),  # DDTree's spine for a budget of 6 over a block of 4
    "width2_depth4": (3, 2, 4),
}


@pytest.mark.parametrize("case", list(RRS_CASES))
@pytest.mark.parametrize("seed", [0, 3])
def test_rrs_is_exact_and_the_q_update_is_necessary(case, seed):
    vocab, width, depth = RRS_CASES[case]
    table = markov_table(seed, vocab)
    gen = torch.Generator().manual_seed(100 + seed)
    # A deliberately mismatched drafter: its own random marginals.
    draft_q = torch.softmax(torch.randn(depth, vocab, generator=gen, dtype=torch.float64), dim=-1)
    root = 1
    law = rrs_round_law(table, draft_q, root, width)
    assert abs(sum(law.values()) - 1) < 1e-9
    joint = target_joint(table, root, depth + 1)
    assert tv(continue_to(law, table, root, depth + 1), joint) < 1e-9
    if case == "width2_depth2":  # negative control: there the update matters for any seed
        biased = rrs_round_law(table, draft_q, root, width, renormalize_q=False)
        assert tv(continue_to(biased, table, root, depth + 1), joint) > 1e-3
