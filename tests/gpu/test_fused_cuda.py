"""The fused Triton kernels compiled on CUDA: the interpreter cases of tests/layers/ (fp32 and
bf16, Llama and Qwen3 head dims), and whole models that run them (Llama, and Qwen3 with its
q/k norm) against transformers on the same device: in float32 the logits agree to 1e-3, in
bfloat16 flashtree's distance from the float32 reference is at most about transformers' own
bf16 distance; the drafter's context K/V written by one projection and the fused
norm-rope-to-cache kernel per layer equal its eager `context_kv`. Skips without CUDA or
triton."""

from __future__ import annotations

import random

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree import LLM  # noqa: E402
from flashtree.models.loader import load_hf_model  # noqa: E402
from tests.helpers import PagedHarness, load_reference, save_checkpoint  # noqa: E402
from tests.layers.fused_cases import (  # noqa: E402
    DTYPES,
    check_mla_prologue,
    check_norm_rope,
    check_norm_rope_to_cache,
    check_rms_norm,
    check_silu_mul,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,residual,heads", [(576, False, 0), (4096, True, 0), (128, False, 8),
                                                (96, True, 0)])
def test_rms_norm_on_cuda(dtype, dim, residual, heads):
    for seed in range(3):
        check_rms_norm(dtype, "cuda", dim, residual, heads, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1536, 12288])
def test_silu_mul_on_cuda(dtype, inter):
    check_silu_mul(dtype, "cuda", inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,with_norm", [(64, False), (128, True), (12, True)])
def test_norm_rope_on_cuda(dtype, head_dim, with_norm):
    for seed in range(3):
        check_norm_rope(dtype, "cuda", head_dim, with_norm, seed)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen3", dict(head_dim=16))])
@torch.inference_mode()
def test_model_logits_on_cuda_match_transformers(tmp_path, arch, overrides):
    path = save_checkpoint(tmp_path / arch, arch, seed=3, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (29, 5, 1, 17)]
    reference = load_reference(path, arch).cuda()  # float32
    errors = {}  # dtype -> per prompt (ours, transformers') max |logit - float32 reference|
    for dtype in DTYPES:
        model, _ = load_hf_model(path, dtype, torch.device("cuda"))
        ours, _ = PagedHarness(model, page_size=4).prefill_all_logits(prompts)
        theirs_model = load_reference(path, arch).cuda().to(dtype)
        errors[dtype] = []
        for p, logits in zip(prompts, ours):
            ids = torch.tensor([p], device="cuda")
            ref = reference(ids).logits[0].float()
            theirs = theirs_model(ids).logits[0].float()
            errors[dtype].append(((logits - ref).abs().max().item(),
                                  (theirs - ref).abs().max().item()))
    for ours_err, _ in errors[torch.float32]:
        assert ours_err <= 1e-3, errors
    for ours_err, theirs_err in errors[torch.bfloat16]:
        assert ours_err <= 2 * theirs_err + 1e-2, errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,with_norm", [(64, False), (12, True)])
@pytest.mark.parametrize("layers", [0, 3])
def test_norm_rope_to_cache_on_cuda(dtype, head_dim, with_norm, layers):
    check_norm_rope_to_cache(dtype, "cuda", head_dim, with_norm, layers)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [8, 128])  # a Kimi TP8 rank's, DeepSeek-V3's whole
def test_mla_prologue_on_cuda(dtype, interleaved, heads):
    check_mla_prologue(dtype, "cuda", interleaved, latent=512, rope=64, heads=heads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafter_context_write_equals_context_kv(small_pair, dtype):
    target, drafter = map(str, small_pair)
    llm = LLM(model=target, draft=drafter, spec="ddtree", device="cuda", dtype=dtype,
              skip_tokenizer_init=True, enforce_eager=True)
    proposer = llm.engine.proposer
    draft, cache = proposer.draft, proposer.cache
    assert draft.layers[0].self_attn.k_norm is not None  # Qwen3 drafter: the norm runs too
    generator = torch.Generator("cuda").manual_seed(0)
    n = 37
    features = torch.randn(n, draft.fc.weight.shape[1], device="cuda", generator=generator,
                           dtype=cache.k.dtype)
    positions = torch.randint(0, 200, (n,), device="cuda", generator=generator)
    slots = torch.randperm(cache.k.shape[1], device="cuda", generator=generator)[:n]
    k_cache, v_cache = torch.zeros_like(cache.k), torch.zeros_like(cache.v)
    with torch.inference_mode():
        draft.write_context_kv(features, positions, draft.context_projection(), k_cache,
                               v_cache, slots)
        expected = draft.context_kv(features, positions)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for layer, (k, v) in enumerate(expected):
        torch.testing.assert_close(k_cache[layer, slots], k, rtol=tol, atol=tol)
        torch.testing.assert_close(v_cache[layer, slots], v, rtol=tol, atol=tol)
    written = torch.zeros(cache.k.shape[1], dtype=torch.bool, device="cuda")
    written[slots] = True
    assert not k_cache[:, ~written].any() and not v_cache[:, ~written].any()
