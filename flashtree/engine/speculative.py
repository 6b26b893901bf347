"""One speculative step for a batch of decoding requests: candidates from the planner
(`engine/candidates.py`: a DFlash block drafted per request, as a chain or a DDTree), all of
them verified in one target forward, walked with the target's own rule, and the accepted path
committed (target KV kept, the drafter's context rows injected)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashtree.distributed.vocab import vocab_argmax
from flashtree.engine.candidates import CandidatePlanner, Planned, TreeBatch
from flashtree.engine.forward_batch import BatchItem, Mode, causal_mask
from flashtree.engine.model_runner import ModelRunner
from flashtree.engine.sequence import Sequence
from flashtree.engine.tree_verify import TreeBatchVerifier, Walk
from flashtree.kv.cache import KVCache, PageTables
from flashtree.sampling import inverse_cdf, penalize_rows, probabilities, uniform
from flashtree.spec.dflash import ContextRows, DFlashProposer
from flashtree.spec.policy import SpecPolicy, StepOutcome
from flashtree.spec.rrs import GeneratorDraws, walk_rrs
from flashtree.spec.stats import SpecStats
from flashtree.spec.verify import Candidates, greedy_walk, walk
from flashtree.transfer import lists_to_device, to_device

TREE_SAMPLING_MODES = ("match", "rrs")


class Verified(NamedTuple):
    tokens: list[int]  # accepted drafts + the target's next token
    num_candidates: int  # draft nodes verified (tree nodes or chain drafts)


@dataclass(frozen=True)
class SpecConfig:
    method: str  # "dflash" (chain) | "ddtree" (tree)
    block_size: int
    tree_budget: int  # DDTree non-root nodes
    topk_cap: int | None
    tree_sampling: str  # "match" (sample-and-match on deterministic candidates) | "rrs"

    def __post_init__(self) -> None:
        assert self.method in ("dflash", "ddtree"), self.method
        if self.tree_sampling not in TREE_SAMPLING_MODES:
            raise ValueError(f"tree_sampling={self.tree_sampling!r}; allowed: "
                             f"{list(TREE_SAMPLING_MODES)}")

    @property
    def max_budget(self) -> int:
        """Draft candidates verified per request at most: tree nodes or chain drafts."""
        return self.tree_budget if self.method == "ddtree" else self.block_size - 1

    @property
    def lookahead(self) -> int:
        """Tokens a step writes past the committed ones: the draft block, and the candidates
        (a chain of block_size, or a tree of tree_budget + 1 nodes)."""
        verified = self.tree_budget + 1 if self.method == "ddtree" else self.block_size
        return max(self.block_size, verified) - 1


class SpeculativeDecoder:
    def __init__(
        self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner, cache: KVCache,
        pages: PageTables, policy: SpecPolicy | None = None,
    ) -> None:
        self.cfg, self.proposer, self.runner = cfg, proposer, runner
        self.cache, self.pages = cache, pages
        self.policy = policy  # None: every request verifies the full block or tree budget
        self._vocab_start = runner.model.lm_head.vocab_start
        self.stats = SpecStats()
        # The batch of the last step that had the policy forget every request outside it.
        self._recorded_ids: list[int] = []
        self.planner = CandidatePlanner(cfg, proposer, runner, policy)
        self.tree_verifier = None
        if cfg.method == "ddtree":
            budgets = [b for b in policy.levels if b > 0] if policy else [cfg.tree_budget]
            self.tree_verifier = TreeBatchVerifier(runner, cache, proposer,
                                                   [b + 1 for b in budgets])

    def wants_draft(self, seqs: list[Sequence], others_wait: bool) -> bool:
        """Whether a decode step of `seqs` speculates (the adaptive policy may run it plain,
        and chooses DDTree budgets here, before drafting); `others_wait`: requests wait for
        room in the batch."""
        if self.policy is None:
            return True
        def remaining() -> list[int]:  # tokens each request may still generate
            return [s.max_total_len - s.num_tokens for s in seqs]

        if not self.policy.should_draft(len(seqs), None if others_wait else remaining):
            return False
        if self.cfg.method == "ddtree":
            self.planner.choose_trees(seqs)
        return True

    def step(self, seqs: list[Sequence]) -> list[Verified]:
        """Returns what each request commits (accepted drafts + the target's next one) and how
        many candidates it verified; target and draft KV already hold every committed token
        but the last. The caller records the stats once stop conditions have cut the tokens."""
        self.proposer.flush()
        plans = self.planner.plan(seqs)
        if isinstance(plans, TreeBatch):
            assert self.tree_verifier is not None
            walks = self.tree_verifier.verify(
                seqs, plans, meanwhile=lambda: self._policy_meanwhile(len(seqs)))
            sizes, predicted = [plans.tokens.shape[1]] * len(seqs), [None] * len(seqs)
        else:
            walks, features = self._verify(seqs, plans)
            sizes, predicted = [len(p.cand.tokens) for p in plans], [p.predicted for p in plans]
            self._keep(seqs, walks, sizes, features)
        settled, reach = self.planner.settle()
        predicted = [settled.get(s.seq_id, p) for s, p in zip(seqs, predicted)]
        return self._record(seqs, walks, sizes, predicted, reach,
                            commit_one=self.policy is not None and self.policy.probing)

    def _policy_meanwhile(self, requests: int) -> None:
        """The policy's host work that needs none of this step's results (`meanwhile`; and
        after a steady step, the next one's tree budgets where it chooses), done while the
        device runs its target forward."""
        if self.policy is None:
            return
        self.policy.meanwhile(requests)
        if self.cfg.method == "ddtree" and self.policy.steady:
            self.planner.prepare_choice()

    def _verify(self, seqs: list[Sequence], plans: list[Planned]
                ) -> tuple[list[Walk], torch.Tensor]:
        """One target forward over every request's candidates and the walks: per request the
        accepted nodes (root first) and the committed tokens; and the forward's features."""
        items = [
            BatchItem(s.seq_id, s.num_computed, p.cand.tokens, all_logits=True,
                      positions=p.cand.positions, visible=p.cand.visible)
            for s, p in zip(seqs, plans)
        ]
        all_greedy = all(s.params.argmax_only for s in seqs)
        logits, features = self.runner.forward(Mode.VERIFY, items, gather_logits=not all_greedy)
        assert features is not None, "verify must capture the drafter's target layers"
        self._policy_meanwhile(len(seqs))
        if all_greedy:
            return self._greedy_walks(plans, logits), features
        rows, base = [], 0
        for seq, plan in zip(seqs, plans):
            n = len(plan.cand.tokens)
            rows.append(self._processed_rows(seq, plan.cand, logits[base : base + n]))
            base += n
        decisions = self._node_decisions(seqs, plans, rows)
        walks = []
        for seq, plan, seq_rows, seq_decisions in zip(seqs, plans, rows, decisions):
            if plan.draft_probs is not None:
                walks.append(walk_rrs(plan.cand.children, plan.depths,
                                      lambda v, _prev, r=seq_rows: r[v], plan.draft_probs,
                                      GeneratorDraws(seq.generator)))
            else:
                walks.append(walk(plan.cand.children, lambda v, _prev, d=seq_decisions: d[v]))
        return walks, features

    def _keep(self, seqs: list[Sequence], walks: list[Walk], sizes: list[int],
              features: torch.Tensor) -> None:
        """Keep the accepted nodes' target KV (moved to logical indices start..) and inject
        their features into the draft cache; `sizes`: each request's verified nodes (root
        included), in forward row order."""
        kept, kept_rows, base = [], [], 0
        for seq, (path, _), n in zip(seqs, walks, sizes):
            kept.append((seq.seq_id, seq.num_computed, path))
            kept_rows += [base + v for v in path]
            base += n
        # One batched move, and one gather of their features for the draft KV.
        self.pages.keep(self.cache, kept)
        kept_features = features[to_device(kept_rows, features.device)]
        self.proposer.inject([ContextRows(kept_features, tuple(
            (seq_id, start, len(path)) for seq_id, start, path in kept))])

    def _record(self, seqs: list[Sequence], walks: list[Walk], sizes: list[int],
                predicted: list[float | None], reach: dict[int, list[float]],
                commit_one: bool) -> list[Verified]:
        """Advance the requests past their accepted nodes (the caches hold them), record the
        stats' inputs and hand the policy the step's outcome (`StepOutcome`; `reach`: the
        trees' gains per level, from a step that chose them). `commit_one` (a policy's
        probe): commit only the root's token, which plain decoding would have produced; the
        KV and draft context written past it are never read (lengths end before them) and
        are overwritten as the next tokens are computed."""
        committed, accepted = [], 0
        paces: list[tuple[int, int]] = []
        calibrations: list[tuple[int, int, float]] = []
        for seq, (path, new), n, expected in zip(seqs, walks, sizes, predicted):
            kept = path[:1] if commit_one else path
            seq.num_computed += len(kept)
            self.pages.set_length(seq.seq_id, seq.num_computed)
            committed.append(Verified(new[: len(kept)], n - 1))
            accepted += len(path) - 1
            if self.policy is not None:
                paces.append((seq.seq_id, len(path) - 1))
                if expected is not None:
                    calibrations.append((seq.seq_id, len(path) - 1, expected))
            self.stats.record_budget(n - 1)
        if self.policy is not None:
            verified = sum(v.num_candidates for v in committed)
            self.policy.hand_over(StepOutcome(len(seqs), verified, accepted, paces,
                                              calibrations, reach))
            ids = [s.seq_id for s in seqs]
            if ids != self._recorded_ids:  # else the policy holds no other request's state
                self.policy.forget(set(ids))
                self._recorded_ids = ids
        return committed

    # ------------------------------------------------------------------ candidates
    # ------------------------------------------------------------------ target decisions
    def _greedy_walks(self, plans: list[Planned], logits: torch.Tensor
                      ) -> list[Walk]:
        """Every request's greedy walk as one batch of device ops (TP ranks reduce their vocab
        slices for the argmax) and one host sync for the result: per request, the accepted
        nodes (root first) and the committed tokens (accepted drafts + the bonus)."""
        device = logits.device
        sizes = [len(p.cand.tokens) for p in plans]
        n, starts = max(sizes), [0]
        for size in sizes:
            starts.append(starts[-1] + size)

        def padded(rows: list[list[int]]) -> list[int]:  # [R * n], row-major
            return [v for r in rows for v in r + [0] * (n - len(r))]

        # Padding nodes read any real row of their request: they are never accepted.
        rows, tokens, parents, num_nodes = lists_to_device([
            padded([[s + min(v, size - 1) for v in range(n)] for s, size in zip(starts, sizes)]),
            padded([p.cand.tokens for p in plans]), padded([p.cand.parents for p in plans]),
            sizes], device)
        argmax = vocab_argmax(logits, self._vocab_start)  # [sum(sizes)]
        w = greedy_walk(tokens.view(-1, n), parents.view(-1, n), num_nodes,
                        argmax[rows.view(-1, n)])
        result = torch.cat([w.num_accepted[:, None], w.bonus[:, None], w.path], 1).tolist()
        walks = []
        for plan, (count, bonus, *path) in zip(plans, result):
            path = path[:count]
            walks.append((path, [plan.cand.tokens[v] for v in path[1:]] + [bonus]))
        return walks

    @staticmethod
    def _processed_rows(seq: Sequence, cand: Candidates, logits: torch.Tensor) -> torch.Tensor:
        """What plain decoding would sample from at every node, all nodes at once: penalties
        count the committed tokens plus the node's own path (its ancestors below the root, and
        itself). logits: [n, V] -> penalized logits (greedy) or probabilities [n, V]."""
        n, vocab = logits.shape
        visible = cand.visible
        if visible is None:  # a chain: each node's path is every node up to it
            visible = causal_mask(n, logits.device)
        path_tokens = to_device(cand.tokens[1:], logits.device)
        one_hot = torch.nn.functional.one_hot(path_tokens, vocab).to(logits.dtype)  # [n-1, V]
        path_counts = visible[:, 1:].to(device=logits.device, dtype=logits.dtype) @ one_hot
        rows = penalize_rows(logits, seq.params, seq.prompt_ids, seq.output_ids, path_counts)
        return rows if seq.params.greedy else probabilities(rows, seq.params)

    @staticmethod
    def _node_decisions(seqs: list[Sequence], plans: list[Planned], rows: list[torch.Tensor]
                        ) -> list[list[int] | None]:
        """The target's decision at every node of every request but RRS ones (None): argmax,
        or a draw from the node's own distribution with the uniform of the output position it
        decides (sample-and-match; plain decoding draws that position with the same uniform).
        One device read for the batch."""
        picks = []
        for seq, plan, seq_rows in zip(seqs, plans, rows):
            if plan.draft_probs is not None:
                continue
            if seq.params.greedy:
                picks.append(seq_rows.argmax(dim=-1))
            else:
                base = len(seq.output_ids)  # the root decides output position base
                picks.append(inverse_cdf(seq_rows,
                                         [uniform(seq.seed, base + d) for d in plan.depths]))
        flat = iter(torch.cat(picks).tolist() if picks else [])
        return [None if plan.draft_probs is not None
                else list(itertools.islice(flat, len(plan.cand.tokens))) for plan in plans]
