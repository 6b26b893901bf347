"""The Triton paged-attention backend against the SDPA reference, on CPU through Triton's
interpreter. Skipped where triton is not installed (a failure under CI=true) and where CUDA
exists: there tests/gpu/test_triton_attention_cuda.py runs the same cases compiled."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernel", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from flashtree.attention.triton import TritonBackend  # noqa: E402
from tests.attention.cases import KINDS, run_case, run_latent_case  # noqa: E402


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("q_per_kv", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_matches_sdpa(kind, q_per_kv, head_dim):
    run_case(TritonBackend, kind, q_per_kv, head_dim, torch.float32, "cpu", seed=q_per_kv)


@pytest.mark.parametrize("kind", ["decode", "chain", "tree"])
@pytest.mark.parametrize("q_per_kv", [1, 4])
def test_bf16_matches_sdpa(kind, q_per_kv):
    run_case(TritonBackend, kind, q_per_kv, 128, torch.bfloat16, "cpu", seed=7)


@pytest.mark.parametrize("kind", ["decode", "tree", "window"])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_context_matches_sdpa(kind, num_splits):
    run_case(TritonBackend, kind, 2, 64, torch.float32, "cpu", seed=num_splits,
             num_splits=num_splits)


@pytest.mark.parametrize("kind", ["decode", "chain", "tree", "prefill"])
@pytest.mark.parametrize("heads,v_dim,tail", [(1, 32, 0), (4, 32, 16), (16, 32, 16), (3, 24, 8),
                                               (64, 32, 16)])
def test_mla_latent_matches_sdpa(kind, heads, v_dim, tail):
    """MLA: one latent head for all query heads, values its first columns, a rope tail; a
    rank's few heads take 16-row tiles, 64 heads and more the 64-row tile."""
    run_latent_case(TritonBackend, kind, heads, v_dim, tail, torch.float32, "cpu", seed=heads)


@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_mla_latent_bf16_and_split_context(kind):
    run_latent_case(TritonBackend, kind, 8, 64, 16, torch.bfloat16, "cpu", seed=5,
                    num_splits=2)


def test_query_tiles_and_small_pages():
    """Trees times the GQA group exceed one 16-row tile: several query tiles per head."""
    run_case(TritonBackend, "tree", 4, 64, torch.float32, "cpu", seed=3, page_size=1,
             max_block_m=16, block_n=16)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_every_split_streams_its_share_of_the_new_tokens(kind):
    """A verify's 40 new tokens (three key blocks) are split over the context splits too, and
    a causal tile stops at its last row's token (trees list parents first)."""
    run_case(TritonBackend, kind, 2, 32, torch.float32, "cpu", seed=11, q_len=40, num_splits=3,
             max_block_m=16, block_n=16)
    run_latent_case(TritonBackend, kind, 4, 32, 16, torch.float32, "cpu", seed=11, q_len=40,
                    num_splits=3, block_n=16)


def test_automatic_splits_grow_as_the_contexts_square_root_until_the_gpu_is_full():
    """Without a fixed count, a launch splits each context into about sqrt(keys)/4 (light
    tiles: decode, small blocks) or sqrt(keys)/8 (fuller tiles) splits, rounded down to a power
    of two, but into no more than fill the GPU with 4 (light) or 2 programs an SM, nor 16 (a
    graph decides for the engine's longest context, and runs short ones too)."""
    from flashtree.kv.cache import KVCache

    backend = TritonBackend(KVCache(1, 4, 16, 1, 64, torch.float32, "cpu"))
    backend._num_sms = 132  # an H100's (this CPU has none)
    assert backend.splits_for(8, max_kv_len=1024, tile_rows=4) == 8  # decode at 1k keys
    assert backend.splits_for(8, max_kv_len=4096, tile_rows=4) == 16
    assert backend.splits_for(8, max_kv_len=131_072, tile_rows=4) == 16  # at most 16
    assert backend.splits_for(8, max_kv_len=40, tile_rows=4) == 1  # a short prompt: no merge
    assert backend.splits_for(8, max_kv_len=1024, tile_rows=64) == 4  # a 16-token block
    assert backend.splits_for(32, max_kv_len=16_384, tile_rows=64) == 8  # 264 // 32 programs
    assert backend.splits_for(128, max_kv_len=1024, tile_rows=64) == 2  # a 256-node tree
    assert backend.splits_for(64, max_kv_len=100_000, tile_rows=4) == 8  # 528 // 64, rounded
    assert backend.splits_for(264, max_kv_len=100_000, tile_rows=64) == 1
    assert TritonBackend(backend.cache).splits_for(8, 1024, 4) == 1  # off CUDA


def test_latent_full_tiles_split_to_fill_the_gpu_twice():
    """MLA: a rank's 16-row tiles split as GQA's light tiles do; 64-row tiles (128 heads) as
    finely as fills the GPU twice, at least 256 keys a split, at most 64."""
    from flashtree.kv.cache import KVCache

    backend = TritonBackend(KVCache(1, 4, 16, 1, 64, torch.float32, "cpu"))
    backend._num_sms = 132
    assert backend.latent_splits(1, max_kv_len=1024, tile_rows=8) == 8  # Kimi TP8 decode
    assert backend.latent_splits(32, max_kv_len=1024, tile_rows=16) == 8  # its 64-node verify
    assert backend.latent_splits(2, max_kv_len=16_384, tile_rows=64) == 64  # 128-head decode
    assert backend.latent_splits(2, max_kv_len=1024, tile_rows=64) == 4  # 256 keys a split
    assert backend.latent_splits(64, max_kv_len=100_000, tile_rows=64) == 8  # 264 // 64, up
