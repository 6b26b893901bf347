"""One speculative step for a batch of decoding requests: a DFlash block drafted per request,
turned into candidates (a chain or a DDTree, `CandidateBuilder`), all of them verified in one
target forward, walked with the target's own rule (`acceptance.py`), and the accepted path
committed (target KV kept, the drafter's context rows injected).

The step decides up front where its candidates live: when every request is greedy without
penalties and drafts a whole block, they stay on the device from draft to commit
(`DeviceVerifier`, one device read); any other step builds them on the host."""

from __future__ import annotations

import torch

from flashtree.config import SpecConfig
from flashtree.kv.cache import KVCache, PageTables
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.sequence import Sequence
from flashtree.speculative.acceptance import accept
from flashtree.speculative.candidate_builder import CandidateBuilder
from flashtree.speculative.device_verifier import DeviceVerifier
from flashtree.speculative.proposer import Ahead, ContextRows, DFlashProposer
from flashtree.speculative.types import Candidates, DeviceCandidates, Verified, Walk
from flashtree.structured_output import mask_by_grammar
from flashtree.transfer import to_device


class SpeculativeStep:
    def __init__(self, cfg: SpecConfig, proposer: DFlashProposer, runner: ModelRunner,
                 cache: KVCache, pages: PageTables) -> None:
        self.cfg, self.proposer, self.runner = cfg, proposer, runner
        self.cache, self.pages = cache, pages
        self.builder = CandidateBuilder(cfg, runner)
        self.device_verifier = DeviceVerifier(runner, cache, proposer,
                                              [b + 1 for b in cfg.budgets])

    def run(self, seqs: list[Sequence], budget: int) -> list[Verified]:
        """Returns what each request commits (accepted drafts + the target's next one) and how
        many candidates it verified; target and draft KV already hold every committed token
        but the last. `budget`: DDTree nodes, one of the config's `budgets`."""
        assert budget in self.cfg.budgets, f"budget {budget}; captured: {self.cfg.budgets}"
        self.proposer.flush()
        sizes = self._block_sizes(seqs)
        if (all(s.params.argmax_only for s in seqs)
                and all(b == self.cfg.block_size for b in sizes)):
            return self._on_device(seqs, sizes, budget)
        return self._on_host(seqs, sizes, budget)

    def _block_sizes(self, seqs: list[Sequence]) -> list[int]:
        """Each request's draft block, its bonus token included (1: nothing to draft)."""
        if self.cfg.method == "dflash":
            # Block b = min(B, room left): the last blocks shrink, as the reference's do.
            return [min(self.cfg.block_size, s.max_total_len - s.num_computed) for s in seqs]
        return [self.cfg.block_size] * len(seqs)

    def _draft(self, seqs: list[Sequence], sizes: list[int], full: bool
               ) -> torch.Tensor | None:
        """One drafter forward for every block of more than the bonus token: logits
        [sum(b - 1), V] (the whole vocabulary when `full`, else this TP rank's slice)."""
        blocks = _blocks(seqs, sizes)
        return self.proposer.draft_logits(blocks, gather=full) if blocks else None

    def _on_device(self, seqs: list[Sequence], sizes: list[int], budget: int
                   ) -> list[Verified]:
        cands = self._candidates_ahead(seqs, sizes, budget)
        if cands is None:
            logits = self._draft(seqs, sizes, full=False)
            assert logits is not None, "every request of a device step drafts a whole block"
            roots = to_device([s.last_token for s in seqs], logits.device)
            cands = self.builder.on_device(logits, roots, budget)

        def queue_candidates(ahead: Ahead, roots: torch.Tensor) -> None:
            # The next step's candidates, queued behind its drafts while the host finishes.
            ahead.candidates = (budget, self.builder.on_device(ahead.logits, roots, budget))

        walks, ranks = self.device_verifier.verify(seqs, cands, queue_candidates)
        n = cands.tokens.shape[1]
        return self._commit(seqs, walks, [n] * len(seqs), [None] * len(seqs), ranks)

    def _candidates_ahead(self, seqs: list[Sequence], sizes: list[int], budget: int
                          ) -> DeviceCandidates | None:
        """The candidates the last step queued for these blocks at `budget` (taken), if any."""
        blocks = _blocks(seqs, sizes)
        ahead = self.proposer.peek_ahead(blocks, gather=False)
        if ahead is None or ahead.candidates is None or ahead.candidates[0] != budget:
            return None
        self.proposer.drafted_ahead(blocks, gather=False)
        return ahead.candidates[1]

    def _on_host(self, seqs: list[Sequence], sizes: list[int], budget: int
                 ) -> list[Verified]:
        # Only RRS sampling needs whole draft distributions; argmax and tree top-k run on the
        # TP ranks' vocab slices.
        full = self.cfg.tree_sampling == "rrs" and any(
            not s.params.greedy for s, b in zip(seqs, sizes) if b > 1)
        cands = self.builder.on_host(seqs, sizes, self._draft(seqs, sizes, full), full, budget)
        walks, features, logits = self._verify(seqs, cands)
        counts = [len(c.tokens) for c in cands]
        self._keep(seqs, walks, counts, features)
        ranks = [None if c.ranks is None else [c.ranks[v] for v in path[1:]]
                 for c, (path, _) in zip(cands, walks)]
        return self._commit(seqs, walks, counts, _path_logits(seqs, walks, counts, logits),
                            ranks)

    def _commit(self, seqs: list[Sequence], walks: list[Walk], counts: list[int],
                path_logits: list[torch.Tensor | None], ranks: list[list[int] | None]
                ) -> list[Verified]:
        """Advance each request past its accepted nodes; `counts`: its verified nodes (root
        included); `ranks`: its accepted drafts' selection ranks (None: not a best-first
        tree)."""
        committed = []
        for seq, (path, new), n, rows, accepted_ranks in zip(seqs, walks, counts, path_logits,
                                                             ranks):
            seq.num_computed += len(path)
            self.pages.set_length(seq.seq_id, seq.num_computed)
            committed.append(Verified(new, n - 1, rows, accepted_ranks))
        return committed

    def _verify(self, seqs: list[Sequence], cands: list[Candidates]
                ) -> tuple[list[Walk], torch.Tensor, torch.Tensor]:
        """One target forward over every request's candidates, and the walks; also the
        forward's features and logits."""
        items = [
            BatchItem(s.seq_id, s.num_computed, c.tokens, all_logits=True,
                      positions=c.positions(s.num_computed), visible=c.visible)
            for s, c in zip(seqs, cands)
        ]
        all_greedy = all(s.params.argmax_only for s in seqs)
        logits, features = self.runner.forward(Mode.VERIFY, items, gather_logits=not all_greedy)
        assert features is not None, "verify must capture the drafter's target layers"
        if any(s.matcher is not None for s in seqs):
            logits = mask_by_grammar(logits, [(s.matcher, c.tokens, c.parents)
                                              for s, c in zip(seqs, cands)])
        return accept(seqs, cands, logits, self.runner.model.lm_head.vocab_start), features, logits

    def _keep(self, seqs: list[Sequence], walks: list[Walk], counts: list[int],
              features: torch.Tensor) -> None:
        """Keep the accepted nodes' target KV (moved to logical indices start..) and inject
        their features into the draft cache; `counts`: each request's verified nodes (root
        included), in forward row order."""
        kept, kept_rows, base = [], [], 0
        for seq, (path, _), n in zip(seqs, walks, counts):
            kept.append((seq.seq_id, seq.num_computed, path))
            kept_rows += [base + v for v in path]
            base += n
        # One batched move, and one gather of their features for the draft KV.
        self.pages.keep(self.cache, kept)
        kept_features = features[to_device(kept_rows, features.device)]
        self.proposer.inject([ContextRows(kept_features, tuple(
            (seq_id, start, len(path)) for seq_id, start, path in kept))])


def _blocks(seqs: list[Sequence], sizes: list[int]) -> list[tuple[int, int, int, int]]:
    """(seq_id, committed length, bonus token, block size) of every block that drafts."""
    return [(s.seq_id, s.num_computed, s.last_token, b) for s, b in zip(seqs, sizes) if b > 1]


def _path_logits(seqs: list[Sequence], walks: list[Walk], counts: list[int],
                 logits: torch.Tensor) -> list[torch.Tensor | None]:
    """Per request that asked for log-probs, the verify rows of its accepted path (node j
    decided committed token j); `counts`: each request's verified nodes, in row order."""
    out: list[torch.Tensor | None] = []
    base = 0
    for seq, (path, _), n in zip(seqs, walks, counts):
        wanted = seq.params.logprobs is not None
        out.append(logits[to_device([base + v for v in path], logits.device)] if wanted else None)
        base += n
    return out
