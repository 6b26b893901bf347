"""FlashInfer's MLA decode kernel (FA3 on Hopper) for forwards where every request has one
query row: an optional GPU dependency (`pip install "flashtree[flashinfer]"`), measured
2.2-2.8x faster than the Triton latent kernel at decode
(benchmarks/results/archive/2026-12-05-mla-gpu.md).
Verification and prefill stay on the Triton kernel: FlashInfer's MLA has no tree masks.

Its wrapper plans on the host from the step's lengths and page tables (`HostLayout`): at the
first layer call of an eager step, and before each replay of a CUDA graph, into the fixed
buffers the graph reads (one wrapper per captured batch size; padding requests keep one query
row and read one key, since the plan's tiling is baked into the captured launch). Set
FLASHTREE_FLASHINFER=0 to keep every forward on the Triton kernel."""

from __future__ import annotations

import array
import os
from itertools import accumulate, chain

import torch

from flashtree.attention.backend import AttentionMetadata, HostLayout
from flashtree.kv.cache import KVCache

LATENT, ROPE = 512, 64  # the widths FlashInfer's MLA kernels are built for (DeepSeek-V3, Kimi)
HEADS = (16, 32, 64, 128)  # query heads per GPU its MLA tiles take (16, 64 and 128 tested)
_WORKSPACE_BYTES = 128 << 20


def latent_decode_for(cache: KVCache) -> LatentDecode | None:
    """FlashInfer's MLA decode over `cache` where it applies: a CUDA key-only latent cache of
    512 + 64 columns in bf16 or fp16, with flashinfer importable and not switched off."""
    if (os.environ.get("FLASHTREE_FLASHINFER", "1") == "0" or cache.v is not None
            or cache.k.device.type != "cuda" or cache.k.shape[-1] != LATENT + ROPE
            or cache.k.dtype not in (torch.bfloat16, torch.float16)):
        return None
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception:  # not installed, or its import failed on this machine: Triton does it
        return None
    return LatentDecode(cache)


