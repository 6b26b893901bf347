"""The acceptance oracle, for benchmarks only: it fixes how well the drafter drafts while every
cost stays real. The drafter runs as always; then, on the device, its logits are rewritten so
that the token the target will choose next (known from a plain greedy run of the same prompt)
is the drafter's top-1 with probability `p` per slot, its top-2 with probability `q` of the
rest, and ranked last otherwise (seeded draws; every other logit stays the drafter's own). As
top-1 it holds at least probability `p` of its slot: the drafter is as sure of its right
guesses as it is right, which is what shapes a DDTree. Tree building, verification, the walk,
the KV commit and the policy run unchanged."""

from __future__ import annotations

import math

import torch

from flashtree.distributed import tp_all_gather, tp_all_gather_last_dim, tp_group_active
from flashtree.distributed.tp import TPDriverEngine
from flashtree.graphs.rows import RowGraphs
from flashtree.graphs.runner import batch_buckets
from flashtree.llm import LLM
from flashtree.speculative.policy import FixedPolicy
from flashtree.speculative.tree import build_trees_from_topk, topk_logprobs
from flashtree.transfer import lists_to_device, to_device

GRAPHED_BATCH = 8


def rank_targets(logits: torch.Tensor, targets: torch.Tensor, ranks: torch.Tensor,
                 confidence: float = 0.0, vocab_start: int | None = None) -> None:
    """In place: row i's `targets[i]` becomes its top-1 (`ranks[i]` 1), its top-2 (2) or its
    lowest logit (0); rows whose target is -1 stay as they are. A top-1 target holds at least
    `confidence` of its row's probability (a drafter as sure of its right guesses as it is
    right: DDTree's tree follows these probabilities). logits [N, V]; targets, ranks [N] int64
    on the logits' device. With `vocab_start`, logits are this TP rank's vocab slice from
    that id on: the row statistics come from every rank's slice, and the rank holding a
    target rewrites it. Device ops only: no host sync inside a draft step."""
    start = vocab_start or 0
    local = targets - start
    owned = (targets >= 0) & (local >= 0) & (local < logits.shape[1])
    token = local.clamp(0, logits.shape[1] - 1)[:, None]
    kept = logits.gather(1, token)[:, 0]
    rest = logits.scatter(1, token, torch.where(owned, float("-inf"), kept)[:, None])
    others = rest.topk(min(2, rest.shape[1]), dim=1).values  # [N, 2]
    lse, lowest = torch.logsumexp(rest, dim=1), logits.min(dim=1).values
    if vocab_start is not None:
        others = tp_all_gather_last_dim(others).topk(2, dim=1).values
        lse = torch.logsumexp(tp_all_gather(lse), dim=0)
        lowest = tp_all_gather(lowest).amin(dim=0)
    sure_share = min(confidence, 0.999)
    odds = math.log(sure_share / (1 - sure_share)) if confidence else 0
    sure = lse + odds  # the target's logit at that share of the mass
    value = torch.where(ranks == 1, torch.maximum(others[:, 0] + 1, sure),
                        torch.where(ranks == 2, (others[:, 0] + others[:, 1]) / 2, lowest - 1))
    logits.scatter_(1, token, torch.where(owned, value, kept)[:, None])  # -1: unchanged


