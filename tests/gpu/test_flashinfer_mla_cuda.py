"""FlashInfer's MLA decode (`attention/flashinfer_mla.py`) against the SDPA reference: eager
steps planned from the host layout, and CUDA graph replays planned before each replay on a
batch other than the captured one; then DeepSeek-V3-shaped attention (512 + 64 latent) in a
tiny model whose greedy tokens equal the Triton kernel's up to bf16 near-ties. Skips without
CUDA or without flashinfer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Skipped before the imports below: they import triton, which a CPU-only install lacks.
if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
    pytest.skip("needs CUDA and flashinfer", allow_module_level=True)

from flashtree.attention.backend import AttentionMetadata  # noqa: E402
from flashtree.attention.flashinfer_mla import LATENT, ROPE, LatentDecode  # noqa: E402
from flashtree.attention.sdpa import SdpaBackend  # noqa: E402
from flashtree.attention.triton import TritonBackend  # noqa: E402
from flashtree.kv.cache import KVCache  # noqa: E402
from tests.attention.cases import assert_close, decode_metadata  # noqa: E402

PAGE, POOL = 16, 160


def decode_case(seed: int, contexts: list[int], heads: int):
    """One decode step of requests with `contexts` cached tokens each (pages interleaved in a
    pool of POOL pages) -> (metadata, latent cache, q, the new tokens' latents)."""
    meta = decode_metadata(contexts, PAGE, POOL, "cuda")
    gen = torch.Generator("cuda").manual_seed(seed)
    cache = KVCache(1, POOL, PAGE, 1, LATENT + ROPE, torch.bfloat16, torch.device("cuda"),
                    v_head_dim=0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device="cuda"))
    n = len(contexts)
    q = torch.randn(n, heads, LATENT + ROPE, generator=gen, device="cuda").bfloat16()
    new = torch.randn(n, 1, LATENT + ROPE, generator=gen, device="cuda").bfloat16()
    return meta, cache, q, new


def reference(meta, cache, q, new) -> torch.Tensor:
    ref_cache = KVCache(1, POOL, PAGE, 1, LATENT + ROPE, torch.bfloat16, torch.device("cuda"),
                        v_head_dim=0)
    ref_cache.k.copy_(cache.k)
    backend = SdpaBackend(ref_cache)
    backend.begin_forward(meta)
    return backend.forward_latent(0, q, new, LATENT, (LATENT + ROPE) ** -0.5).float()


def flashinfer_backend(cache: KVCache) -> tuple[TritonBackend, list[int]]:
    """A Triton backend whose latent decode is FlashInfer's, and the list its runs append to
    (so a test knows FlashInfer attended, not the Triton fallback)."""
    decode = LatentDecode(cache)
    runs: list[int] = []
    run = decode.run

    def counted(q, kv, v_dim, scale):
        out = run(q, kv, v_dim, scale)
        runs.extend([] if out is None else [q.shape[0]])
        return out

    decode.run = counted
    return TritonBackend(cache, latent_decode=decode), runs


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_eager_decode_matches_sdpa(heads):
    for seed, contexts in enumerate([[5, 300, 16, 47], [1000], [15, 16, 17, 31, 32, 33]]):
        meta, cache, q, new = decode_case(seed, contexts, heads)
        expected = reference(meta, cache, q, new)
        backend, runs = flashinfer_backend(cache)
        backend.begin_forward(meta)
        got = backend.forward_latent(0, q, new, LATENT, (LATENT + ROPE) ** -0.5)
        assert runs == [len(contexts)], runs
        assert_close(got, expected, f"FlashInfer eager decode {contexts}")


def test_graph_replay_plans_the_real_batch():
    """Capture at 4 requests, replay 3 others (other lengths and pages, one padding request)
    after `before_replay`: the output is theirs."""
    heads, scale = 16, (LATENT + ROPE) ** -0.5
    a = decode_case(1, [40, 7, 300, 90], heads)
    b_meta, b_cache, b_q, b_new = decode_case(2, [500, 3, 61], heads)
    expected = reference(b_meta, b_cache, b_q, b_new)
    meta, cache, q, new = a
    width = POOL
    static = AttentionMetadata(
        meta.query_start.clone(), meta.kv_lens.clone(), meta.slot_mapping.clone(),
        torch.nn.functional.pad(meta.page_tables, (0, width - meta.page_tables.shape[1])),
        1, width * PAGE, padded=True)
    backend, runs = flashinfer_backend(cache)
    backend.begin_forward(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture: the dummy plan
        backend.forward_latent(0, q, new, LATENT, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_latent(0, q, new, LATENT, scale)

    n = b_meta.num_seqs
    static.query_start.copy_(torch.tensor([0, 1, 2, 3, 3]))  # the padding request owns none
    static.kv_lens.copy_(torch.nn.functional.pad(b_meta.kv_lens, (0, 1)))
    static.slot_mapping[:n].copy_(b_meta.slot_mapping)
    static.slot_mapping[n:] = (POOL - 1) * PAGE  # the padding row's latent: an unowned page
    static.page_tables.zero_()
    static.page_tables[:n, : b_meta.page_tables.shape[1]].copy_(b_meta.page_tables)
    q[:n].copy_(b_q)
    new[:n].copy_(b_new)
    cache.k.copy_(b_cache.k)
    backend.before_replay(4, 1, b_meta)
    graph.replay()
    assert len(runs) == 2, runs  # warm-up and capture went through FlashInfer
    assert_close(out[:n], expected, "FlashInfer graph replay")


def test_tiny_deepseek_decodes_like_the_triton_kernel(tmp_path, monkeypatch):
    """A 2-layer DeepSeek-V3 with the real latent widths (16 heads, 512 + 64), bf16: greedy
    tokens with FlashInfer's decode (graphs, and eager) equal the Triton kernel's, or part at
    a token the Triton run rates within 0.1 nats of its runner-up (a bf16 near-tie)."""
    from flashtree import LLM, SamplingParams
    from tests.tiny import save_tiny_deepseek_v3

    target = save_tiny_deepseek_v3(tmp_path / "t", seed=3, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=16,
                                   kv_lora_rank=LATENT, qk_rope_head_dim=ROPE)
    prompts = [[3, 17, 40, 8, 22, 5, 61, 9, 30], [12, 4, 7], [50, 2, 33, 19, 11]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def generate(flashinfer: bool, eager: bool):
        monkeypatch.setenv("FLASHTREE_FLASHINFER", "1" if flashinfer else "0")
        llm = LLM(model=str(target), device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                  page_size=PAGE, max_num_seqs=4, enforce_eager=eager)
        assert (llm.engine.runner.backend.latent_decode is not None) == flashinfer
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
        return outs

    want = generate(False, False)
    for eager in (False, True):
        for ref, got in zip(want, generate(True, eager)):
            t = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids))
                      if a != b), None)
            if t is not None:
                top = sorted((lp.logprob for lp in ref.logprobs[t].values()), reverse=True)
                assert top[0] - top[1] < 0.1, (eager, t, ref.token_ids, got.token_ids)
