"""GGUF 4-bit weights kept packed on the CPU: the codes, scales and zeros read from Q4_0 / Q4_1
blocks dequantize to exactly what the `gguf` package's own dequantizer gives; the int4 kernel's
products equal float32 ones up to its bfloat16 roundings (activations, scales, zeros, output);
and the default model
with `quantization="int4"` decodes the float path's greedy tokens, with every speculative mode
equal to its own plain decoding, each up to near-ties that bfloat16 roundings flip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from flashtree import LLM, SamplingParams
from flashtree.layers.int4_cpu import GROUP, Int4Weight, Q8Weight, gguf_q4_blocks, gguf_q8_blocks
from flashtree.models import gguf

PROMPTS = [[(97 * i + 13 * j) % 9000 + 200 for j in range(24 + 7 * i)] for i in range(3)]


def _dequantized(codes, scales, zeros) -> np.ndarray:
    rows = codes.shape[0]
    return ((codes.reshape(rows, -1, GROUP) - 8) * scales[..., None]
            + zeros[..., None]).reshape(rows, -1).astype(np.float32)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_blocks_dequantize_as_gguf_does(kind):
    values = np.random.default_rng(0).normal(size=(48, 256)).astype(np.float32)
    raw = quants.quantize(values, kind)
    codes, scales, zeros = gguf_q4_blocks(raw, kind == GGMLQuantizationType.Q4_1)
    assert codes.min() >= 0 and codes.max() <= 15
    np.testing.assert_allclose(_dequantized(codes, scales, zeros),
                               quants.dequantize(raw, kind), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_int4_matmul_equals_float_up_to_bfloat16_activations(rows):
    raw = quants.quantize(np.random.default_rng(1).normal(size=(96, 192)).astype(np.float32),
                          GGMLQuantizationType.Q4_1)
    codes, scales, zeros = (torch.from_numpy(a) for a in gguf_q4_blocks(raw, True))
    weight = torch.from_numpy(_dequantized(codes.numpy(), scales.numpy(), zeros.numpy()))
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(2))
    got = Int4Weight(codes, scales, zeros).matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # The kernel reads bfloat16 activations, scales and zeros (the codes exactly) and writes
    # bfloat16: with those roundings applied, only the bfloat16 output's remains.
    rounded = torch.from_numpy(_dequantized(codes.numpy(), scales.bfloat16().float().numpy(),
                                            zeros.bfloat16().float().numpy()))
    expected = torch.nn.functional.linear(x.bfloat16().float(), rounded)
    assert (got - expected).abs().max() <= 2**-8 * expected.abs().max()
    float_product = torch.nn.functional.linear(x, weight)
    assert (got - float_product).abs().max() < 0.02 * float_product.abs().max()


def test_q8_blocks_and_their_two_int4_planes():
    """Q8_0 codes and scales dequantize as gguf does; split into two 4-bit planes they give the
    weight's rows (embedding lookups) up to bfloat16 scales and its products up to those and
    the kernel's bfloat16 activations and outputs."""
    values = np.random.default_rng(3).normal(size=(128, 96)).astype(np.float32)
    raw = quants.quantize(values, GGMLQuantizationType.Q8_0)
    codes, scales = gguf_q8_blocks(raw)
    weight = (codes.reshape(128, -1, GROUP) * scales[..., None]).reshape(128, -1)
    np.testing.assert_allclose(weight, quants.dequantize(raw, GGMLQuantizationType.Q8_0),
                               rtol=1e-6, atol=1e-6)
    packed = Q8Weight(torch.from_numpy(codes), torch.from_numpy(scales))
    weight = torch.from_numpy(weight)
    ids = torch.tensor([0, 31, 32, 63, 64, 100, 127, 5])
    assert (packed.rows(ids) - weight[ids]).abs().max() <= 2**-8 * weight.abs().max()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    expected = x @ weight.t()
    assert (packed.matmul(x) - expected).abs().max() < 0.01 * expected.abs().max()


# Largest log-prob change bfloat16 roundings may make to a token of the default model, with its
# 4-bit layers and its Q8_0 embedding / LM head packed (measured teacher-forced over PROMPTS and
# their continuations: at most 0.15 nats for tokens above -15 nats, 0.33 for one at -22.9, a
# probability of 1e-10 that no sampler or top-k list reaches).
LOGPROB_TOLERANCE = 0.25
TAIL_LOGPROB, TAIL_TOLERANCE = -15.0, 0.5


