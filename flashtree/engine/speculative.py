"""One speculative step for a batch of decoding requests: draft a DFlash block each, turn it into
candidates (a chain or a DDTree; deterministic, or sampled for RRS), verify all candidates in
one target forward, walk them with the target's own rule, and commit the accepted path."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashtree.distributed.vocab import vocab_argmax, vocab_topk_logprobs
from flashtree.engine.forward_batch import BatchItem, Mode, causal_mask
from flashtree.engine.model_runner import ModelRunner
from flashtree.engine.sequence import Sequence
from flashtree.graphs.rows import RowGraphs
from flashtree.kv.cache import KVCache, PageTables
from flashtree.sampling import inverse_cdf, penalize_rows, probabilities, uniform
from flashtree.spec.dflash import ContextRows, DFlashProposer
from flashtree.spec.policy import SpecPolicy
from flashtree.spec.rrs import GeneratorDraws, sample_spine_tree, walk_rrs
from flashtree.spec.stats import SpecStats
from flashtree.spec.tree import (
    BestFirstLevels,
    ancestor_mask,
    best_first_levels,
    best_path_logprobs,
    topk_logprobs,
    tree_from_levels,
)
from flashtree.spec.verify import Candidates, greedy_walk, walk
from flashtree.transfer import lists_to_device, to_device

TREE_SAMPLING_MODES = ("match", "rrs")
Walk = tuple[list[int], list[int]]  # a request's accepted nodes (root first), committed tokens


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


@dataclass
class _Planned:
    cand: Candidates
    depths: list[int]
    draft_probs: torch.Tensor | None  # [L, V] q rows when the candidates were sampled (RRS)
    predicted: float | None = None  # the policy's raw expected accepted drafts (adaptive)


@dataclass
class _TreeBatch:
    """DDTree candidates of every request of a greedy step, all of one budget, kept on the
    device (N = budget + 1 nodes, root first, topological order)."""

    tokens: torch.Tensor  # [R, N] int64
    parent: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64
    visible: torch.Tensor  # [R, N, N] bool
    predicted: list[float | None]  # the policy's raw expected accepted drafts per request


def _levels(top_lp: torch.Tensor, *, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """best_first_levels as RowGraphs replays it: [R, L, K] -> keys, flat [R, L, width]."""
    levels = best_first_levels(top_lp, width)
    return levels.keys, levels.flat


def _tree_nodes(keys: torch.Tensor, flat: torch.Tensor, top_tok: torch.Tensor,
                roots: torch.Tensor, *, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The budget's trees as RowGraphs replays them: ([R, 3, N] tokens, parents and depths,
    [R, N, N] visibility)."""
    trees = tree_from_levels(BestFirstLevels(keys, flat), top_tok, roots, budget)
    return torch.stack([trees.tokens, trees.parent, trees.depth], dim=1), trees.visible


