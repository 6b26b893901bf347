"""Speculative candidates for a batch of decoding requests: one DFlash block drafted per
request, turned into a chain or a DDTree (deterministic; or sampled, for RRS). Greedy DDTree
steps keep their trees on the device (`TreeBatch`); the rest become host plans (`Planned`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.config import DEFAULT_TOPK_CAP, SpecConfig
from flashtree.distributed.vocab import vocab_argmax, vocab_topk_logprobs
from flashtree.graphs.rows import RowGraphs
from flashtree.runner.model_runner import ModelRunner
from flashtree.sequence import Sequence
from flashtree.speculative.acceptance import Candidates
from flashtree.speculative.proposer import DFlashProposer
from flashtree.speculative.tree import ancestor_mask, build_trees_from_topk, topk_logprobs
from flashtree.structured_output import mask_logits
from flashtree.transfer import to_device


@dataclass
class Planned:
    """One request's candidates as a host plan, with the nodes' depths."""

    cand: Candidates
    depths: list[int]
    draft_probs: torch.Tensor | None = None  # [L, V] q rows when the candidates were sampled


@dataclass
class TreeBatch:
    """Candidates of every request of a greedy step, kept on the device: DDTrees (N = budget + 1
    nodes, root first, topological order) or DFlash chains (N = block size, `visible` None)."""

    tokens: torch.Tensor  # [R, N] int64
    parent: torch.Tensor  # [R, N] int64
    depth: torch.Tensor  # [R, N] int64
    visible: torch.Tensor | None  # [R, N, N] bool; None: causal chains


def _tree_nodes(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, *,
                budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best-first trees as RowGraphs replays them: ([R, 3, N] tokens, parents and depths,
    [R, N, N] visibility)."""
    trees = build_trees_from_topk(top_lp, top_tok, roots, budget)
    return torch.stack([trees.tokens, trees.parent, trees.depth], dim=1), trees.visible


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


class CandidatePlanner:
    """Drafts a block per request and turns the blocks into the step's candidates."""

    def __init__(self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner) -> None:
        self.cfg, self.proposer = cfg, proposer
        lm_head = runner.model.lm_head
        self._vocab_start, self._vocab_size = lm_head.vocab_start, lm_head.vocab_size
        self._topk = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or DEFAULT_TOPK_CAP)
        # The DDTree build (~100 small kernels) replays CUDA graphs per batch bucket where the
        # target's forwards do.
        graphs = runner.graphs
        use_graphs = graphs is not None and graphs.use_cuda_graphs
        buckets = graphs.batch_buckets if graphs is not None else []
        self.device = runner.device
        self.tree_nodes = RowGraphs(_tree_nodes, buckets, self.device, use_graphs)
        if use_graphs and cfg.method == "ddtree":
            self._capture_tree_graphs(buckets)

    def _capture_tree_graphs(self, buckets: list[int]) -> None:
        """Capture the DDTree build for every batch bucket now: a capture on first use would
        stall that step."""
        depth, k = self.cfg.block_size - 1, self._topk
        for rows in buckets:
            top_lp = torch.zeros(rows, depth, k, dtype=torch.float64, device=self.device)
            top_tok = torch.zeros(rows, depth, k, dtype=torch.long, device=self.device)
            roots = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.tree_nodes(top_lp, top_tok, roots, budget=self.cfg.tree_budget)

    def _samples_tree(self, seq: Sequence) -> bool:
        """RRS requests' candidates are sampled from the draft."""
        return self.cfg.tree_sampling == "rrs" and not seq.params.greedy

    def plan(self, seqs: list[Sequence]) -> list[Planned] | TreeBatch:
        """Every request's candidates: host plans, or (greedy DDTree steps) the trees on the
        device."""
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
        chains: dict[int, list[int]] = {}  # seq_id -> the b - 1 argmax drafts (DFlash)
        if logits is not None:
            if (cfg.method == "dflash" and len(drafted) == len(seqs)
                    and all(b == cfg.block_size for b in sizes)
                    and all(s.params.argmax_only for s in seqs)):
                return self._chain_batch(seqs, logits)
            argmax = None
            if cfg.method == "dflash":  # one device sync for the batch
                argmax = (logits.argmax(dim=-1) if full
                          else vocab_argmax(logits, self._vocab_start)).tolist()
            offset = 0
            for s, b in drafted:
                rows[s.seq_id] = logits[offset : offset + b - 1]
                if argmax is not None:
                    chains[s.seq_id] = argmax[offset : offset + b - 1]
                if s.matcher is not None and logits.shape[-1] == self._vocab_size:
                    # Drafts inside the request's grammar (rejected ones would never commit).
                    rows[s.seq_id] = mask_logits(rows[s.seq_id],
                                                 s.matcher.draft_masks(rows[s.seq_id]))
                    if argmax is not None:
                        chains[s.seq_id] = rows[s.seq_id].argmax(dim=-1).tolist()
                offset += b - 1
        plans: list[Planned | None] = [None] * len(seqs)
        trees = []  # indices of requests with deterministic trees
        for i, s in enumerate(seqs):
            draft = rows.get(s.seq_id)
            if draft is not None and self._samples_tree(s):
                plans[i] = self._sampled(s, draft)
            elif draft is None or cfg.method == "dflash":
                drafts = chains.get(s.seq_id, [])
                plans[i] = Planned(Candidates.chain(s.last_token, drafts),
                                   list(range(len(drafts) + 1)))
            else:
                trees.append(i)
        if trees:
            on_device = len(trees) == len(seqs) and all(s.params.argmax_only for s in seqs)
            batch = self._plan_trees(seqs, trees, rows, full, plans, on_device)
            if batch is not None:
                return batch
        return [p for p in plans if p is not None]

    def _chain_batch(self, seqs: list[Sequence], logits: torch.Tensor) -> TreeBatch:
        """Greedy DFlash chains of whole blocks on the device: each request's bonus token and
        the argmax of its draft slots, verified without a host read in between."""
        r, n = len(seqs), self.cfg.block_size
        device = logits.device
        drafts = vocab_argmax(logits, self._vocab_start).view(r, n - 1)
        roots = to_device([s.last_token for s in seqs], device)
        depth = torch.arange(n, device=device).expand(r, n)
        return TreeBatch(torch.cat([roots[:, None], drafts], 1), (depth - 1).clamp_min(0),
                         depth, None)

    def _plan_trees(self, seqs: list[Sequence], trees: list[int],
                    rows: dict[int, torch.Tensor], full: bool,
                    plans: list[Planned | None], on_device: bool) -> TreeBatch | None:
        """DDTree candidates of `tree_budget` nodes: a TreeBatch when `on_device` (every
        request a greedy tree), else host plans in `plans`."""
        stacked = torch.stack([rows[seqs[i].seq_id] for i in trees])
        roots = to_device([seqs[i].last_token for i in trees], stacked.device)
        top_lp, top_tok = (topk_logprobs(stacked, self._topk) if full else
                           vocab_topk_logprobs(stacked, self._topk, self._vocab_start))
        nodes, visible = self.tree_nodes(top_lp, top_tok, roots, budget=self.cfg.tree_budget)
        if on_device:
            return TreeBatch(nodes[:, 0], nodes[:, 1], nodes[:, 2], visible)
        # [R, 3, N] tokens, parents, depths -> one device sync
        for g, (i, (tokens, parents, depths)) in enumerate(zip(trees, nodes.tolist())):
            cand = Candidates.tree(tokens, parents, depths, seqs[i].num_computed, visible[g])
            plans[i] = Planned(cand, depths)
        return None

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
