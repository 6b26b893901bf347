"""The (token, slot) pairs a MoE router chose, grouped by expert on the device with static
shapes (every batch of n tokens gives the same tensor sizes, and nothing is read back), as the
grouped GEMMs of `layers/fused_moe.py` consume them: each expert's pairs padded to a multiple of
a block of rows, one expert per block; and the experts' weights stacked as those GEMMs read
them."""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK_M = 16  # pairs per block: decode batches route 1-8 tokens to most experts they touch


def align_by_expert(local: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """local: [P] int64 expert of each (token, slot) pair on this rank, `num_experts` for pairs
    routed to another rank's experts. Returns (sorted_pairs [S]: pair ids grouped by expert,
    each group padded with P to a multiple of block_m; block_experts [S / block_m]: the expert
    of each block, -1 past the last), S = P + num_experts * (block_m - 1) rounded up."""
    p, device = local.numel(), local.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # Per expert (plus one for other ranks' pairs): its first slot, and its first sorted pair.
    starts = torch.cat([ends - padded, ends.new_full((1,), -1)])
    firsts = torch.cat([counts.cumsum(0) - counts, counts.new_zeros(1)])
    size = -(-(p + num_experts * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(local, stable=True)
    expert = local[order]
    slot = starts[expert] + torch.arange(p, device=device) - firsts[expert]
    slot = torch.where(expert < num_experts, slot, size)  # other ranks' pairs: dropped
    sorted_pairs = torch.full((size + 1,), p, dtype=torch.long, device=device)
    sorted_pairs.scatter_(0, slot, order)
    block_starts = torch.arange(0, size, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    return sorted_pairs[:size], torch.where(block_experts < num_experts, block_experts, -1)


class StackedExperts(NamedTuple):
    """One rank's routed experts as the grouped GEMMs read them: gate_up [E, 2I, H] (gate rows,
    then up) and down [E, H, I]; with `group`, INT4 packed eight to an int32 along the input
    dim ([E, 2I, H / 8], [E, H, I / 8]) with scales [E, 2I, H / group], [E, H, I / group];
    with `fp8_block` (bo, bi), float8 with one float32 scale per bo x bi block."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    group: int = 0
    fp8_block: tuple[int, int] | None = None

    @property
    def inter(self) -> int:
        return self.gate_up.shape[1] // 2