class AcceptanceOracle:
    """Wraps an LLM's drafter so that its drafts hit the plain run's tokens at rate (p, q)."""

    def __init__(self, llm: LLM, references: dict[tuple[int, ...], list[int]], p: float,
                 q: float = 0.0, seed: int = 0) -> None:
        """Under tensor parallelism every rank's drafter is wrapped alike, with the same
        seeded draws (the rates are fixed then: changing `p` or `q` later changes rank 0's)."""
        if not (0 <= p <= 1 and 0 <= q <= 1):
            raise ValueError(f"oracle rates must lie in [0, 1], got p={p}, q={q}")
        if llm.engine.proposer is None:
            raise ValueError("the acceptance oracle needs a speculative LLM (spec dflash/ddtree)")
        if isinstance(llm.engine, TPDriverEngine):
            llm.engine.call_on_workers(_attach_on_worker, references, p, q, seed)
        self._attach(llm.engine, references, p, q, seed)

    def _attach(self, engine, references: dict[tuple[int, ...], list[int]], p: float,
                q: float, seed: int) -> None:
        self.engine, self.references, self.p, self.q = engine, references, p, q
        self.generator = torch.Generator(engine.args.device).manual_seed(seed)
        proposer = self.proposer = engine.proposer
        self._draft_logits, self._draft_ahead = proposer.draft_logits, proposer.draft_ahead
        proposer.draft_logits = self._rewritten_draft_logits
        proposer.draft_ahead = self._rewritten_draft_ahead
        self._device_references: dict[int, torch.Tensor] = {}  # seq_id -> padded with -1
        # Up to GRAPHED_BATCH requests the rewrite replays a CUDA graph per bucket of draft
        # rows where the engine replays its forwards: the oracle's own ~15 small ops stay off
        # the short steps, where they would show.
        graphs = engine.runner.graphs
        rows = [b * (proposer.block_size - 1) for b in batch_buckets(GRAPHED_BATCH)]
        self._rows_graphs = RowGraphs(_rank_targets_rows, rows, torch.device(engine.args.device),
                                      graphs is not None and graphs.use_cuda_graphs)
        self._captured_for: set[float] = set()  # the rates whose graphs exist

    def _rewritten_draft_ahead(self, seq_ids: list[int], starts: list[int],
                               advance: torch.Tensor, bonus: torch.Tensor, most: int,
                               gather: bool = False):
        """`draft_ahead`, its logits rewritten (the blocks' starts are device values)."""
        ahead = self._draft_ahead(seq_ids, starts, advance, bonus, most, gather)
        if ahead is not None:
            self._rewrite(ahead.logits, seq_ids, ahead.first,
                          [self.proposer.block_size] * len(seq_ids), gather)
        return ahead

    def _rewritten_draft_logits(self, blocks: list[tuple[int, int, int, int]],
                                gather: bool = True) -> torch.Tensor:
        drafted = self.proposer.drafted_ahead(blocks, gather)
        if drafted is not None:
            return drafted  # rewritten when it was drafted
        logits = self._draft_logits(blocks, gather)
        seq_ids, starts, _, sizes = zip(*blocks)
        self._rewrite(logits, list(seq_ids), to_device(list(starts), logits.device),
                      list(sizes), gather)
        return logits

    def _rewrite(self, logits: torch.Tensor, seq_ids: list[int], first: torch.Tensor,
                 sizes: list[int], gather: bool) -> None:
        """Rank the reference tokens in `logits` (blocks packed, slots 1..size-1 of each; this
        TP rank's vocab slice unless `gather`) at the oracle's rates; `first`: each block's
        bonus position, on the device. Slot j predicts the token at first + j. Device ops
        only."""
        device = logits.device
        references = torch.nn.utils.rnn.pad_sequence(  # [R, L]
            [self._device_reference(i) for i in seq_ids], batch_first=True, padding_value=-1)
        rows, slots = lists_to_device([[r for r, size in enumerate(sizes) for _ in range(1, size)],
                                       [j for size in sizes for j in range(1, size)]], device)
        where = (first[rows] + slots).clamp(max=references.shape[1] - 1)
        ranks = oracle_ranks(rows.shape[0], self.p, self.q, self.generator)
        targets = references[rows, where]
        with torch.inference_mode():  # the drafter's logits are inference tensors
            if not gather and tp_group_active():  # collectives inside: not captured
                rank_targets(logits, targets, ranks, self.p,
                             self.engine.runner.model.lm_head.vocab_start)
                return
            if self.p not in self._captured_for:  # every bucket now, not on a timed step
                self._captured_for.add(self.p)
                for bucket in self._rows_graphs.buckets:
                    zeros = torch.zeros(bucket, dtype=torch.long, device=device)
                    self._rows_graphs(logits.new_zeros(bucket, logits.shape[1]), zeros, zeros,
                                      confidence=self.p)
            logits.copy_(self._rows_graphs(logits, targets, ranks, confidence=self.p)[0])

    def _device_reference(self, seq_id: int) -> torch.Tensor:
        """A running request's reference tokens on the device, padded with -1 past its end by
        more than any block reaches."""
        if seq_id not in self._device_references:
            seq = next(s for s in self.engine.scheduler.running if s.seq_id == seq_id)
            reference = self.references.get(tuple(seq.prompt_ids), [])
            padded = reference + [-1] * (2 * self.proposer.block_size)
            self._device_references[seq_id] = to_device(padded, self.engine.args.device)
        return self._device_references[seq_id]