class LatentDecode:
    """The wrappers of one latent cache: an eager one, and one per captured batch size whose
    buffers a graph reads. `select` picks the wrapper of a forward (at `begin_forward`),
    `run` plans it on its first layer call where it is not planned yet and attends. Nothing is
    allocated on the device before a layer with heads FlashInfer takes runs (a model sharded
    to 8 heads a GPU never uses it)."""

    def __init__(self, cache: KVCache) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._wrapper_cls = BatchMLAPagedAttentionWrapper
        self.cache = cache
        # Partial results of one run at a time: all wrappers share it (runs never overlap).
        self._workspace: torch.Tensor | None = None
        self._eager = None
        self._graphs: dict[int, object] = {}  # batch size -> wrapper with fixed buffers
        self._planned: set[int] = set()  # batch sizes whose graph wrapper has been planned
        # A replay's layout for a batch size whose wrapper is not planned yet (a GraphRunner
        # running its static buffers eagerly): its forward plans it in place of a dummy.
        self._waiting: dict[int, HostLayout] = {}
        self._plan_args: tuple[int, float] | None = None  # (heads, scale): seen on a layer call
        # This forward's (graph batch size and page-table width, or None when eager; layout to
        # plan first).
        self._current: tuple[tuple[int, int] | None, HostLayout | None] | None = None

    def select(self, meta: AttentionMetadata) -> None:
        """Take `meta`'s forward when every request has one query row: eagerly planned from
        its host layout, or (a graph's padded metadata) on the batch size's fixed buffers,
        planned before each replay (`before_replay`); other forwards stay with the Triton
        kernel."""
        self._current = None
        if meta.max_query_len != 1 or meta.new_token_mask is not None:
            return
        if meta.padded:
            batch = meta.num_seqs
            layout = None
            if batch not in self._planned:  # a replay's layout, or (a capture's warm-up) a dummy
                layout = self._waiting.pop(batch, None) or HostLayout([1] * batch, [[0]] * batch)
            self._current = ((batch, meta.page_tables.shape[1]), layout)
        elif meta.host_layout is not None:
            self._current = (None, meta.host_layout)

    def before_replay(self, batch: int, tokens: int, meta: AttentionMetadata) -> None:
        """Plan the wrapper that the graph of `batch` requests of `tokens` rows reads, for the
        real batch of `meta` (its requests first, then padding): only graphs of one row per
        request run FlashInfer."""
        if tokens != 1:
            return
        assert meta.host_layout is not None, "a replay through FlashInfer needs the host layout"
        pad = batch - meta.num_seqs
        layout = HostLayout(meta.host_layout.kv_lens + [1] * pad,
                            meta.host_layout.page_tables + [[0]] * pad)
        if batch in self._planned:
            self._plan(self._graphs[batch], layout)
        else:
            self._waiting[batch] = layout

    def run(self, q: torch.Tensor, kv: torch.Tensor, v_dim: int, scale: float
            ) -> torch.Tensor | None:
        """Attention of q [num_tokens, heads, 512 + 64] over the layer's latent cache kv
        [slots, 1, 512 + 64] whose first v_dim columns are the values -> [num_tokens, heads,
        512], or None where this forward, these heads or widths are not FlashInfer's."""
        if (self._current is None or q.shape[1] not in HEADS or q.dtype != kv.dtype
                or v_dim != LATENT or q.shape[2] != LATENT + ROPE):
            return None
        graph, layout = self._current
        wrapper = self._eager_wrapper() if graph is None else self._graph_wrapper(*graph)
        self._plan_args = (q.shape[1], scale)
        if layout is not None:
            self._plan(wrapper, layout)
            self._current = (graph, None)
            if graph is not None:
                self._planned.add(graph[0])
        page = self.cache.page_size
        paged = kv.view(-1, page, LATENT + ROPE)  # [pages, page, 512 + 64]
        out = q.new_empty(q.shape[0], q.shape[1], LATENT)
        wrapper.run(q[..., :LATENT], q[..., LATENT:], paged[..., :LATENT], paged[..., LATENT:],
                    out=out)
        return out

    def _shared_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8,
                                          device=self.cache.k.device)
        return self._workspace

    def _eager_wrapper(self):
        if self._eager is None:
            self._eager = self._wrapper_cls(self._shared_workspace())
        return self._eager

    def _graph_wrapper(self, batch: int, max_pages: int):
        if batch not in self._graphs:
            device = self.cache.k.device

            def buffer(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=device)

            self._graphs[batch] = self._wrapper_cls(
                self._shared_workspace(), use_cuda_graph=True, qo_indptr=buffer(batch + 1),
                kv_indptr=buffer(batch + 1), kv_indices=buffer(batch * max_pages),
                kv_len_arr=buffer(batch))
        return self._graphs[batch]

    def _plan(self, wrapper, layout: HostLayout) -> None:
        """Plan `wrapper` for one query row per request over `layout`'s keys."""
        assert self._plan_args is not None, "planned before any layer call told heads and scale"
        heads, scale = self._plan_args
        page = self.cache.page_size
        pages = [-(-n // page) for n in layout.kv_lens]
        # Every used page of every request, each step: through a C array, not Python ints.
        indices = array.array("i", chain.from_iterable(
            table[:k] for table, k in zip(layout.page_tables, pages)))
        ints = dict(dtype=torch.int32)
        dtype = self.cache.k.dtype
        wrapper.plan(torch.arange(len(pages) + 1, **ints),
                     torch.tensor(list(accumulate(pages, initial=0)), **ints),
                     torch.frombuffer(indices, dtype=torch.int32),
                     torch.tensor(layout.kv_lens, **ints), heads, LATENT, ROPE, page, False,
                     scale, dtype, dtype)
