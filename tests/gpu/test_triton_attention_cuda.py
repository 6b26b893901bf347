"""The compiled Triton paged-attention backend on CUDA: the CPU-interpreter cases of
tests/attention/ (every mode, GQA 1/2/4, head dims 64/128, fp32 and bf16, context splits), and a
CUDA graph captured on one batch and replayed on another with the metadata copied in place.
Skips without CUDA or triton."""

from __future__ import annotations

import pytest
import torch

from flashtree.attention.backend import AttentionMetadata
from tests.attention.cases import (
    KINDS,
    assert_close,
    make_case,
    run_case,
    run_latent_case,
    sdpa_reference,
)
from tests.layers.needs_triton import TRITON_MISSING

# Skip before importing triton: on CPU the interpreter tests must import it first.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
TritonBackend = pytest.importorskip("flashtree.attention.triton", reason=TRITON_MISSING
                                    ).TritonBackend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("q_per_kv", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_matches_sdpa_on_cuda(dtype, kind, q_per_kv, head_dim, num_splits):
    for seed in range(3):
        run_case(TritonBackend, kind, q_per_kv, head_dim, dtype, "cuda", seed=seed,
                 num_splits=num_splits)


@pytest.mark.parametrize("kind", ["decode", "chain", "tree", "prefill"])
@pytest.mark.parametrize("heads", [8, 16, 128])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_mla_latent_matches_sdpa_on_cuda(kind, heads, num_splits):
    """DeepSeek-V3's latent attention as it runs: 512 latent + 64 rope columns, bf16, 8 heads
    (Kimi K2.6 at TP8), 16 (DeepSeek-V3 at TP8) or 128 (one GPU)."""
    run_latent_case(TritonBackend, kind, heads, 512, 64, torch.bfloat16, "cuda", seed=heads,
                    num_splits=num_splits)


@pytest.mark.parametrize("page_size", [1, 16])
def test_query_tiles_and_page_sizes_on_cuda(page_size):
    run_case(TritonBackend, "tree", 4, 128, torch.bfloat16, "cuda", seed=3, page_size=page_size,
             max_block_m=16, block_n=16)


@pytest.mark.parametrize("kind", ["decode", "tree"])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_graph_replay_reads_new_metadata(kind, num_splits):
    """Capture on batch A, copy batch B (other lengths, pages, trees, K/V) into the captured
    buffers, replay: the output is B's, so nothing was baked in at capture."""
    q_len = 1 if kind == "decode" else 9
    common = dict(q_len=q_len, num_pages=64)
    a = make_case(kind, 4, 128, torch.bfloat16, "cuda", seed=1, **common)
    b = make_case(kind, 4, 128, torch.bfloat16, "cuda", seed=2, **common)
    expected = sdpa_reference(b)

    def padded(t: torch.Tensor) -> torch.Tensor:  # page tables to the pool's width
        return torch.nn.functional.pad(t, (0, 64 - t.shape[1]))

    m = a.meta
    mask = None if m.new_token_mask is None else m.new_token_mask.clone()
    static = AttentionMetadata(
        m.query_start.clone(), m.kv_lens.clone(), m.slot_mapping.clone(), padded(m.page_tables),
        q_len, 64 * 4, mask, m.causal, m.sliding_window,
    )
    q, k, v = a.q.clone(), a.k.clone(), a.v.clone()
    backend = TritonBackend(a.cache, num_splits=num_splits)
    backend.begin_forward(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(0, q, k, v)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, q, k, v)

    n = b.meta
    pairs = [(static.query_start, n.query_start), (static.kv_lens, n.kv_lens),
             (static.slot_mapping, n.slot_mapping), (static.page_tables, padded(n.page_tables)),
             (q, b.q), (k, b.k), (v, b.v), (a.cache.k, b.cache.k), (a.cache.v, b.cache.v)]
    if mask is not None:
        pairs.append((mask, n.new_token_mask))
    for dst, src in pairs:
        dst.copy_(src)
    graph.replay()
    assert_close(out, expected, f"graph replay {kind} splits={num_splits}")
