"""What flashtree hands FlashInfer's MLA decode (`attention/flashinfer_mla.py`), checked on the
CPU: the wrapper is replaced by a reference that attends exactly as its plan describes (query
and KV page index arrays, lengths), so the index arrays built from the host layout, the padding
of a graph's batch and the plan before each replay are compared with the SDPA backend. The
kernel itself is compared on the GPU (tests/gpu/test_flashinfer_mla_cuda.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.attention.sdpa import SdpaBackend
from flashtree.kv.cache import KVCache
from tests.attention.cases import decode_metadata

LATENT, ROPE, PAGE, POOL, HEADS = 512, 64, 4, 64, 16


class ReferenceWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper as its documentation describes it: plan()
    takes host index arrays (copied into fixed buffers with use_cuda_graph), run() attends each
    request's query rows over its kv_len keys on the listed pages."""

    made = 0  # wrappers constructed

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None) -> None:
        ReferenceWrapper.made += 1
        self.fixed = use_cuda_graph
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type) -> None:
        arrays = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        assert all(a.dtype == torch.int32 and a.device.type == "cpu" for a in arrays)
        if self.fixed:  # a graph's buffers: sized at capture, written in place
            for buf, a in zip(self.buffers, arrays):
                assert a.numel() <= buf.numel(), (a.numel(), buf.numel())
                buf[: a.numel()].copy_(a)
        self.plan_args = arrays, num_heads, (head_dim_ckv, head_dim_kpe), page_size, sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out) -> None:
        (qo, kv_indptr, indices, kv_lens), heads, dims, page, scale = self.plan_args
        assert q_nope.shape[1] == heads and dims == (q_nope.shape[2], q_pe.shape[2])
        for r in range(len(kv_lens)):
            pages = indices[kv_indptr[r]: kv_indptr[r + 1]].long()
            n = int(kv_lens[r])
            ckv = ckv_cache[pages].reshape(-1, dims[0])[:n].float()
            kpe = kpe_cache[pages].reshape(-1, dims[1])[:n].float()
            rows = slice(int(qo[r]), int(qo[r + 1]))
            scores = (q_nope[rows].float() @ ckv.T + q_pe[rows].float() @ kpe.T) * scale
            out[rows] = (scores.softmax(-1) @ ckv).to(out.dtype)


@pytest.fixture(autouse=True)
def reference_flashinfer(monkeypatch):
    """`flashinfer.mla` as the reference wrapper (whether or not flashinfer is installed)."""
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = ReferenceWrapper
    monkeypatch.setattr(ReferenceWrapper, "made", 0)
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)


