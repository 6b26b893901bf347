"""MLA's absorbed attention over the paged latent cache as its own Triton kernel: one cached
latent row per token (kv_lora_rank value columns, then the rope columns that count in the
scores only) shared by every query head.

With 128 heads every latent byte feeds about 240 FLOPs, so the work is tensor-core bound, and
the tile is shaped for Hopper's warpgroup MMA: 64 query rows (heads of one token, then the next
token's) against 64 keys, the 512 value columns as two 256-wide halves (two accumulators; one
512-wide tile does not fit the registers; splitting the halves across programs recomputes the
scores and measured slower). Decode, chain and tree verify and prefill share the kernel as in
`triton.py`: context keys visible to every row, then the new tokens under the causal rule or the
new-token mask, with context splits merged by `merge_splits`."""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.attention.triton_common import NO_SCORE, key_range, new_token_visibility
from flashtree.pdl import wait_for_previous


@triton.jit
def _load_columns(row_ptrs, row_ok, N: tl.constexpr, BLOCK: tl.constexpr):
    """The first N columns from row_ptrs [rows, 1] as a [rows, BLOCK] tile, zero-padded."""
    c = tl.arange(0, BLOCK)
    if N == BLOCK:
        return tl.load(row_ptrs + c[None, :], mask=row_ok[:, None], other=0.0)
    return tl.load(row_ptrs + c[None, :], mask=row_ok[:, None] & (c < N)[None, :], other=0.0)


@triton.jit
def _store_columns(row_ptrs, tile, row_ok, N: tl.constexpr, BLOCK: tl.constexpr):
    """`tile`'s first N columns to row_ptrs [rows, 1], in the pointers' element type."""
    c = tl.arange(0, BLOCK)
    tile = tile.to(row_ptrs.dtype.element_ty)
    if N == BLOCK:
        tl.store(row_ptrs + c[None, :], tile, mask=row_ok[:, None])
    else:
        tl.store(row_ptrs + c[None, :], tile, mask=row_ok[:, None] & (c < N)[None, :])


@triton.jit(do_not_specialize=["stride_pb", "stride_mb", "stride_mq", "num_m_tiles"])
def latent_attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    page_tables_ptr, kv_lens_ptr, query_start_ptr, mask_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks,
    stride_pb, stride_mb, stride_mq, sm_scale_log2, num_m_tiles,
    PAGE: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    # Programs of one request and context split run side by side (axis 0), so the query tiles
    # reading the same keys find them in L2.
    wait_for_previous(PDL)
    mt = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    ctx_len = kv_len - q_len

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # tile row = token * HEADS + head
    tok = rows // HEADS
    head = rows % HEADS
    row_ok = tok < q_len
    q_rows = (q_ptr + (q_start + tok) * stride_qt + head * stride_qh)[:, None]
    q_lo = _load_columns(q_rows, row_ok, HALF, BLOCK_HALF)  # value columns [0, HALF)
    q_hi = _load_columns(q_rows + HALF, row_ok, HALF, BLOCK_HALF)  # [HALF, 2 * HALF)
    if TAIL > 0:
        q_tail = _load_columns(q_rows + 2 * HALF, row_ok, TAIL, BLOCK_TAIL)

    m_i = tl.full([BLOCK_M], NO_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    page_row = page_tables_ptr + b * stride_pb
    offs_n = tl.arange(0, BLOCK_N)

    last_tok = (mt * BLOCK_M + BLOCK_M - 1) // HEADS
    for phase in tl.static_range(2):
        k_begin, k_end = key_range(phase, split, 0, ctx_len, kv_len, last_tok, NUM_SPLITS,
                                   BLOCK_N, CAUSAL)
        for start in range(k_begin, k_end, BLOCK_N):
            key = start + offs_n
            key_ok = key < k_end
            page = tl.load(page_row + key // PAGE, mask=key_ok, other=0)
            kv_rows = kv_ptr + ((page * PAGE + key % PAGE) * stride_ks).to(tl.int32)[:, None]
            k_lo = _load_columns(kv_rows, key_ok, HALF, BLOCK_HALF)
            k_hi = _load_columns(kv_rows + HALF, key_ok, HALF, BLOCK_HALF)
            s = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)
            s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision=PRECISION)
            if TAIL > 0:
                k_tail = _load_columns(kv_rows + 2 * HALF, key_ok, TAIL, BLOCK_TAIL)
                s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=PRECISION)
            visible = key_ok[None, :] & row_ok[:, None]
            if phase == 1:
                visible = new_token_visibility(
                    visible, mask_ptr + b * stride_mb, stride_mq, tok, key - ctx_len,
                    (ctx_len + tok)[:, None] - key[None, :], HAS_MASK, CAUSAL)
            s = tl.where(visible, s * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = p.to(k_lo.dtype)
            acc_lo = tl.dot(p, k_lo, acc_lo * alpha[:, None], input_precision=PRECISION)
            acc_hi = tl.dot(p, k_hi, acc_hi * alpha[:, None], input_precision=PRECISION)
            m_i = m_new

    if NUM_SPLITS == 1:
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        out_rows = (out_ptr + (q_start + tok) * stride_ot + head * stride_oh)[:, None]
        _store_columns(out_rows, acc_lo * inv[:, None], row_ok, HALF, BLOCK_HALF)
        _store_columns(out_rows + HALF, acc_hi * inv[:, None], row_ok, HALF, BLOCK_HALF)
    else:
        # Partials as `merge_splits` reads them (one KV head, 2 * BLOCK_HALF columns).
        part = (b * num_m_tiles + mt) * NUM_SPLITS + split
        r = tl.arange(0, BLOCK_M)
        acc_rows = (part_acc_ptr + (part * BLOCK_M + r) * (2 * BLOCK_HALF))[:, None]
        # Rows past the request's tokens (most of a decode tile at a rank's 8 heads) are never
        # merged: not written.
        _store_columns(acc_rows, acc_lo, row_ok, HALF, BLOCK_HALF)
        _store_columns(acc_rows + HALF, acc_hi, row_ok, HALF, BLOCK_HALF)
        tl.store(part_m_ptr + part * BLOCK_M + r, m_i, mask=row_ok)
        tl.store(part_l_ptr + part * BLOCK_M + r, l_i, mask=row_ok)


def latent_tile(v_dim: int, heads: int) -> dict:
    """Launch constants of the latent kernel over `v_dim` value columns for `heads` query heads
    per token. 64 query rows (wgmma's tile) by 64 keys, 8 warps: the fastest for DeepSeek-V3's
    128 heads over 512 + 64 columns on an H100. A rank's few heads (8 of Kimi K2.6's 64 at
    TP8) take 16-row tiles of 4 warps, 1.3-1.7x faster from decode to 64-node verifies at 1k-16k
    keys (H100): the 64-row tile's accumulators spend registers on rows no token fills."""
    half = max(16, triton.next_power_of_2(v_dim // 2))
    if heads < 64:
        return dict(BLOCK_HALF=half, BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_HALF=half, BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
