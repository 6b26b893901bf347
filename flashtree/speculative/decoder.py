"""One speculative step for a batch of decoding requests: candidates from the planner (a
DFlash block drafted per request, as a chain or a DDTree), all of them verified in one target
forward, walked with the target's own rule (`acceptance.py`), and the accepted path committed
(target KV kept, the drafter's context rows injected)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.config import SpecConfig
from flashtree.kv.cache import KVCache, PageTables
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.sequence import Sequence
from flashtree.speculative.acceptance import Walk, accept
from flashtree.speculative.candidates import CandidatePlanner, Planned, TreeBatch
from flashtree.speculative.proposer import ContextRows, DFlashProposer
from flashtree.speculative.stats import SpecStats
from flashtree.speculative.tree_verify import TreeBatchVerifier
from flashtree.structured_output import mask_by_grammar
from flashtree.transfer import to_device


class Verified(NamedTuple):
    tokens: list[int]  # accepted drafts + the target's next token
    num_candidates: int  # draft nodes verified (tree nodes or chain drafts)
    # The target's logits that decided each token [len(tokens), vocab], for a request that
    # asked for log-probs (else None).
    logits: torch.Tensor | None = None


class SpeculativeDecoder:
    def __init__(self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner,
                 cache: KVCache, pages: PageTables) -> None:
        self.cfg, self.proposer, self.runner = cfg, proposer, runner
        self.cache, self.pages = cache, pages
        self.stats = SpecStats()
        self.planner = CandidatePlanner(cfg, proposer, runner)
        self.tree_verifier = TreeBatchVerifier(runner, cache, proposer, cfg.max_budget + 1)

    def step(self, seqs: list[Sequence]) -> list[Verified]:
        """Returns what each request commits (accepted drafts + the target's next one) and how
        many candidates it verified; target and draft KV already hold every committed token
        but the last. The caller records the stats once stop conditions have cut the tokens."""
        self.proposer.flush()
        plans = self.planner.plan(seqs)
        if isinstance(plans, TreeBatch):  # argmax-only requests: no log-probs asked
            walks = self.tree_verifier.verify(seqs, plans)
            sizes = [plans.tokens.shape[1]] * len(seqs)
            path_logits: list[torch.Tensor | None] = [None] * len(seqs)
        else:
            walks, features, logits = self._verify(seqs, plans)
            sizes = [len(p.cand.tokens) for p in plans]
            self._keep(seqs, walks, sizes, features)
            path_logits = _path_logits(seqs, walks, sizes, logits)
        committed = []
        for seq, (path, new), n, rows in zip(seqs, walks, sizes, path_logits):
            seq.num_computed += len(path)
            self.pages.set_length(seq.seq_id, seq.num_computed)
            committed.append(Verified(new, n - 1, rows))
            self.stats.record_budget(n - 1)
        return committed

    def _verify(self, seqs: list[Sequence], plans: list[Planned]
                ) -> tuple[list[Walk], torch.Tensor, torch.Tensor]:
        """One target forward over every request's candidates, and the walks; also the
        forward's features and logits."""
        items = [
            BatchItem(s.seq_id, s.num_computed, p.cand.tokens, all_logits=True,
                      positions=p.cand.positions, visible=p.cand.visible)
            for s, p in zip(seqs, plans)
        ]
        all_greedy = all(s.params.argmax_only for s in seqs)
        logits, features = self.runner.forward(Mode.VERIFY, items, gather_logits=not all_greedy)
        assert features is not None, "verify must capture the drafter's target layers"
        if any(s.matcher is not None for s in seqs):
            logits = mask_by_grammar(logits, [(s.matcher, p.cand.tokens, p.cand.parents)
                                              for s, p in zip(seqs, plans)])
        return accept(seqs, plans, logits, self.runner.model.lm_head.vocab_start), features, logits

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


def _path_logits(seqs: list[Sequence], walks: list[Walk], sizes: list[int], logits: torch.Tensor
                 ) -> list[torch.Tensor | None]:
    """Per request that asked for log-probs, the verify rows of its accepted path (node j
    decided committed token j); `sizes`: each request's verified nodes, in row order."""
    out: list[torch.Tensor | None] = []
    base = 0
    for seq, (path, _), n in zip(seqs, walks, sizes):
        wanted = seq.params.logprobs is not None
        out.append(logits[to_device([base + v for v in path], logits.device)] if wanted else None)
        base += n
    return out

