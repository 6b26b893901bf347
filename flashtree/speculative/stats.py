"""Speculative decoding counters, named after vLLM's spec-decode metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify rounds (one per request per speculative step)
    num_draft_tokens: int = 0  # candidate tokens verified (tree nodes or chain drafts)
    num_accepted_tokens: int = 0  # candidates accepted (the bonus token not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # [depth - 1] -> accepted
    # Request-steps by draft budget (candidates verified; 0: the step ran plain decoding).
    budgets: dict[int, int] = field(default_factory=dict)
    # Decode steps that drafted, by the step's number of requests: at which batch sizes the
    # policy speculated.
    speculative_steps: dict[int, int] = field(default_factory=dict)

    def record(self, num_candidates: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_candidates
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def record_budget(self, budget: int, requests: int = 1) -> None:
        self.budgets[budget] = self.budgets.get(budget, 0) + requests

    def record_speculative_step(self, requests: int) -> None:
        self.speculative_steps[requests] = self.speculative_steps.get(requests, 0) + 1
