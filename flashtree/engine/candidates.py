"""Speculative candidates for a batch of decoding requests: one DFlash block drafted per
request, turned into a chain or a DDTree (deterministic; or sampled, for RRS), of the budget the
adaptive policy picks per request (or the full one). Greedy DDTree steps whose trees share one
budget keep them on the device; the rest become host plans."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashtree.distributed.vocab import vocab_argmax, vocab_topk_logprobs
from flashtree.engine.model_runner import ModelRunner
from flashtree.engine.sequence import Sequence
from flashtree.graphs.rows import RowGraphs
from flashtree.spec.dflash import DFlashProposer
from flashtree.spec.policy import SpecPolicy
from flashtree.spec.rrs import sample_spine_tree
from flashtree.spec.tree import (
    BestFirstLevels,
    ancestor_mask,
    best_first_levels,
    best_path_logprobs,
    topk_logprobs,
    tree_from_levels,
)
from flashtree.spec.verify import Candidates
from flashtree.transfer import HostSnapshots, to_device

if TYPE_CHECKING:
    from flashtree.engine.speculative import SpecConfig

# A batch's DDTree budgets are chosen every _CHOICE_STEPS drafting steps, and whenever its
# requests change; in between they are kept, and only a step that chose reads its trees'
# reach (the next choice's input, and the calibration's). The choice, the reach's copy to
# the host and its bookkeeping are host work, and a small model's steps are launch-bound:
# on the H200's host, choosing every step made adaptive's steps 4.0% slower than fixed's at
# one request with the same trees, and keeping budgets for 4 steps 2.2%. A request's trees
# change little over a few steps.
_CHOICE_STEPS = 4


@dataclass
class Planned:
    """One request's candidates as a host plan, with the nodes' depths."""

    cand: Candidates
    depths: list[int]
    draft_probs: torch.Tensor | None  # [L, V] q rows when the candidates were sampled (RRS)
    # The policy's raw expected accepted drafts (adaptive chains; trees': `settle`).
    predicted: float | None = None


@dataclass
class TreeBatch:
    """DDTree candidates of every request of a greedy step, all of one budget, kept on the
    device (N = budget + 1 nodes, root first, topological order)."""

    tokens: torch.Tensor  # [R, N] int64
    parent: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64
    visible: torch.Tensor  # [R, N, N] bool


def _levels(top_lp: torch.Tensor, *, width: int) -> tuple[torch.Tensor, ...]:
    """best_first_levels as RowGraphs replays it: [R, L, K] -> keys, flat [R, L, width], and
    reach [R, width + 1]: the expected accepted drafts of the best b nodes (the sum of their
    path probabilities, were the drafter calibrated) for b = 0..width."""
    levels = best_first_levels(top_lp, width)
    best = best_path_logprobs(levels, width).exp().cumsum(1)
    return levels.keys, levels.flat, torch.cat([best.new_zeros(best.shape[0], 1), best], 1)


def _tree_nodes(keys: torch.Tensor, flat: torch.Tensor, top_tok: torch.Tensor,
                roots: torch.Tensor, *, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The budget's trees as RowGraphs replays them: ([R, 3, N] tokens, parents and depths,
    [R, N, N] visibility)."""
    trees = tree_from_levels(BestFirstLevels(keys, flat), top_tok, roots, budget)
    return torch.stack([trees.tokens, trees.parent, trees.depth], dim=1), trees.visible


