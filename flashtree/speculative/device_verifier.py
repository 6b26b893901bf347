"""Verification of a greedy step whose candidates stay on the device (`DeviceCandidates`:
DDTrees or DFlash chains): one target forward over every request's candidates, the greedy
walks, and the commit of the accepted nodes (their target KV moved into place, their features
injected into the draft cache) all queued before the step's one device read, which then only
tells the host what was committed.
The walk and the commit's index arithmetic (~30 small kernels) replay from CUDA graphs per
batch bucket and tree size where the target's forwards do."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashtree.distributed.vocab import vocab_argmax
from flashtree.graphs.rows import RowGraphs
from flashtree.kv.cache import KVCache
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.sequence import Sequence
from flashtree.speculative.acceptance import greedy_walk
from flashtree.speculative.proposer import Ahead, ContextRows, DFlashProposer
from flashtree.speculative.types import DeviceCandidates, Walk
from flashtree.transfer import start_to_host, to_device


def walk_and_keep(tokens: torch.Tensor, parent: torch.Tensor, rank: torch.Tensor,
                  target: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, *,
                  scratch: int) -> tuple[torch.Tensor, ...]:
    """The greedy walks of R trees of N nodes and where their accepted nodes go.

    tokens, parent, rank (selection ranks), target (the target's argmax at each node), slots
    (each node's cache slot in the verify forward): [R, N] int64; starts: [R] committed
    lengths. Returns the host's result [R, 2 + 3N] (accepted nodes, bonus token, accepted
    nodes then padding N, their tokens, their ranks), and per node row [R, N]: the node kept
    at that row (clamped path), the source and destination slots of the KV move and the row's
    position; rows past the accepted path move scratch onto scratch."""
    r, n = tokens.shape
    w = greedy_walk(tokens, parent, torch.full((r,), n, device=tokens.device), target)
    path = w.path.clamp(max=n - 1)
    offsets = torch.arange(n, device=tokens.device)
    kept = offsets < w.num_accepted[:, None]
    src = torch.where(kept, slots.gather(1, path), scratch)
    dst = torch.where(kept, slots, scratch)
    result = torch.cat([w.num_accepted[:, None], w.bonus[:, None], w.path,
                        tokens.gather(1, path), rank.gather(1, path)], 1)
    return result, path, src, dst, starts[:, None] + offsets


class DeviceVerifier:
    """Verifies and commits `DeviceCandidates`."""

    def __init__(self, runner: ModelRunner, cache: KVCache, proposer: DFlashProposer,
                 tree_sizes: list[int]) -> None:
        """`tree_sizes`: the nodes per tree (root included) a step may verify, captured for
        every batch bucket up front (a capture on first use would stall that step)."""
        self.runner, self.cache, self.proposer = runner, cache, proposer
        self._vocab_start = runner.model.lm_head.vocab_start
        self._scratch = runner.pages.scratch_slot
        graphs = runner.graphs
        use_graphs = graphs is not None and graphs.use_cuda_graphs
        buckets = graphs.batch_buckets if graphs is not None else []
        self.walks = RowGraphs(walk_and_keep, buckets, runner.device, use_graphs)
        if use_graphs:
            for rows in self.walks.buckets:
                for size in tree_sizes:
                    nodes = torch.zeros(rows, size, dtype=torch.long, device=runner.device)
                    self.walks(nodes, nodes, nodes, nodes, nodes, nodes[:, 0],
                               scratch=self._scratch)

    def verify(self, seqs: list[Sequence], cands: DeviceCandidates,
               queue_candidates: Callable[[Ahead, torch.Tensor], None] | None = None
               ) -> tuple[list[Walk], list[list[int] | None]]:
        """Verify and commit on the device; return per request the accepted nodes (root
        first) and the committed tokens (accepted drafts + the bonus), and the accepted
        drafts' selection ranks (trees; None for chains). The target and draft caches hold the
        accepted nodes at logical indices start.. (page lengths are the caller's to set).
        Where the next step's drafts are queued before the read, `queue_candidates(ahead,
        bonus tokens)` queues its candidates behind them."""
        r, n = cands.tokens.shape
        device = cands.tokens.device
        starts = to_device([s.num_computed for s in seqs], device)
        chains = cands.visible is None
        items = [BatchItem(s.seq_id, s.num_computed, [0] * n, all_logits=True,
                           positions=None if chains else [0] * n,
                           visible=None if chains else cands.visible[i])
                 for i, s in enumerate(seqs)]
        logits, features = self.runner.forward(
            Mode.VERIFY, items, gather_logits=False,
            device_inputs=(cands.tokens.flatten(), (starts[:, None] + cands.depth).flatten()))
        assert features is not None, "verify must capture the drafter's target layers"
        slots = self.runner.last_batch.attn.slot_mapping.view(r, n)
        target = vocab_argmax(logits, self._vocab_start).view(r, n)
        rank = cands.depth if chains else cands.rank  # a chain's node order is its selection
        result, path, src, dst, positions = self.walks(
            cands.tokens, cands.parent, rank, target, slots, starts, scratch=self._scratch)
        self.cache.move(src.flatten(), dst.flatten())
        width = features.shape[-1]
        kept = features.view(r, n, width).gather(1, path[..., None].expand(r, n, width))
        self.proposer.inject([ContextRows(kept.flatten(0, 1), positions=positions.flatten(),
                                          slots=dst.flatten())])
        read = start_to_host(result)  # the step's one device read, waited for below
        ahead = None
        block = self.proposer.block_size
        most = min(n, block)  # committed tokens at most: a path is one node per depth
        if all(s.max_total_len - s.num_computed - most > block for s in seqs):
            # The device drafts the next step's blocks while the host finishes this one.
            ahead = self.proposer.draft_ahead([s.seq_id for s in seqs],
                                              [s.num_computed for s in seqs], result[:, 0],
                                              result[:, 1], most=most)
            if ahead is not None and queue_candidates is not None:
                queue_candidates(ahead, result[:, 1])
        walks, expected, ranks = [], [], []
        for s, (count, bonus, *rest) in zip(seqs, read().tolist()):
            nodes, tokens = rest[:n][:count], rest[n : 2 * n][:count]
            walks.append((nodes, tokens[1:] + [bonus]))
            ranks.append(None if chains else rest[2 * n :][1:count])
            expected.append((s.seq_id, s.num_computed + count, bonus, block))
        if ahead is not None:
            ahead.blocks = expected
        return walks, ranks
