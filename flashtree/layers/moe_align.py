"""The (token, slot) pairs a MoE router chose, grouped by expert on the device in one Triton
program, with static shapes (every batch of n tokens gives the same tensor sizes, and nothing
is read back), as the grouped GEMMs of `layers/fused_moe.py` consume them: each expert's pairs
padded to a multiple of a block of rows, one expert per block. One launch instead of a dozen
small torch ops: at decode sizes a MoE layer's time is mostly launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs per block: decode batches route 1-8 tokens to most experts they touch
_CHUNK = 1024  # pairs or slots a loop step of the kernel handles


@triton.jit
def _align_kernel(local_ptr, pairs_ptr, blocks_ptr, starts_ptr, cursor_ptr, num_pairs,
                  num_experts, size, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    tl.store(cursor_ptr + experts, tl.zeros((E_PAD,), dtype=tl.int32))
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(local_ptr + p, mask=p < num_pairs, other=num_experts).to(tl.int32)
        counts += tl.histogram(e, E_PAD)
    for s0 in range(0, size, CHUNK):  # padding slots hold num_pairs
        s = s0 + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + s, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=s < size)
    padded = tl.where(experts < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + experts, ends - padded)
    tl.debug_barrier()
    for c0 in range(0, num_pairs, CHUNK):  # each pair to the next free slot of its expert
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(local_ptr + p, mask=p < num_pairs, other=num_experts).to(tl.int32)
        mine = (p < num_pairs) & (e < num_experts)
        rank = tl.atomic_add(cursor_ptr + e, 1, mask=mine)
        start = tl.load(starts_ptr + e, mask=mine, other=0)
        tl.store(pairs_ptr + start + rank, p, mask=mine)
    # A block's expert: how many experts end at or before its first slot.
    for b0 in range(0, size // BLOCK_M, BLOCKS_PER_STEP):
        b = b0 + tl.arange(0, BLOCKS_PER_STEP)
        before = tl.sum(((ends[None, :] <= b[:, None] * BLOCK_M)
                         & (experts[None, :] < num_experts)).to(tl.int32), axis=1)
        tl.store(blocks_ptr + b, tl.where(before < num_experts, before, -1),
                 mask=b < size // BLOCK_M)


def align_by_expert(local: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """local: [P] expert of each (token, slot) pair on this rank, `num_experts` for pairs
    routed to another rank's experts. Returns int32 (sorted_pairs [S]: pair ids grouped by
    expert in any order within it, each group padded with P to a multiple of block_m;
    block_experts [S / block_m]: the expert of each block, -1 past the last),
    S = P + num_experts * (block_m - 1) rounded up to block_m."""
    p, device = local.numel(), local.device
    size = -(-(p + num_experts * (block_m - 1)) // block_m) * block_m
    e_pad = triton.next_power_of_2(num_experts + 1)
    pairs = torch.empty(size, dtype=torch.int32, device=device)
    blocks = torch.empty(size // block_m, dtype=torch.int32, device=device)
    scratch = torch.empty(2, e_pad, dtype=torch.int32, device=device)
    _align_kernel[(1,)](local, pairs, blocks, scratch[0], scratch[1], p, num_experts, size,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_CHUNK,
                        BLOCKS_PER_STEP=max(1, 4096 // e_pad), num_warps=8)
    return pairs, blocks