class CandidatePlanner:
    """Drafts a block per request and turns the blocks into the step's candidates, with the
    policy's budgets (`policy` None: the full block or tree every step)."""

    def __init__(self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner,
                 policy: SpecPolicy | None) -> None:
        self.cfg, self.proposer, self.policy = cfg, proposer, policy
        lm_head = runner.model.lm_head
        self._vocab_start, self._vocab_size = lm_head.vocab_start, lm_head.vocab_size
        # DDTree candidates replay CUDA graphs (per batch bucket) where the target does.
        graphs = runner.graphs
        buckets = graphs.batch_buckets if graphs is not None else []
        use_graphs = graphs is not None and graphs.use_cuda_graphs
        self.device = runner.device
        # The policy's tree budgets for the next step's requests (`choose_trees`), the
        # drafting steps they have been kept since, then this step's trees until `settle`
        # (on a step that reads them): seq ids, budgets, and their [R, width + 1] reach,
        # copied to the host behind the draft and read after the step's device read.
        self._chosen: dict[int, int] = {}
        self._chosen_ids: list[int] = []  # the requests `_chosen` holds, in batch order
        self._kept_steps = 0
        self._unsettled: tuple[list[int], list[int], torch.Tensor] | None = None
        # The reach's host copies: `settle` reads a step's before the next choice takes one.
        self._reach_copies = HostSnapshots()
        self.tree_levels = RowGraphs(_levels, buckets, self.device, use_graphs)
        self.tree_nodes = RowGraphs(_tree_nodes, buckets, self.device, use_graphs)
        if use_graphs and cfg.method == "ddtree":
            self.capture_tree_graphs(buckets)

    def capture_tree_graphs(self, buckets: list[int]) -> None:
        """Capture the DDTree build for every batch bucket and budget the policy can pick now:
        a capture on first use would stall that step (and skew the policy's step times)."""
        cfg, device = self.cfg, self.device
        depth = cfg.block_size - 1
        k = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or self._vocab_size)
        budgets = [b for b in self.policy.levels if b > 0] if self.policy else [cfg.tree_budget]
        for rows in buckets:
            top_lp = torch.zeros(rows, depth, k, dtype=torch.float64, device=device)
            keys, flat, _ = self.tree_levels(top_lp, width=cfg.tree_budget)
            top_tok = torch.zeros(rows, depth, k, dtype=torch.long, device=device)
            roots = torch.zeros(rows, dtype=torch.long, device=device)
            for budget in budgets:
                self.tree_nodes(keys, flat, top_tok, roots, budget=budget)

    def choose_trees(self, seqs: list[Sequence]) -> None:
        """The policy's DDTree budgets for a drafting step of `seqs`, from each request's
        recent trees (choosing after drafting would make the host wait for the draft), or
        the last step's (see _CHOICE_STEPS)."""
        assert self.policy is not None
        ids = [s.seq_id for s in seqs if not self._samples_tree(s)]
        if ids == self._chosen_ids and self._kept_steps < _CHOICE_STEPS - 1:
            self._kept_steps += 1
        elif ids:
            budgets = self.policy.choose_next(ids)
            self._chosen, self._chosen_ids, self._kept_steps = dict(zip(ids, budgets)), ids, 0

    def prepare_choice(self) -> None:
        """While the device runs a drafting step's target forward: where the next drafting
        step of this batch chooses its trees, the policy works the choice out now."""
        assert self.policy is not None
        if self._chosen_ids and self._kept_steps == _CHOICE_STEPS - 1:
            self.policy.prepare_choice(self._chosen_ids)

    def _samples_tree(self, seq: Sequence) -> bool:
        """RRS requests' candidates are sampled from the draft, at the full budget."""
        return self.cfg.tree_sampling == "rrs" and not seq.params.greedy

    def plan(self, seqs: list[Sequence]) -> list[Planned] | TreeBatch:
        """Every request's candidates: host plans, or (greedy DDTree steps whose trees share
        one budget) the trees on the device."""
        cfg = self.cfg
        if cfg.method == "dflash":
            # Block b = min(B, room left): the last blocks shrink, as the reference's do.
            sizes = [min(cfg.block_size, s.max_total_len - s.num_computed) for s in seqs]
        else:
            sizes = [cfg.block_size] * len(seqs)
        drafted = [(s, b) for s, b in zip(seqs, sizes) if b > 1]
        # Only RRS sampling needs whole draft distributions; argmax and tree top-k run on the
        # TP ranks' vocab slices.
        full = cfg.tree_sampling == "rrs" and any(not s.params.greedy for s, _ in drafted)
        logits = self.proposer.draft_logits(
            [(s.seq_id, s.num_computed, s.last_token, b) for s, b in drafted], gather=full
        ) if drafted else None
        rows: dict[int, torch.Tensor] = {}  # seq_id -> [b - 1, V] draft logits
        greedy: dict[int, list[int]] = {}  # seq_id -> the b - 1 argmax drafts
        if logits is not None:
            # Chains draft the argmax tokens (one device sync for the batch); trees take the
            # top-k in _plan_trees instead.
            argmax = None
            if cfg.method == "dflash":
                argmax = (logits.argmax(dim=-1) if full
                          else vocab_argmax(logits, self._vocab_start)).tolist()
            offset = 0
            for s, b in drafted:
                rows[s.seq_id] = logits[offset : offset + b - 1]
                if argmax is not None:
                    greedy[s.seq_id] = argmax[offset : offset + b - 1]
                offset += b - 1
        plans: list[Planned | None] = [None] * len(seqs)
        chains, trees = [], []  # indices of requests with deterministic candidates
        for i, s in enumerate(seqs):
            draft = rows.get(s.seq_id)
            if draft is not None and self._samples_tree(s):
                plans[i] = self._sampled(s, draft)
            elif draft is None or cfg.method == "dflash":
                chains.append(i)
            else:
                trees.append(i)
        if chains:
            self._plan_chains(seqs, chains, rows, greedy, full, plans)
        if trees:
            on_device = len(trees) == len(seqs) and all(s.params.argmax_only for s in seqs)
            batch = self._plan_trees(seqs, trees, rows, full, plans, on_device)
            if batch is not None:
                return batch
        return [p for p in plans if p is not None]

    def _plan_chains(self, seqs: list[Sequence], chains: list[int],
                     rows: dict[int, torch.Tensor], greedy: dict[int, list[int]], full: bool,
                     plans: list[Planned | None]) -> None:
        """Chain candidates: the drafter's argmax tokens, all of them or (adaptive) the first
        c, with c chosen by the policy from the chain's cumulative path probabilities."""
        lengths = [len(greedy.get(seqs[i].seq_id, [])) for i in chains]
        predicted: list[float | None] = [None] * len(chains)
        drafted = [j for j, n in enumerate(lengths) if n > 0]
        if self.policy is not None and drafted:
            ids = [seqs[chains[j]].seq_id for j in drafted]
            packed = torch.cat([rows[s] for s in ids])  # [sum of lengths, V]
            top1 = self._top_logprobs(packed, 1, full)[0][:, 0].tolist()  # one device sync
            gains, offset = [], 0
            for j in drafted:
                # Expected accepted drafts of the first c: sum over d <= c of prod_{i<=d} q_i.
                reach = list(itertools.accumulate(
                    math.exp(x) for x in itertools.accumulate(top1[offset : offset + lengths[j]])))
                offset += lengths[j]
                gains.append([0.0] + [reach[min(b, len(reach)) - 1]
                                      for b in self.policy.levels[1:]])
            for j, b, g in zip(drafted, self.policy.choose(ids, gains), gains):
                lengths[j] = min(b, lengths[j])
                predicted[j] = g[self.policy.levels.index(b)]
        for j, i in enumerate(chains):
            s = seqs[i]
            drafts = greedy.get(s.seq_id, [])[: lengths[j]]
            plans[i] = Planned(Candidates.chain(s.last_token, drafts),
                                list(range(len(drafts) + 1)), None, predicted[j])

    def _plan_trees(self, seqs: list[Sequence], trees: list[int],
                    rows: dict[int, torch.Tensor], full: bool,
                    plans: list[Planned | None], on_device: bool) -> TreeBatch | None:
        """DDTree candidates: the best-first tree of the full budget, or (adaptive) of the
        budget `choose_trees` picked. `on_device` (every request a greedy tree): when all
        share one budget, return them as a TreeBatch instead of filling `plans`."""
        cfg = self.cfg
        stacked = torch.stack([rows[seqs[i].seq_id] for i in trees])
        root_ids = [seqs[i].last_token for i in trees]
        roots = to_device(root_ids, stacked.device)
        k = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or self._vocab_size)
        top_lp, top_tok = self._top_logprobs(stacked, k, full)  # [R, L, k] each
        # The best-first levels at the full budget serve every smaller budget below.
        keys, flat, reach = self.tree_levels(top_lp, width=cfg.tree_budget)
        budgets = [cfg.tree_budget] * len(trees)
        if self.policy is not None:
            ids = [seqs[i].seq_id for i in trees]
            budgets = [self._chosen[i] for i in ids]
            if self._kept_steps == 0:  # this step chose
                self._unsettled = (ids, budgets, self._reach_copies.take(reach))
        if on_device and len(set(budgets)) == 1 and budgets[0] > 0:
            nodes, visible = self.tree_nodes(keys, flat, top_tok, roots, budget=budgets[0])
            return TreeBatch(nodes[:, 0], nodes[:, 1], nodes[:, 2], visible)
        for budget in sorted(set(budgets)):
            group = [j for j, b in enumerate(budgets) if b == budget]
            if budget == 0:
                for j in group:
                    plans[trees[j]] = Planned(Candidates.chain(root_ids[j], []), [0], None)
                continue
            index = group if len(group) < len(trees) else slice(None)
            nodes, visible = self.tree_nodes(keys[index], flat[index], top_tok[index],
                                              roots[index], budget=budget)
            # [R, 3, N] tokens, parents, depths -> one device sync for the group
            for g, (j, (tokens, parents, depths)) in enumerate(zip(group, nodes.tolist())):
                i = trees[j]
                cand = Candidates.tree(tokens, parents, depths, seqs[i].num_computed,
                                       visible[g])
                plans[i] = Planned(cand, depths, None)

    def settle(self) -> tuple[dict[int, float], dict[int, list[float]]]:
        """After the step's device read (which the host copy of the trees' reach arrived
        with, so reading it waits for nothing), for the trees drafted by a step that chose:
        each one's expected accepted drafts at its chosen budget (seq_id -> raw gain; the
        calibration's `predicted`), and its gains at every level (seq_id -> gains, for the
        request's next choice: `SpecPolicy.note_reach`)."""
        if self._unsettled is None:
            return {}, {}
        ids, budgets, reach = self._unsettled
        self._unsettled = None
        assert self.policy is not None
        rows, levels = reach.tolist(), self.policy.levels
        return ({seq_id: row[budget] for seq_id, budget, row in zip(ids, budgets, rows)},
                {seq_id: [row[b] for b in levels] for seq_id, row in zip(ids, rows)})

    def _top_logprobs(self, logits: torch.Tensor, k: int, full: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best draft tokens and their full-vocabulary log-probabilities, from whole
        logits (`full`) or from this TP rank's vocab slice."""
        return (topk_logprobs(logits, k) if full
                else vocab_topk_logprobs(logits, k, self._vocab_start))

    def _sampled(self, seq: Sequence, draft: torch.Tensor) -> Planned:
        """RRS candidates: q_d = softmax(draft logits / T); a chain of one sample per depth for
        DFlash, a spine with `budget // depth` SWOR siblings per depth for DDTree."""
        q = torch.softmax(draft.float() / seq.params.temperature, dim=-1)  # [L, V]
        if self.cfg.method == "dflash":
            width, depth = 1, q.shape[0]
        else:
            depth = min(q.shape[0], self.cfg.tree_budget)
            width = max(1, self.cfg.tree_budget // depth)
        tokens, parents = sample_spine_tree(q[:depth], width, seq.generator)
        tokens, parents = [seq.last_token, *tokens], [0, *parents]
        depths = [0]
        for v in range(1, len(tokens)):
            depths.append(depths[parents[v]] + 1)
        if self.cfg.method == "dflash":
            cand = Candidates.chain(tokens[0], tokens[1:])
        else:
            visible = ancestor_mask(torch.tensor([parents]))[0].to(q.device)
            cand = Candidates.tree(tokens, parents, depths, seq.num_computed, visible)
        return Planned(cand, depths, q[:depth])