def test_default_model_int4_matches_the_float_path():
    """Teacher-forced log-probs agree within the tolerance; greedy tokens are the float path's
    up to a divergence at a near-tie (the float path rates the int4 path's token within the
    tolerance of its own); every speculative mode equals int4 plain decoding the same way."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model="default", device="cpu", max_model_len=256, skip_tokenizer_init=True,
              spec_policy="fixed")
    exact = LLM(spec="none", **kw)
    packed = {spec: LLM(spec=spec, quantization="int4", **kw)
              for spec in ("none", "dflash", "ddtree")}
    layer = packed["none"].model.layers[0]
    assert layer.mlp.gate_up_proj.int4 is not None and layer.mlp.gate_up_proj.weight is None
    assert layer.self_attn.qkv_proj.int4 is not None
    model = packed["none"].model  # the tied Q8_0 embedding and LM head: one packed weight
    assert model.embed_tokens.weight is None and model.lm_head.packed is model.embed_tokens.packed
    float_tokens = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    int4_tokens = [o.outputs[0].token_ids for o in packed["none"].generate(PROMPTS, params)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for prompt, ours, theirs in zip(PROMPTS, int4_tokens, float_tokens):
        seq = prompt + theirs
        a = exact.generate([seq], score)[0].prompt_logprobs
        b = packed["none"].generate([seq], score)[0].prompt_logprobs
        for p in range(1, len(seq)):
            expected = a[p][seq[p]].logprob
            tolerance = LOGPROB_TOLERANCE if expected > TAIL_LOGPROB else TAIL_TOLERANCE
            assert abs(expected - b[p][seq[p]].logprob) < tolerance
        split = next((j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        if split is not None:  # the float path's own rating of the int4 path's choice
            rated = a[len(prompt) + split]  # its chosen token and its top 2
            assert ours[split] in rated, f"int4 chose {ours[split]}, not near the top"
            assert rated[theirs[split]].logprob - rated[ours[split]].logprob < LOGPROB_TOLERANCE
    assert sum(t == f for t, f in zip(int4_tokens, float_tokens)) >= 1
    # Speculative modes verify several rows at once, whose bfloat16 roundings differ from one
    # row's by an ulp here and there: they equal int4 plain decoding up to near-ties.
    for spec in ("dflash", "ddtree"):
        tokens = [o.outputs[0].token_ids for o in packed[spec].generate(PROMPTS, params)]
        for prompt, ours, plain in zip(PROMPTS, tokens, int4_tokens):
            split = next((j for j, (x, y) in enumerate(zip(ours, plain)) if x != y), None)
            if split is not None:
                seq = prompt + plain[: split + 1]
                rated = packed["none"].generate([seq], score)[0].prompt_logprobs[-1]
                assert ours[split] in rated, f"{spec} chose {ours[split]}, not near the top"
                gap = abs(rated[plain[split]].logprob - rated[ours[split]].logprob)
                assert gap < LOGPROB_TOLERANCE, spec
        assert sum(t == p for t, p in zip(tokens, int4_tokens)) >= 1, spec


def test_packed_weights_are_cached_and_read_back(tmp_path, monkeypatch):
    """The first int4 load packs the GGUF's blocks and caches the packed form; the next load
    reads that cache instead of the file's blocks and holds the same weights, tied embedding
    and LM head included, and decodes the same tokens."""
    cached = tmp_path / "int4" / "packed.safetensors"
    monkeypatch.setattr(gguf, "packed_cache_file", lambda path: cached)
    kw = dict(model="default", device="cpu", spec="none", quantization="int4",
              skip_tokenizer_init=True, max_model_len=256)
    first = LLM(**kw)
    assert cached.is_file()
    monkeypatch.setattr(gguf, "_pack_from_file", lambda *a: pytest.fail("packed again"))
    second = LLM(**kw)
    want, got = _packed_tensors(first.model), _packed_tensors(second.model)
    assert sorted(got) == sorted(want) and len(want) == 2 * (4 * 30 + 2)  # 4 linears a layer
    assert all(torch.equal(got[k], want[k]) for k in want)
    model = second.model
    assert model.embed_tokens.weight is None and model.lm_head.packed is model.embed_tokens.packed
    assert model.layers[0].mlp.down_proj.weight is None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in second.generate(PROMPTS, params)]
            == [o.outputs[0].token_ids for o in first.generate(PROMPTS, params)])


def _packed_tensors(model) -> dict[str, torch.Tensor]:
    """Every packed tensor of `model` (codes, scales and zeros): its linear layers' and the
    embedding's two planes."""
    tensors = {}
    for name, m in model.named_modules():
        if getattr(m, "int4", None) is not None:
            tensors.update(m.int4.state(name))
    return {**tensors, **model.embed_tokens.packed.state("embed")}


def test_int4_is_refused_where_it_does_not_apply(tiny_chat_model):
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        LLM(model="default", quantization="int8")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        LLM(model=str(tiny_chat_model[0]), spec="none", device="cpu", quantization="int4")