def decode_case(seed: int, contexts: list[int]):
    """One decode step over requests of `contexts` cached tokens, pages interleaved."""
    meta = decode_metadata(contexts, PAGE, POOL, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, POOL, PAGE, 1, LATENT + ROPE, torch.float32, torch.device("cpu"),
                    v_head_dim=0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    q = torch.randn(len(contexts), HEADS, LATENT + ROPE, generator=gen)
    new = torch.randn(len(contexts), 1, LATENT + ROPE, generator=gen)
    return meta, cache, q, new


def attend(backend, meta, cache_k, q, new) -> torch.Tensor:
    backend.cache.k.copy_(cache_k)
    backend.begin_forward(meta)
    return backend.forward_latent(0, q, new, LATENT, (LATENT + ROPE) ** -0.5)


def flashinfer_backend(cache: KVCache) -> AttentionBackend:
    """A backend attending only through LatentDecode, hooked in as TritonBackend hooks it."""
    from flashtree.attention.flashinfer_mla import LatentDecode

    class Backend(AttentionBackend):
        def __init__(self, cache: KVCache) -> None:
            super().__init__(cache)
            self.latent_decode = LatentDecode(cache)

        def begin_forward(self, meta: AttentionMetadata) -> None:
            self.meta = meta
            self.latent_decode.select(meta)

        @property
        def slot_mapping(self) -> torch.Tensor:
            return self.meta.slot_mapping

        def attend(self, layer, q):
            raise AssertionError("a latent cache attends through forward_latent")

        def before_replay(self, batch: int, tokens: int, meta: AttentionMetadata) -> None:
            self.latent_decode.before_replay(batch, tokens, meta)

        def attend_latent(self, layer, q, v_dim, scale):
            out = self.latent_decode.run(q, self.cache.k[layer], v_dim, scale)
            assert out is not None, "FlashInfer's decode did not take the forward"
            return out

    return Backend(cache)


def test_eager_steps_plan_from_the_host_layout():
    for seed, contexts in enumerate([[5, 30, 3, 47], [100], [3, 4, 5, 7, 8, 9]]):
        meta, cache, q, new = decode_case(seed, contexts)
        context = cache.k.clone()
        want = attend(SdpaBackend(cache), meta, context, q, new)
        got = attend(flashinfer_backend(cache), meta, context, q, new)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def replayed(backend, static: AttentionMetadata, seed: int, contexts: list[int], q, new):
    """A replay of the static 4-request forward for the requests of `contexts` (the rest
    padding), planned by `before_replay` -> (its rows of the real requests, SDPA's)."""
    real, real_cache, real_q, real_new = decode_case(seed, contexts)
    context = real_cache.k.clone()
    want = attend(SdpaBackend(real_cache), real, context, real_q, real_new)
    n = len(contexts)
    backend.before_replay(4, 1, real)
    backend.cache.k.copy_(context)
    backend.begin_forward(static)  # as the graph replays: the static metadata
    slots = backend.slot_mapping
    slots[:n] = real.slot_mapping
    slots[n:] = (POOL - 1) * PAGE  # padding rows write an unowned page
    got = backend.forward_latent(0, torch.cat([real_q, q[n:]]), torch.cat([real_new, new[n:]]),
                                 LATENT, (LATENT + ROPE) ** -0.5)
    return got[:n], want


def static_case():
    meta, cache, q, new = decode_case(0, [9, 2, 30, 12])
    static = AttentionMetadata(meta.query_start, meta.kv_lens, meta.slot_mapping.clone(),
                               torch.zeros(4, POOL, dtype=torch.int64), 1, POOL * PAGE,
                               padded=True)
    return static, cache, q, new


def test_a_graph_batch_is_planned_before_each_replay_with_padding():
    """Captured at 4 requests (planned once on a dummy layout), then run for 3 and 2 others
    after `before_replay`: their rows equal SDPA's, the padding requests read one key."""
    static, cache, q, new = static_case()
    backend = flashinfer_backend(cache)
    attend(backend, static, cache.k.clone(), q, new)  # the capture's warm-up
    for seed, contexts in ((1, [40, 1, 17]), (2, [60, 33])):
        got, want = replayed(backend, static, seed, contexts, q, new)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_static_buffers_run_without_a_capture_plan_from_the_first_replay():
    """A GraphRunner without CUDA graphs runs the static forward eagerly at each replay: its
    first one is planned from the real batch, not the capture's dummy layout."""
    static, cache, q, new = static_case()
    backend = flashinfer_backend(cache)
    for seed, contexts in ((1, [40, 1, 17]), (2, [60, 33])):
        got, want = replayed(backend, static, seed, contexts, q, new)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_heads_it_does_not_take_leave_it_unallocated():
    """8 query heads a GPU (Kimi K2 over 8 GPUs): the Triton kernel's, and no wrapper or
    workspace is made for FlashInfer."""
    from flashtree.attention.flashinfer_mla import LatentDecode

    meta, cache, q, _ = decode_case(0, [9, 2])
    decode = LatentDecode(cache)
    decode.select(meta)
    assert decode.run(q[:, :8], cache.k[0], LATENT, 1.0) is None
    assert ReferenceWrapper.made == 0
