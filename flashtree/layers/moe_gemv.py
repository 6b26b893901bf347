"""INT4 routed experts at a few (token, slot) pairs, each pair a GEMV of its expert's weights.

At decode and short verifies a block of `fused_moe`'s tensor-core tiles holds one real pair,
and their INT4 path spends its time moving each unpacked nibble into the dot's layout. Here a
program streams BLOCK_N weight rows of its pair's expert and accumulates products in float32
registers, the activation broadcast along the rows (as `layers/gemv.py` does for dense layers).
Nibbles become floats by the magic-number trick (the nibble OR'd into the mantissa of 2^23,
minus 2^23 + 8: no int-to-float conversion), the eight of a word summed before their group's
scale multiplies once. The weights are never rounded to the activation dtype here, where the
eager path rounds them: results differ from it by that rounding (relative 2^-9 per bf16
weight) and summation order. The down projection runs per token: a program sums its token's
pairs and adds the shared experts' output, so no per-pair buffer, zeroing or reduction follows.
(Dense experts per pair stay on the tensor-core tiles, faster at 2-8 tokens on an H100.)"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtree.pdl import wait_for_previous

_MAGIC = tl.constexpr(0x4B000000)  # float 2^23: a nibble OR'd into its mantissa reads 2^23 + it
_MAGIC_PLUS_ZERO = tl.constexpr(8388616.0)  # 2^23 + 8, the stored offset of a signed nibble


@triton.jit
def silu_mul(gate, up, dtype):
    # silu(gate) * up from float32 sums, rounded to `dtype` where the eager ops round.
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _int4_products(words, scale, a_ptrs, a_ok):
    # words [..., N, KW] of INT4 W (eight to an int32, lowest bits first, value + 8) times the
    # activations at a_ptrs [..., KW] + j for each word's nibble j (the same for all N rows),
    # summed over j, times the scales.
    word_sum = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        a = tl.load(a_ptrs + j, mask=a_ok, other=0.0).to(tl.float32)
        bits = ((words >> (4 * j)) & 0xF) | _MAGIC
        word_sum += ((bits.to(tl.float32, bitcast=True) - _MAGIC_PLUS_ZERO)
                     * tl.expand_dims(a, len(a.shape) - 1))
    return word_sum * scale


@triton.jit
def _int4_gemv_tile(acc, a_row, w, s, rows, rows_ok, k0, k_total, stride_wn, stride_sn,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    # acc [rows, BLOCK_K / 8] + the products of a[k0:k0+BLOCK_K] and W[rows, same k], W INT4
    # packed eight to an int32 along k, lowest bits first, value + 8, one scale per GROUP
    # columns. The caller sums acc along its last dim.
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kw_ok = kw < k_total // 8
    w_ok = rows_ok[:, None] & kw_ok[None, :]
    words = tl.load(w + rows[:, None] * stride_wn + kw[None, :], mask=w_ok, other=0)
    scale = tl.load(s + rows[:, None] * stride_sn + (kw[None, :] * 8) // GROUP, mask=w_ok,
                    other=0.0).to(tl.float32)
    return acc + _int4_products(words, scale, a_row + kw * 8, kw_ok)


@triton.jit
def pair_gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, first_expert, num_experts,
                        top_k, hidden, inter, k_per_split, stride_xt, stride_we, stride_wn,
                        stride_se, stride_sn, stride_os, stride_ot, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
                        PDL: tl.constexpr):
    # out[pair, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for BLOCK_N columns
    # of one pair; with SPLIT, this split's share of the input dim in float32:
    # out[split, pair, n] = x . gate[e, n] and out[split, pair, inter + n] = x . up[e, n].
    wait_for_previous(PDL)  # the weights to read come from the router's ids
    pair = tl.program_id(0)
    expert = (tl.load(ids_ptr + pair) - first_expert).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):  # another rank's pair
        return
    a_row = x_ptr + (pair // top_k) * stride_xt
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    w = w_ptr + expert.to(tl.int64) * stride_we
    sc = s_ptr + expert.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, hidden), BLOCK_K):
        gate = _int4_gemv_tile(gate, a_row, w, sc, cols, cols_ok, k0, hidden, stride_wn,
                               stride_sn, BLOCK_K, GROUP)
        up = _int4_gemv_tile(up, a_row, w, sc, inter + cols, cols_ok, k0, hidden, stride_wn,
                             stride_sn, BLOCK_K, GROUP)
    out = out_ptr + tl.program_id(2) * stride_os + pair * stride_ot + cols
    if SPLIT:
        tl.store(out, tl.sum(gate, 1), mask=cols_ok)
        tl.store(out + inter, tl.sum(up, 1), mask=cols_ok)
    else:
        tl.store(out, silu_mul(tl.sum(gate, 1), tl.sum(up, 1), out_ptr.dtype.element_ty),
                 mask=cols_ok)


@triton.jit
def _int4_down_slots(act_ptr, w_ptr, s_ptr, weights_ptr, pair, expert, mine, cols, cols_ok,
                     inter, stride_at, stride_we, stride_wn, stride_se, stride_sn, dtype,
                     SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    # The float32 sum over these SLOTS pairs (`mine`: on this rank) of each pair's routing
    # weight * (act[pair] . down[expert, cols]), each term rounded to `dtype` as eager rounds.
    w_slot = w_ptr + tl.where(mine, expert, 0).to(tl.int64) * stride_we
    s_slot = s_ptr + tl.where(mine, expert, 0).to(tl.int64) * stride_se
    acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kw = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        kw_ok = (kw < inter // 8) | EVEN_K  # EVEN_K: no mask, so words load 16 bytes at a time
        ok = mine[:, None, None] & cols_ok[None, :, None] & kw_ok[None, None, :]
        words = tl.load(w_slot[:, None, None] + cols[None, :, None] * stride_wn
                        + kw[None, None, :], mask=ok, other=0)
        scale = tl.load(s_slot[:, None, None] + cols[None, :, None] * stride_sn
                        + (kw[None, None, :] * 8) // GROUP, mask=ok, other=0.0).to(tl.float32)
        acc += _int4_products(words, scale, act_ptr + pair[:, None] * stride_at + kw[None, :] * 8,
                              mine[:, None] & kw_ok[None, :])
    routing = tl.load(weights_ptr + pair, mask=mine, other=0.0)
    term = (tl.sum(acc, 2).to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
    return tl.sum(term.to(tl.float32), 0)  # another rank's slot: its masked loads give 0


@triton.jit
def token_down_kernel(act_ptr, w_ptr, s_ptr, weights_ptr, shared_ptr, out_ptr, ids_ptr,
                      first_expert, num_experts, top_k, hidden, inter, stride_at, stride_we,
                      stride_wn, stride_se, stride_sn, stride_st, stride_ot,
                      TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP: tl.constexpr, HAS_SHARED: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # out[t, n] = sum over t's pairs on this rank of routing weight * (act[pair] . down[e, n]),
    # each pair's term rounded as the eager path rounds it, plus shared[t, n] where given.
    # The top_k slots (TOP_K, its power of two) go SLOTS at a time as one [SLOTS, BLOCK_N,
    # BLOCK_K / 8] tile, so those slots' weights are in flight at once: all of them where every
    # expert is on this rank; one where most are not (expert parallel), so that a slot on
    # another rank is skipped, not multiplied by zeros.
    wait_for_previous(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first_slot in tl.static_range(0, TOP_K, SLOTS):
        slot = first_slot + tl.arange(0, SLOTS)
        pair = t * top_k + slot
        expert = (tl.load(ids_ptr + pair, mask=slot < top_k, other=-1)
                  - first_expert).to(tl.int32)
        mine = (expert >= 0) & (expert < num_experts)
        if tl.max(mine.to(tl.int32), 0) > 0:
            y += _int4_down_slots(act_ptr, w_ptr, s_ptr, weights_ptr, pair, expert, mine, cols,
                                  cols_ok, inter, stride_at, stride_we, stride_wn, stride_se,
                                  stride_sn, dtype, SLOTS, BLOCK_N, BLOCK_K, GROUP, EVEN_K)
    y = y.to(dtype)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + t * stride_st + cols, mask=cols_ok, other=0.0)
        y = (y.to(tl.float32) + shared.to(tl.float32)).to(dtype)
    tl.store(out_ptr + t * stride_ot + cols, y, mask=cols_ok)
