"""Paged attention as one Triton kernel for every mode: decode (1 token per request), chain
verify (causal block), tree verify (ancestor-or-self mask), prefill chunks, and the drafter's
bidirectional block with or without a sliding window.

One program per (request, KV head, query tile, context split). Its tile holds query rows
`token * q_per_kv + group_head` of one request, so all query heads sharing a KV head (and every
tree node) read each context page once. Context keys are streamed through the page table with
an online softmax and no mask beyond bounds (and the window); then the last split streams the
new-token block, where the causal rule, the new-token mask or nothing (bidirectional) decides
visibility. With several splits (flash-decoding) each writes a partial (acc, max, sum) and a
second kernel merges them. MLA's latent cache has a kernel of its own (`triton_mla.py`).

Everything the kernels read is a device tensor and every launch size is a host constant of the
forward (request count, max query length, heads), never a value read back from the device: the
backend never syncs and can be captured in a CUDA graph. Set TRITON_INTERPRET=1 before importing
triton to run it on CPU tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.attention.triton_common import (
    LOG2E,
    NO_SCORE,
    key_range,
    merge_splits,
    new_token_visibility,
)
from flashtree.attention.triton_mla import latent_attention_kernel, latent_tile
from flashtree.kv.cache import KVCache
from flashtree.pdl import pdl_args

if TYPE_CHECKING:
    from flashtree.attention.flashinfer_mla import LatentDecode

# A captured graph's splits are decided for the engine's longest context (max_model_len), so a
# short context runs them too: more than 16 would spend its time merging.
_MAX_AUTO_SPLITS = 16
_MAX_LATENT_SPLITS = 64
_LIGHT_TILE_ROWS = 32  # a tile of up to this many query rows in use splits as decode's does
_LATENT_KEYS_PER_SPLIT = 256  # MLA's full tiles: the fewest keys a split takes


# Integers that vary between eager launches (the page-table width of the batch, mask strides,
# query tiles) are not specialized on (== 1, divisible by 16): each combination would be a
# kernel variant compiled the first time it appears, stalling a running engine.
@triton.jit(do_not_specialize=["stride_pb", "stride_mb", "stride_mq", "window", "num_m_tiles"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    page_tables_ptr, kv_lens_ptr, query_start_ptr, mask_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pb, stride_mb, stride_mq,
    sm_scale_log2, window, num_kv_heads, num_m_tiles,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mt = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    ctx_len = kv_len - q_len

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tile row = token * GROUP + head
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], NO_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row = page_tables_ptr + b * stride_pb
    offs_n = tl.arange(0, BLOCK_N)

    # Context keys [lo, ctx_len) are visible to every row (within the window); keys before
    # ctx_len - window + 1 are outside every row's window.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len - window + 1, 0)
    last_tok = (mt * BLOCK_M + BLOCK_M - 1) // GROUP

    for phase in tl.static_range(2):
        k_begin, k_end = key_range(phase, split, lo, ctx_len, kv_len, last_tok, NUM_SPLITS,
                                   BLOCK_N, CAUSAL)
        for start in range(k_begin, k_end, BLOCK_N):
            key = start + offs_n  # [BLOCK_N] logical KV index
            key_ok = key < k_end
            page = tl.load(page_row + key // PAGE, mask=key_ok, other=0)
            slot = page * PAGE + key % PAGE
            kv_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
            visible = key_ok[None, :] & row_ok[:, None]  # [BLOCK_M, BLOCK_N]
            # distance = query position - key position (both logical indices)
            distance = (ctx_len + tok)[:, None] - key[None, :]
            if phase == 1:
                visible = new_token_visibility(visible, mask_ptr + b * stride_mb, stride_mq,
                                               tok, key - ctx_len, distance, HAS_MASK, CAUSAL)
                if HAS_WINDOW and not CAUSAL:
                    visible = visible & (-distance < window)
            if HAS_WINDOW:
                visible = visible & (distance < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = ((b * num_kv_heads + kvh) * num_m_tiles + mt) * NUM_SPLITS + split
        r = tl.arange(0, BLOCK_M)
        tl.store(part_acc_ptr + (part * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(part_m_ptr + part * BLOCK_M + r, m_i)
        tl.store(part_l_ptr + part * BLOCK_M + r, l_i)


@dataclass
class _Launch:
    meta: AttentionMetadata
    # [num_seqs, max_q, max_q] uint8 view of the new-token mask; kv_lens as an unread stand-in
    # when there is none (HAS_MASK is off)
    mask: torch.Tensor


class TritonBackend(AttentionBackend):
    """Paged attention through `_paged_attention_kernel`. `num_splits` splits each request's
    context (flash-decoding) so that small batches fill the GPU; None picks it from the
    context's length and the launch's size (`splits_for`; 1 off CUDA). It depends only on
    launch sizes, so a captured graph and an eager run of one batch shape reduce in the same
    order.
    `max_block_m` caps the query rows per tile: larger trees times the GQA group re-read the
    context once per extra tile. `latent_decode` (FlashInfer's, `flashinfer_mla.py`) takes the
    latent forwards of one query row per request where it applies."""

    def __init__(
        self, cache: KVCache, num_splits: int | None = None, max_block_m: int = 64,
        block_n: int = 32, num_warps: int = 4, latent_decode: LatentDecode | None = None,
    ) -> None:
        super().__init__(cache)
        assert (num_splits is None or num_splits >= 1) and block_n >= 16 and max_block_m >= 16, (
            f"num_splits {num_splits}, block_n {block_n}, max_block_m {max_block_m}"
        )
        self.num_splits, self.max_block_m, self.block_n = num_splits, max_block_m, block_n
        self.num_warps = num_warps
        self.latent_decode = latent_decode
        device = cache.k.device
        self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                         if device.type == "cuda" else 0)
        self.launch: _Launch | None = None

    def splits_for(self, programs: int, max_kv_len: int, tile_rows: int) -> int:
        """Context splits for a launch of `programs` (request, KV head, query tile) programs
        over contexts of up to `max_kv_len` keys, each tile using `tile_rows` query rows. A
        split streams its share of the keys and adds a partial to merge, so the best count
        grows as the context's square root: sqrt/4 for light tiles (decode, small blocks) and
        sqrt/8 for fuller ones, whose partials cost more; and at most 4 (light) or 2 programs
        an SM, beyond which splitting only adds merging (an H100's sweep:
        benchmarks/results/2026-12-07-attention-splits-gpu.md); at most _MAX_AUTO_SPLITS.
        Powers of two (few compiled variants); 1 off CUDA."""
        if self.num_splits is not None:
            return self.num_splits
        light = tile_rows <= _LIGHT_TILE_ROWS
        wanted = min(_MAX_AUTO_SPLITS, math.isqrt(max_kv_len) // (4 if light else 8),
                     (4 if light else 2) * self._num_sms // programs)
        return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1

    def latent_splits(self, programs: int, max_kv_len: int, tile_rows: int) -> int:
        """`splits_for` MLA's latent attention. A rank's few heads take 16-row tiles, which
        split as GQA's light tiles do (measured on a Kimi TP8 rank); 64-row tiles (64 heads
        and more) carry some four times a GQA tile's work per key, so they split as finely
        as fills the GPU twice, rounded up, down to _LATENT_KEYS_PER_SPLIT keys a split: a
        128-head decode at 16k keys is two tiles, which the square-root rule would leave on
        32 programs."""
        if self.num_splits is not None or tile_rows <= _LIGHT_TILE_ROWS:
            return self.splits_for(programs, max_kv_len, tile_rows)
        wanted = min(_MAX_LATENT_SPLITS, -(-2 * self._num_sms // programs),
                     -(-max_kv_len // _LATENT_KEYS_PER_SPLIT))
        return triton.next_power_of_2(wanted) if wanted > 1 else 1

    def begin_forward(self, meta: AttentionMetadata) -> None:
        mask = meta.new_token_mask
        for name in ("query_start", "kv_lens", "page_tables"):
            t = getattr(meta, name)
            assert t.dtype == torch.int64 and t.stride(-1) == 1, (
                f"{name}: {t.dtype} with strides {t.stride()}; the kernel reads contiguous int64"
            )
        assert mask is None or (mask.dtype == torch.bool and mask.stride(-1) == 1), (
            f"new_token_mask: {mask.dtype} with strides {mask.stride()}"
        )
        self.launch = _Launch(meta, meta.kv_lens if mask is None else mask.view(torch.uint8))
        if self.latent_decode is not None:
            self.latent_decode.select(meta)

    def before_replay(self, batch: int, tokens: int, meta: AttentionMetadata) -> None:
        if self.latent_decode is not None:
            self.latent_decode.before_replay(batch, tokens, meta)

    @property
    def plans_before_replay(self) -> bool:
        return self.latent_decode is not None

    @property
    def slot_mapping(self) -> torch.Tensor:
        assert self.launch is not None, "begin_forward must run before the layers"
        return self.launch.meta.slot_mapping

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        assert self.cache.v is not None, "a key-only (MLA) cache attends through forward_latent"
        return self._run(q, self.cache.k[layer], self.cache.v[layer])

    def attend_latent(self, layer: int, q: torch.Tensor, v_dim: int, scale: float
                      ) -> torch.Tensor:
        """MLA's absorbed attention (`latent_attention_kernel`): the values are the latent's
        first `v_dim` columns, the rest (the rope part) counts in the scores only; one cached
        head serves all query heads, so a tile reads each latent page once for all its query
        rows (`latent_tile`)."""
        kv = self.cache.k[layer]  # [slots, 1, latent_dim]
        if self.latent_decode is not None:
            out = self.latent_decode.run(q, kv, v_dim, scale)
            if out is not None:
                return out
        launch = self.launch
        meta = launch.meta
        n, heads, tail = meta.num_seqs, q.shape[1], q.shape[2] - v_dim
        assert meta.sliding_window is None, "MLA has no sliding window"
        assert v_dim % 2 == 0, f"latent width {v_dim}: the kernel splits it into two halves"
        assert q.stride(2) == 1 and kv.stride(2) == 1, "the latent must be contiguous"
        assert kv.shape[0] * kv.stride(0) < 2**31, "the kernel offsets a layer's cache in int32"
        tile = latent_tile(v_dim, heads)
        block_m, half = tile["BLOCK_M"], tile["BLOCK_HALF"]
        num_m_tiles = triton.cdiv(meta.max_query_len * heads, block_m)
        splits = self.latent_splits(n * num_m_tiles, meta.max_kv_len,
                                    min(block_m, meta.max_query_len * heads))
        out = q.new_empty(q.shape[0], heads, v_dim)
        part_acc, part_m, part_l = self._partials(n * num_m_tiles * splits, block_m, 2 * half,
                                                  splits, out)
        mask = launch.mask
        latent_attention_kernel[(num_m_tiles, splits, n)](
            q, kv, out, part_acc, part_m, part_l,
            meta.page_tables, meta.kv_lens, meta.query_start, mask,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv.stride(0),
            meta.page_tables.stride(0), mask.stride(0), mask.stride(1) if mask.dim() > 1 else 0,
            scale * LOG2E, num_m_tiles,
            PAGE=self.cache.page_size, HEADS=heads, HALF=v_dim // 2, TAIL=tail,
            BLOCK_TAIL=max(16, triton.next_power_of_2(tail)), NUM_SPLITS=splits,
            HAS_MASK=meta.new_token_mask is not None, CAUSAL=meta.causal,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **tile,
            **pdl_args(q.device),
        )
        if splits > 1:
            merge_splits(out, (part_acc, part_m, part_l), meta.query_start, 1, num_m_tiles,
                         heads, block_m, splits, written_rows_only=True)
        return out

    @staticmethod
    def _partials(programs: int, block_m: int, block_d: int, splits: int, out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each split's (acc, max, sum) for `programs` (request, head, query tile, split)
        tiles; `out` stands in for all three when there is one split (nothing to merge)."""
        if splits == 1:
            return out, out, out
        part_m = torch.empty(programs, block_m, dtype=torch.float32, device=out.device)
        return (torch.empty(programs, block_m, block_d, dtype=torch.float32, device=out.device),
                part_m, torch.empty_like(part_m))

    def _run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
             ) -> torch.Tensor:
        """Attention of q [num_tokens, heads, head_dim] over the paged keys and values
        [slots, kv_heads, head_dim] -> [num_tokens, heads, head_dim]."""
        launch = self.launch
        assert launch is not None, "begin_forward must run before the layers"
        meta = launch.meta
        heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        assert heads % num_kv_heads == 0, f"{heads} query heads over {num_kv_heads} KV heads"
        assert q.stride(2) == 1 and k_cache.stride(2) == 1, "head_dim must be contiguous"
        group = heads // num_kv_heads
        n = meta.num_seqs
        block_m = max(16, min(self.max_block_m,
                              triton.next_power_of_2(meta.max_query_len * group)))
        num_m_tiles = triton.cdiv(meta.max_query_len * group, block_m)
        block_d = max(16, triton.next_power_of_2(head_dim))
        splits = self.splits_for(n * num_kv_heads * num_m_tiles, meta.max_kv_len,
                                 min(block_m, meta.max_query_len * group))
        out = q.new_empty(q.shape[0], heads, head_dim)
        part_acc, part_m, part_l = self._partials(n * num_kv_heads * num_m_tiles * splits,
                                                  block_m, block_d, splits, out)
        mask = launch.mask
        window = meta.sliding_window
        _paged_attention_kernel[(n, num_kv_heads, num_m_tiles * splits)](
            q, k_cache, v_cache, out, part_acc, part_m, part_l,
            meta.page_tables, meta.kv_lens, meta.query_start, mask,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            meta.page_tables.stride(0), mask.stride(0), mask.stride(1) if mask.dim() > 1 else 0,
            head_dim**-0.5 * LOG2E, window or 0, num_kv_heads, num_m_tiles,
            PAGE=self.cache.page_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, BLOCK_N=self.block_n, NUM_SPLITS=splits,
            HAS_MASK=meta.new_token_mask is not None, CAUSAL=meta.causal,
            HAS_WINDOW=window is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=self.num_warps,
        )
        if splits > 1:
            merge_splits(out, (part_acc, part_m, part_l), meta.query_start, num_kv_heads,
                         num_m_tiles, group, block_m, splits)
        return out
