"""What the paged-attention kernels share: the online softmax's constants, the new tokens'
visibility, and the merge of context splits (flash-decoding's second kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.pdl import pdl_args, wait_for_previous

LOG2E = 1.4426950408889634
# Running max before any key: finite, so fully masked rows give p = 0.
NO_SCORE = tl.constexpr(-1.0e30)


@triton.jit
def new_token_visibility(visible, mask_row_ptr, stride_mq, tok, new, distance,
                         HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """`visible` [rows, keys] narrowed to what the new-token mask (row tok, column new: the
    key's index among the new tokens) or the causal rule (distance = query - key position >= 0)
    allows."""
    if HAS_MASK:
        bits = tl.load(mask_row_ptr + tok[:, None] * stride_mq + new[None, :], mask=visible,
                       other=0)
        visible = visible & (bits != 0)
    elif CAUSAL:
        visible = visible & (distance >= 0)
    return visible


@triton.jit
def key_range(phase: tl.constexpr, split, lo, ctx_len, kv_len, last_tok,
              NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """[begin, end) of the keys a program streams in `phase`, its split's share in whole
    blocks of: 0, the context keys [lo, ctx_len); 1, the new tokens [ctx_len, kv_len), for a
    causal tile only up to its last row's token `last_tok` (a causal mask is lower-triangular,
    so later keys are hidden from the whole tile)."""
    if phase == 0:
        first = lo
        last = ctx_len
    else:
        first = ctx_len
        last = kv_len
        if CAUSAL:
            last = tl.minimum(kv_len, ctx_len + last_tok + 1)
    chunk = tl.cdiv(tl.cdiv(last - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    begin = first + split * chunk
    return begin, tl.minimum(begin + chunk, last)


@triton.jit
def _rows(ptr, valid, other, MASKED: tl.constexpr):
    # A partials load: of the valid rows alone where only those were written.
    if MASKED:
        return tl.load(ptr, mask=valid, other=other)
    return tl.load(ptr)


@triton.jit(do_not_specialize=["num_m_tiles"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_ptr,
    stride_ot, stride_oh, num_kv_heads, num_m_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    WRITTEN_ROWS_ONLY: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (request, KV head and BLOCK_DC-column chunk, query tile).
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // (BLOCK_D // BLOCK_DC)
    d = (tl.program_id(1) % (BLOCK_D // BLOCK_DC)) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    mt = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    r = tl.arange(0, BLOCK_M)
    rows = mt * BLOCK_M + r
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    first = ((b * num_kv_heads + kvh) * num_m_tiles + mt) * NUM_SPLITS

    valid = tok < q_len
    split = tl.arange(0, BLOCK_SPLITS)
    first_ok = (split < NUM_SPLITS)[:, None]
    if WRITTEN_ROWS_ONLY:  # the kernel wrote the valid rows' partials alone: read no others
        first_ok = first_ok & valid[None, :]
    m = tl.max(tl.load(part_m_ptr + (first + split)[:, None] * BLOCK_M + r[None, :],
                       mask=first_ok, other=NO_SCORE), axis=0)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)
    for s in range(NUM_SPLITS):
        part = first + s
        w = tl.exp2(_rows(part_m_ptr + part * BLOCK_M + r, valid, NO_SCORE,
                          WRITTEN_ROWS_ONLY) - m)
        l_sum += w * _rows(part_l_ptr + part * BLOCK_M + r, valid, 0.0, WRITTEN_ROWS_ONLY)
        acc += w[:, None] * _rows(part_acc_ptr + (part * BLOCK_M + r)[:, None] * BLOCK_D
                                  + d[None, :], valid[:, None], 0.0, WRITTEN_ROWS_ONLY)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (d < HEAD_DIM)[None, :],
    )


def merge_splits(out: torch.Tensor, partials: tuple[torch.Tensor, ...], query_start: torch.Tensor,
                 num_kv_heads: int, num_m_tiles: int, group: int, block_m: int, splits: int,
                 written_rows_only: bool = False) -> None:
    """The context splits' partials (acc [programs, block_m, block_d], max, sum, in the
    order the attention kernels write them) merged into `out` [tokens, heads, head_dim], in
    column chunks so that a few long requests still fill the GPU. `written_rows_only`: the
    kernel wrote the rows of real tokens alone (MLA), so only those are read."""
    block_d = partials[0].shape[-1]
    chunk = min(block_d, 64)
    _merge_splits_kernel[(query_start.numel() - 1, num_kv_heads * (block_d // chunk),
                          num_m_tiles)](
        out, *partials, query_start, out.stride(0), out.stride(1), num_kv_heads, num_m_tiles,
        GROUP=group, HEAD_DIM=out.shape[2], BLOCK_D=block_d, BLOCK_DC=chunk, BLOCK_M=block_m,
        NUM_SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits),
        WRITTEN_ROWS_ONLY=written_rows_only, num_warps=4, **pdl_args(out.device),
    )
