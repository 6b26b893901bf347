"""The acceptance oracle, for benchmarks only: it fixes how well the drafter drafts while every
cost stays real. The drafter runs as always; then, on the device, its logits are rewritten so
that the token the target will choose next (known from a plain greedy run of the same prompt)
is the drafter's top-1 with probability `p` per slot, its top-2 with probability `q` of the
rest, and ranked last otherwise (seeded draws; every other logit stays the drafter's own).
Tree building, verification, the walk, the KV commit and the policy run unchanged."""

from __future__ import annotations

import torch

from flashtree.distributed import get_tp_size
from flashtree.llm import LLM
from flashtree.speculative.policy import FixedPolicy
from flashtree.transfer import to_device


def rank_targets(logits: torch.Tensor, targets: torch.Tensor, ranks: torch.Tensor) -> None:
    """In place: row i's `targets[i]` becomes its top-1 (`ranks[i]` 1), its top-2 (2) or its
    lowest logit (0); rows whose target is -1 stay as they are. logits [N, V]; targets, ranks
    [N] int64 on the logits' device. Device ops only: no host sync inside a draft step."""
    token = targets.clamp_min(0)[:, None]
    others = logits.scatter(1, token, float("-inf")).topk(2, dim=1).values  # [N, 2]
    value = torch.where(ranks == 1, others[:, 0] + 1,
                        torch.where(ranks == 2, (others[:, 0] + others[:, 1]) / 2,
                                    logits.min(dim=1).values - 1))
    value = torch.where(targets >= 0, value, logits.gather(1, token)[:, 0])  # -1: unchanged
    logits.scatter_(1, token, value[:, None])


class AcceptanceOracle:
    """Wraps an LLM's drafter so that its drafts hit the plain run's tokens at rate (p, q)."""

    def __init__(self, llm: LLM, references: dict[tuple[int, ...], list[int]], p: float,
                 q: float = 0.0, seed: int = 0) -> None:
        if not (0 <= p <= 1 and 0 <= q <= 1):
            raise ValueError(f"oracle rates must lie in [0, 1], got p={p}, q={q}")
        if get_tp_size() > 1:
            raise ValueError("the acceptance oracle needs a single-process engine (no TP)")
        engine = llm.engine
        if engine.proposer is None:
            raise ValueError("the acceptance oracle needs a speculative LLM (spec dflash/ddtree)")
        self.engine, self.references, self.p, self.q = engine, references, p, q
        self.generator = torch.Generator(engine.args.device).manual_seed(seed)
        self._draft_logits = engine.proposer.draft_logits
        engine.proposer.draft_logits = self._rewritten_draft_logits

    def _rewritten_draft_logits(self, blocks: list[tuple[int, int, int, int]],
                                gather: bool = True) -> torch.Tensor:
        logits = self._draft_logits(blocks, gather)
        running = {s.seq_id: s for s in self.engine.scheduler.running}
        targets = []
        for seq_id, start, _bonus, size in blocks:
            reference = self.references.get(tuple(running[seq_id].prompt_ids), [])
            # Slot j predicts the token at position start + j (slot 0 holds the bonus).
            targets += [reference[start + j] if start + j < len(reference) else -1
                        for j in range(1, size)]
        device = logits.device
        draws = torch.rand(len(targets), generator=self.generator, device=device)
        ranks = torch.where(draws < self.p, 1,
                            torch.where(draws < self.p + (1 - self.p) * self.q, 2, 0))
        with torch.inference_mode():  # the drafter's logits are inference tensors
            rank_targets(logits, to_device(targets, device), ranks)
        return logits


def plain_references(llm: LLM, prompts: list[list[int]], params) -> dict[tuple[int, ...],
                                                                          list[int]]:
    """Each prompt's greedy plain continuation, as prompt + output tokens, decoded by `llm`'s
    own engine with speculation switched off for the run."""
    engine = llm.engine
    policy, engine.policy = engine.policy, FixedPolicy(0)
    try:
        outs = llm.generate(prompts, params)
    finally:
        engine.policy = policy
    return {tuple(p): list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
