"""A speculative step's candidates from its draft logits: per request a DFlash chain or a
DDTree (deterministic; or sampled, for RRS). A greedy step over whole blocks keeps them on the
device (`DeviceCandidates`); any other step gets host `Candidates`."""

from __future__ import annotations

import torch

from flashtree.config import DEFAULT_TOPK_CAP, SpecConfig
from flashtree.distributed.vocab import vocab_argmax, vocab_topk_logprobs
from flashtree.graphs.rows import RowGraphs
from flashtree.runner.model_runner import ModelRunner
from flashtree.sequence import Sequence
from flashtree.speculative.tree import ancestor_mask, topk_logprobs, tree_nodes
from flashtree.speculative.types import Candidates, DeviceCandidates
from flashtree.structured_output import mask_logits
from flashtree.transfer import to_device


def _tree_nodes(top_lp: torch.Tensor, top_tok: torch.Tensor, roots: torch.Tensor, *,
                budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best-first trees as RowGraphs replays them: ([R, 4, N] tokens, parents, depths and
    selection ranks, [R, N, N] visibility). On CUDA one Triton launch builds them; the torch
    build elsewhere (the same trees up to ties)."""
    if top_lp.is_cuda:
        from flashtree.speculative.tree_kernel import build_trees_in_one_launch  # needs triton

        return build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    return tree_nodes(top_lp, top_tok, roots, budget=budget)


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


class CandidateBuilder:
    """Turns the draft logits of a step's requests into their candidates."""

    def __init__(self, cfg: SpecConfig, runner: ModelRunner) -> None:
        self.cfg = cfg
        lm_head = runner.model.lm_head
        self._vocab_start, self._vocab_size = lm_head.vocab_start, lm_head.vocab_size
        self._topk = min(cfg.tree_budget, self._vocab_size, cfg.topk_cap or DEFAULT_TOPK_CAP)
        # The DDTree build replays CUDA graphs per batch bucket where the target's forwards do
        # (on CUDA one kernel, which replays sooner than it launches directly).
        graphs = runner.graphs
        use_graphs = graphs is not None and graphs.use_cuda_graphs
        buckets = graphs.batch_buckets if graphs is not None else []
        self.device = runner.device
        self.tree_nodes = RowGraphs(_tree_nodes, buckets, self.device, use_graphs)
        if use_graphs and cfg.method == "ddtree":
            self._capture_tree_graphs(buckets)

    def _capture_tree_graphs(self, buckets: list[int]) -> None:
        """Capture the DDTree build for every batch bucket and budget now: a capture on first
        use would stall that step."""
        depth, k = self.cfg.block_size - 1, self._topk
        for rows in buckets:
            top_lp = torch.zeros(rows, depth, k, dtype=torch.float32, device=self.device)
            top_tok = torch.zeros(rows, depth, k, dtype=torch.long, device=self.device)
            roots = torch.zeros(rows, dtype=torch.long, device=self.device)
            for budget in self.cfg.budgets:
                self.tree_nodes(top_lp, top_tok, roots, budget=budget)

    def on_device(self, logits: torch.Tensor, roots: torch.Tensor, budget: int
                  ) -> DeviceCandidates:
        """Every request's candidates without a host read: greedy DDTrees of `budget` nodes, or
        the argmax chains of greedy DFlash blocks. logits: [R * (block_size - 1), V_rank], this
        TP rank's vocab slice of every request's whole draft block; roots: [R] their bonus
        tokens, on the device."""
        r, depth = roots.shape[0], self.cfg.block_size - 1
        if self.cfg.method == "ddtree":
            nodes, visible = self._trees(logits.unflatten(0, (r, depth)), roots, False, budget)
            return DeviceCandidates(nodes[:, 0], nodes[:, 1], nodes[:, 2], visible, nodes[:, 3])
        drafts = vocab_argmax(logits, self._vocab_start).view(r, depth)
        node_depth = torch.arange(depth + 1, device=logits.device).expand(r, depth + 1)
        return DeviceCandidates(torch.cat([roots[:, None], drafts], 1),
                                (node_depth - 1).clamp_min(0), node_depth, None, None)

    def on_host(self, seqs: list[Sequence], sizes: list[int], logits: torch.Tensor | None,
                full: bool, budget: int) -> list[Candidates]:
        """Every request's candidates as host lists (trees of `budget` nodes). sizes: each
        request's draft block (its bonus token included; 1: not drafted, a lone root); logits:
        the drafted blocks' rows, request after request (the whole vocabulary when `full`, else
        this TP rank's slice)."""
        rows, chains = self._draft_rows(seqs, sizes, logits, full)
        cands: list[Candidates | None] = [None] * len(seqs)
        trees = []  # indices of requests with deterministic trees
        for i, s in enumerate(seqs):
            draft = rows.get(s.seq_id)
            if draft is not None and self._samples_tree(s):
                cands[i] = self._sampled(s, draft, budget)
            elif draft is None or self.cfg.method == "dflash":
                cands[i] = Candidates.chain(s.last_token, chains.get(s.seq_id, []))
            else:
                trees.append(i)
        if trees:
            stacked = torch.stack([rows[seqs[i].seq_id] for i in trees])
            roots = to_device([seqs[i].last_token for i in trees], stacked.device)
            nodes, visible = self._trees(stacked, roots, full, budget)
            # [R, 4, N] tokens, parents, depths, ranks -> one device sync
            for g, (i, (tokens, parents, depths, ranks)) in enumerate(zip(trees, nodes.tolist())):
                cands[i] = Candidates.tree(tokens, parents, depths, visible[g], ranks=ranks)
        return [c for c in cands if c is not None]

    def _draft_rows(self, seqs: list[Sequence], sizes: list[int], logits: torch.Tensor | None,
                    full: bool) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
        """Per drafted request (seq_id), its draft rows [b - 1, V], masked by its grammar, and
        for DFlash the argmax drafts of its chain (one device sync for the batch)."""
        rows: dict[int, torch.Tensor] = {}
        chains: dict[int, list[int]] = {}
        if logits is None:
            return rows, chains
        argmax = None
        if self.cfg.method == "dflash":
            argmax = (logits.argmax(dim=-1) if full
                      else vocab_argmax(logits, self._vocab_start)).tolist()
        offset = 0
        for s, b in zip(seqs, sizes):
            if b <= 1:
                continue
            rows[s.seq_id] = logits[offset : offset + b - 1]
            if argmax is not None:
                chains[s.seq_id] = argmax[offset : offset + b - 1]
            if s.matcher is not None and logits.shape[-1] == self._vocab_size:
                # Drafts inside the request's grammar (rejected ones would never commit).
                rows[s.seq_id] = mask_logits(rows[s.seq_id], s.matcher.draft_masks(rows[s.seq_id]))
                if argmax is not None:
                    chains[s.seq_id] = rows[s.seq_id].argmax(dim=-1).tolist()
            offset += b - 1
        return rows, chains

    def _trees(self, drafts: torch.Tensor, roots: torch.Tensor, full: bool, budget: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """DDTrees of `budget` nodes from drafts [R, L, V] (the whole vocabulary when `full`,
        else this TP rank's slice): ([R, 4, N] tokens, parents, depths and selection ranks,
        [R, N, N] visibility), on the device. The top-k is the largest budget's, so every
        budget's tree is the same prefix of the largest one's selection."""
        top_lp, top_tok = (topk_logprobs(drafts, self._topk) if full else
                           vocab_topk_logprobs(drafts, self._topk, self._vocab_start))
        return self.tree_nodes(top_lp, top_tok, roots, budget=budget)

    def _samples_tree(self, seq: Sequence) -> bool:
        """RRS requests' candidates are sampled from the draft."""
        return self.cfg.tree_sampling == "rrs" and not seq.params.greedy

    def _sampled(self, seq: Sequence, draft: torch.Tensor, budget: int) -> Candidates:
        """RRS candidates: q_d = softmax(draft logits / T); a chain of one sample per depth for
        DFlash, a spine with `budget // depth` SWOR siblings per depth for DDTree."""
        q = torch.softmax(draft.float() / seq.params.temperature, dim=-1)  # [L, V]
        if self.cfg.method == "dflash":
            width, depth = 1, q.shape[0]
        else:
            depth = min(q.shape[0], budget)
            width = max(1, budget // depth)
        tokens, parents = sample_spine_tree(q[:depth], width, seq.generator)
        tokens, parents = [seq.last_token, *tokens], [0, *parents]
        if self.cfg.method == "dflash":
            return Candidates.chain(tokens[0], tokens[1:], draft_probs=q[:depth])
        depths = [0]
        for v in range(1, len(tokens)):
            depths.append(depths[parents[v]] + 1)
        visible = ancestor_mask(torch.tensor([parents]))[0].to(q.device)
        return Candidates.tree(tokens, parents, depths, visible, draft_probs=q[:depth])