def plain_references(llm: LLM, prompts: list[list[int]], params) -> dict[tuple[int, ...],
                                                                          list[int]]:
    """Each prompt's greedy plain continuation, as prompt + output tokens, decoded by `llm`'s
    own engine with speculation switched off for the run."""
    engine = llm.engine
    tp = isinstance(engine, TPDriverEngine)
    policy, engine.policy = engine.policy, FixedPolicy(0)
    if tp:
        engine.call_on_workers(_swap_policy, FixedPolicy(0))
    try:
        outs = llm.generate(prompts, params)
    finally:
        engine.policy = policy
        if tp:
            engine.call_on_workers(_swap_policy, None)
    return {tuple(p): list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}


def _rank_targets_rows(logits: torch.Tensor, targets: torch.Tensor, ranks: torch.Tensor, *,
                       confidence: float) -> tuple[torch.Tensor]:
    """`rank_targets` as `RowGraphs` replays it: on its static rows, returned."""
    rank_targets(logits, targets, ranks, confidence)
    return (logits,)


def _attach_on_worker(engine, references: dict, p: float, q: float, seed: int) -> None:
    """A TP worker's oracle (kept alive by the drafter methods it wraps)."""
    AcceptanceOracle.__new__(AcceptanceOracle)._attach(engine, references, p, q, seed)


def _swap_policy(engine, policy: FixedPolicy | None) -> None:
    """On a TP worker: use `policy`, keeping the engine's own; None puts that one back."""
    if policy is not None:
        engine.kept_policy, engine.policy = engine.policy, policy
    else:
        engine.policy = engine.kept_policy


def oracle_ranks(count: int, p: float, q: float, generator: torch.Generator) -> torch.Tensor:
    """`count` seeded rank draws: 1 with probability p, 2 with q of the rest, else 0."""
    draws = torch.rand(count, generator=generator, device=generator.device)
    return torch.where(draws < p, 1, torch.where(draws < p + (1 - p) * q, 2, 0))


def expected_tree_acceptance(draft_logits: torch.Tensor, p: float, q: float, budget: int,
                             trials: int, generator: torch.Generator, topk: int | None = None
                             ) -> float:
    """Monte Carlo estimate of the tokens a greedy DDTree step commits under the oracle:
    `trials` copies of one drafted block's logits ([L, V], L = block - 1 slots) are rewritten
    with random target tokens at rates (p, q), each builds its best-first tree of `budget`
    nodes as the engine does, and the target path is walked. Calibrates Q without a run."""
    slots, vocab = draft_logits.shape
    device = draft_logits.device
    targets = torch.randint(0, vocab, (trials, slots), generator=generator, device=device)
    logits = draft_logits.float().expand(trials, -1, -1).reshape(-1, vocab).clone()
    rank_targets(logits, targets.reshape(-1), oracle_ranks(logits.shape[0], p, q, generator), p)
    accepted = tree_acceptance(logits.view(trials, slots, vocab), targets, budget, topk)
    return accepted.double().mean().item()


def tree_acceptance(logits: torch.Tensor, targets: torch.Tensor, budget: int,
                    topk: int | None = None) -> torch.Tensor:
    """Tokens each greedy DDTree step commits (accepted nodes + 1) when the target's tokens
    are `targets` [T, L] and the drafter's logits `logits` [T, L, V]: the engine's best-first
    tree of `budget` nodes, walked along the targets."""
    slots, vocab = logits.shape[1:]
    top_lp, top_tok = topk_logprobs(logits, min(budget, vocab, topk or vocab))
    roots = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    trees = build_trees_from_topk(top_lp, top_tok, roots, budget)
    # A node is on the target path when its token is the target at its depth and its parent
    # is on the path; one pass per depth settles every depth.
    wanted = targets.gather(1, (trees.depth - 1).clamp_min(0))  # [T, N]
    on_path = trees.depth == 0
    for _ in range(slots):
        on_path = on_path | ((trees.tokens == wanted) & on_path.gather(1, trees.parent)
                             & (trees.depth > 0))
    return 1 + (trees.depth * on_path).amax(dim=1)