class SpeculativeDecoder:
    def __init__(
        self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner, cache: KVCache,
        pages: PageTables, policy: SpecPolicy | None = None,
    ) -> None:
        self.cfg, self.proposer, self.runner = cfg, proposer, runner
        self.cache, self.pages = cache, pages
        self.policy = policy  # None: every request verifies the full block or tree budget
        lm_head = runner.model.lm_head
        self._vocab_start, self._vocab_size = lm_head.vocab_start, lm_head.vocab_size
        self.stats = SpecStats()
        # DDTree candidates replay CUDA graphs (per batch bucket) where the target does.
        graphs = runner.graphs
        buckets = graphs.batch_buckets if graphs is not None else []
        use_graphs = graphs is not None and graphs.use_cuda_graphs
        self._tree_levels = RowGraphs(_levels, buckets, runner.device, use_graphs)
        self._tree_nodes = RowGraphs(_tree_nodes, buckets, runner.device, use_graphs)
        if use_graphs and cfg.method == "ddtree":
            self._capture_tree_graphs(buckets)

    def _capture_tree_graphs(self, buckets: list[int]) -> None:
        """Capture the DDTree build for every batch bucket and budget the policy can pick now:
        a capture on first use would stall that step (and skew the policy's step times)."""
        cfg, device = self.cfg, self.runner.device
        depth = cfg.block_size - 1
        k = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or self._vocab_size)
        budgets = [b for b in self.policy.levels if b > 0] if self.policy else [cfg.tree_budget]
        for rows in buckets:
            top_lp = torch.zeros(rows, depth, k, dtype=torch.float64, device=device)
            keys, flat = self._tree_levels(top_lp, width=cfg.tree_budget)
            top_tok = torch.zeros(rows, depth, k, dtype=torch.long, device=device)
            roots = torch.zeros(rows, dtype=torch.long, device=device)
            for budget in budgets:
                self._tree_nodes(keys, flat, top_tok, roots, budget=budget)

    def wants_draft(self, requests: int) -> bool:
        """Whether a decode step of `requests` speculates (the adaptive policy may run it
        plain)."""
        return self.policy is None or self.policy.should_draft(requests)

    def step(self, seqs: list[Sequence]) -> list[Verified]:
        """Returns what each request commits (accepted drafts + the target's next one) and how
        many candidates it verified; target and draft KV already hold every committed token
        but the last. The caller records the stats once stop conditions have cut the tokens."""
        self.proposer.flush()
        plans = self._plan(seqs)
        if isinstance(plans, _TreeBatch):
            walks, features = self._verify_tree_batch(seqs, plans)
            sizes, predicted = [plans.tokens.shape[1]] * len(seqs), plans.predicted
        else:
            walks, features = self._verify(seqs, plans)
            sizes = [len(p.cand.tokens) for p in plans]
            predicted = [p.predicted for p in plans]
        return self._commit(seqs, walks, sizes, predicted, features)

    def _verify(self, seqs: list[Sequence], plans: list[_Planned]
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

    def _verify_tree_batch(self, seqs: list[Sequence], trees: _TreeBatch
                           ) -> tuple[list[Walk], torch.Tensor]:
        """`_verify` for greedy requests whose trees all have N nodes, without reading the
        trees on the host: the forward's token ids and positions come from the device tensors,
        and the walks' result (with the accepted nodes' tokens) is the step's one device read."""
        r, n = trees.tokens.shape
        device = trees.tokens.device
        starts = to_device([s.num_computed for s in seqs], device)
        ids = trees.tokens.flatten()
        positions = (starts[:, None] + trees.depth).flatten()
        items = [BatchItem(s.seq_id, s.num_computed, [0] * n, all_logits=True, positions=[0] * n,
                           visible=trees.visible[i]) for i, s in enumerate(seqs)]
        logits, features = self.runner.forward(Mode.VERIFY, items, gather_logits=False,
                                               device_inputs=(ids, positions))
        assert features is not None, "verify must capture the drafter's target layers"
        argmax = vocab_argmax(logits, self._vocab_start).view(r, n)
        w = greedy_walk(trees.tokens, trees.parent, torch.full((r,), n, device=device), argmax)
        path_tokens = trees.tokens.gather(1, w.path.clamp(max=n - 1))  # [R, N]
        result = torch.cat([w.num_accepted[:, None], w.bonus[:, None], w.path, path_tokens],
                           1).tolist()
        walks = []
        for count, bonus, *rest in result:
            path, tokens = rest[:n][:count], rest[n:][:count]
            walks.append((path, tokens[1:] + [bonus]))
        return walks, features

    def _commit(self, seqs: list[Sequence], walks: list[Walk],
                sizes: list[int], predicted: list[float | None], features: torch.Tensor
                ) -> list[Verified]:
        """Keep the accepted nodes' KV and features, record the policy's and stats' inputs;
        `sizes`: each request's verified nodes (root included), in forward row order."""
        kept, kept_rows, committed, base = [], [], [], 0
        for seq, (path, new), n, expected in zip(seqs, walks, sizes, predicted):
            kept.append((seq.seq_id, seq.num_computed, path))
            kept_rows += [base + v for v in path]
            committed.append(Verified(new, n - 1))
            if self.policy is not None and expected is not None:
                self.policy.observe(seq.seq_id, len(path) - 1, expected)
            self.stats.record_budget(n - 1)
            base += n
        # The accepted nodes' KV moves to logical indices start.., the rest is dropped: one
        # batched move, and one gather of their features for the draft KV.
        self.pages.keep(self.cache, kept)
        kept_features = features[to_device(kept_rows, features.device)]
        for seq, (_, start, path) in zip(seqs, kept):
            seq.num_computed = start + len(path)
        self.proposer.inject([ContextRows(kept_features, tuple(
            (seq_id, start, len(path)) for seq_id, start, path in kept))])
        if self.policy is not None:
            self.policy.observe_speculation(len(seqs), sum(v.num_candidates for v in committed),
                                            len(kept_rows) - len(seqs))
            self.policy.forget({s.seq_id for s in seqs})
        return committed

    # ------------------------------------------------------------------ candidates
    def _plan(self, seqs: list[Sequence]) -> list[_Planned] | _TreeBatch:
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
            [(s.seq_id, s.num_computed, s.output_ids[-1], b) for s, b in drafted], gather=full
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
        plans: list[_Planned | None] = [None] * len(seqs)
        chains, trees = [], []  # indices of requests with deterministic candidates
        for i, s in enumerate(seqs):
            draft = rows.get(s.seq_id)
            if draft is not None and cfg.tree_sampling == "rrs" and not s.params.greedy:
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
                     plans: list[_Planned | None]) -> None:
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
            plans[i] = _Planned(Candidates.chain(s.output_ids[-1], drafts),
                                list(range(len(drafts) + 1)), None, predicted[j])

    def _plan_trees(self, seqs: list[Sequence], trees: list[int],
                    rows: dict[int, torch.Tensor], full: bool,
                    plans: list[_Planned | None], on_device: bool) -> _TreeBatch | None:
        """DDTree candidates: the best-first tree of the full budget, or (adaptive) of the
        budget the policy picks from the trees' own path probabilities. `on_device` (every
        request a greedy tree): when all share one budget, return them as a _TreeBatch
        instead of filling `plans`."""
        cfg = self.cfg
        stacked = torch.stack([rows[seqs[i].seq_id] for i in trees])
        root_ids = [seqs[i].output_ids[-1] for i in trees]
        roots = to_device(root_ids, stacked.device)
        k = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or self._vocab_size)
        top_lp, top_tok = self._top_logprobs(stacked, k, full)  # [R, L, k] each
        # The best-first levels at the full budget serve every smaller budget below.
        keys, flat = self._tree_levels(top_lp, width=cfg.tree_budget)
        budgets = [cfg.tree_budget] * len(trees)
        predicted: list[float | None] = [None] * len(trees)
        if self.policy is not None:
            ids = [seqs[i].seq_id for i in trees]
            # Expected accepted drafts of the best b nodes: the sum of their path probabilities.
            best = best_path_logprobs(BestFirstLevels(keys, flat), cfg.tree_budget)
            best = best.exp().cumsum(1)  # [R, budget]
            best = torch.cat([best.new_zeros(len(trees), 1), best], dim=1).tolist()
            gains = [[row[min(b, len(row) - 1)] for b in self.policy.levels] for row in best]
            budgets = self.policy.choose(ids, gains)
            predicted = [g[self.policy.levels.index(b)] for g, b in zip(gains, budgets)]
        if on_device and len(set(budgets)) == 1 and budgets[0] > 0:
            nodes, visible = self._tree_nodes(keys, flat, top_tok, roots, budget=budgets[0])
            return _TreeBatch(nodes[:, 0], nodes[:, 1], nodes[:, 2], visible, predicted)
        for budget in sorted(set(budgets)):
            group = [j for j, b in enumerate(budgets) if b == budget]
            if budget == 0:
                for j in group:
                    plans[trees[j]] = _Planned(Candidates.chain(root_ids[j], []), [0], None,
                                               predicted[j])
                continue
            index = group if len(group) < len(trees) else slice(None)
            nodes, visible = self._tree_nodes(keys[index], flat[index], top_tok[index],
                                              roots[index], budget=budget)
            # [R, 3, N] tokens, parents, depths -> one device sync for the group
            for g, (j, (tokens, parents, depths)) in enumerate(zip(group, nodes.tolist())):
                i = trees[j]
                cand = Candidates.tree(tokens, parents, depths, seqs[i].num_computed,
                                       visible[g])
                plans[i] = _Planned(cand, depths, None, predicted[j])

    def _top_logprobs(self, logits: torch.Tensor, k: int, full: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best draft tokens and their full-vocabulary log-probabilities, from whole
        logits (`full`) or from this TP rank's vocab slice."""
        return (topk_logprobs(logits, k) if full
                else vocab_topk_logprobs(logits, k, self._vocab_start))

    def _sampled(self, seq: Sequence, draft: torch.Tensor) -> _Planned:
        """RRS candidates: q_d = softmax(draft logits / T); a chain of one sample per depth for
        DFlash, a spine with `budget // depth` SWOR siblings per depth for DDTree."""
        q = torch.softmax(draft.float() / seq.params.temperature, dim=-1)  # [L, V]
        if self.cfg.method == "dflash":
            width, depth = 1, q.shape[0]
        else:
            depth = min(q.shape[0], self.cfg.tree_budget)
            width = max(1, self.cfg.tree_budget // depth)
        tokens, parents = sample_spine_tree(q[:depth], width, seq.generator)
        tokens, parents = [seq.output_ids[-1], *tokens], [0, *parents]
        depths = [0]
        for v in range(1, len(tokens)):
            depths.append(depths[parents[v]] + 1)
        if self.cfg.method == "dflash":
            cand = Candidates.chain(tokens[0], tokens[1:])
        else:
            visible = ancestor_mask(torch.tensor([parents]))[0].to(q.device)
            cand = Candidates.tree(tokens, parents, depths, seq.num_computed, visible)
        return _Planned(cand, depths, q[:depth])

    # ------------------------------------------------------------------ target decisions
    def _greedy_walks(self, plans: list[_Planned], logits: torch.Tensor
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
    def _node_decisions(seqs: list[Sequence], plans: list[_Planned], rows: list[torch.Tensor]
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
