"""GGUF 4-bit weights kept packed on the CPU: the codes, scales and zeros read from Q4_0 / Q4_1
blocks dequantize to exactly what the `gguf` package's own dequantizer gives; the int4 kernel's
products equal float32 ones within the bound of its bfloat16 roundings (activations, scales,
zeros, output); and the default model with `quantization="int4"` scores tokens as the float
path does within that rounding's bound and decodes the float path's greedy tokens up to a
near-tie, with every speculative mode equal to its own plain decoding up to a near-tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from flashtree import LLM, SamplingParams
from flashtree.layers.int4_cpu import GROUP, Int4Weight, Q8Weight, gguf_q4_blocks, gguf_q8_blocks
from flashtree.models import gguf
from flashtree.runner.forward_batch import BatchItem, Mode
from tests.models.near_ties import assert_greedy_equal_up_to_near_tie

PROMPTS = [[(97 * i + 13 * j) % 9000 + 200 for j in range(24 + 7 * i)] for i in range(3)]
U = 2.0**-8  # bfloat16 keeps 8 significant bits: a rounding moves a value by up to U of itself


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
    assert (got - expected).abs().max() <= U * expected.abs().max()
    # Against float32: rounding x moves each product by U |x w|, the scale and zero by
    # U |x| (|(c - 8) d| + |z|), and the output by U |x W^T| (to first order in U).
    float_product = torch.nn.functional.linear(x, weight)
    step = ((codes.view(96, -1, GROUP) - 8) * scales[..., None]).view(96, -1)
    spread = weight.abs() + step.abs() + zeros.abs().repeat_interleave(GROUP, 1)
    bound = U * (x.abs() @ spread.t() + float_product.abs())
    assert ((got - float_product).abs() <= bound).all()


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
    # The planes hold c d' for the bf16 scale d' (16 d' and 8 d' are exact): U |w| at most.
    assert ((packed.rows(ids) - weight[ids]).abs() <= U * weight[ids].abs()).all()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    expected = x @ weight.t()
    # Rounding x and d moves each product by 2 U |x w|; each plane's output rounds by U of
    # itself, bounded by |x| times its weights' size: (h - 8) 16 d and l d (to first order).
    unsigned = torch.from_numpy(codes).int() + 128
    group_scales = torch.from_numpy(scales).abs().repeat_interleave(GROUP, 1)
    planes = ((unsigned // 16 - 8) * 16).abs() * group_scales + (unsigned % 16) * group_scales
    bound = U * (2 * x.abs() @ weight.abs().t() + x.abs() @ planes.t())
    assert ((packed.matmul(x) - expected).abs() <= bound).all()


# The bf16 roundings move a logit by about 2 U S, S its row's largest |logit|: U S from those
# at the LM head (its input and its output), as much again from all the layers before it, whose
# roundings reach the final hidden state at about U of its size through the final norm. A
# probable token's log-prob, that logit less a log-sum-exp that moves with the row's top
# logits, moves by that much; a tail token's (below TAIL nats) moves apart from them: twice
# that. A top-2 gap may move by twice that too: the NEAR_TIE margin, below which greedy
# decoding may pick either token.
LOGPROB_BOUND, TAIL, TAIL_BOUND, NEAR_TIE = 2 * U, -15.0, 4 * U, 4 * U


def _logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """`llm`'s logits after each of `tokens`, all in one prefill: [len(tokens), V] float32."""
    sid = 10**6
    llm.engine.pages.reserve(sid, len(tokens))
    try:
        logits, _ = llm.engine.runner.forward(Mode.PREFILL,
                                              [BatchItem(sid, 0, tokens, all_logits=True)])
    finally:
        llm.engine.pages.free(sid)
    return logits.float()


def _assert_scores_within_rounding(exact: torch.Tensor, packed: torch.Tensor,
                                   seq: list[int], decoded: slice, what: str) -> None:
    """exact, packed: the two paths' logits after each token of `seq`: the log-prob of each
    next token, and the top-2 gap of the rows that chose the `decoded` tokens (rows
    `decoded`), agree within the bounds above."""
    scale = exact.abs().amax(-1)
    chosen = torch.tensor(seq[1:])[:, None]
    want = exact.log_softmax(-1)[:-1].gather(1, chosen)[:, 0]
    got = packed.log_softmax(-1)[:-1].gather(1, chosen)[:, 0]
    bound = torch.where(want > TAIL, LOGPROB_BOUND, TAIL_BOUND) * scale[:-1]
    worst = ((want - got).abs() / bound).argmax().item()
    assert (want - got).abs()[worst] <= bound[worst], (
        f"{what}: token {worst + 1}'s log-prob {got[worst]:.4f}, float {want[worst]:.4f}, "
        f"bound {bound[worst]:.3g}")
    top2 = exact[decoded].topk(2, -1).indices
    moved = (exact[decoded].gather(1, top2) - packed[decoded].gather(1, top2)).diff()[:, 0]
    assert (moved.abs() <= NEAR_TIE * scale[decoded]).all(), f"{what}: a top-2 gap moved"


def test_default_model_int4_matches_the_float_path():
    """Teacher-forced on the float path's greedy tokens, log-probs and top-2 gaps agree within
    the bf16 bounds; the int4 path's greedy tokens are the float path's up to a near-tie of the
    float path; every speculative mode's are int4 plain decoding's up to a near-tie of it."""
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
    for i, (prompt, ours, theirs) in enumerate(zip(PROMPTS, int4_tokens, float_tokens)):
        seq, decoded = prompt + theirs, slice(len(prompt) - 1, -1)
        reference = _logits(exact, seq)
        _assert_scores_within_rounding(reference, _logits(packed["none"], seq), seq, decoded,
                                       f"prompt {i}")
        rows = reference[decoded]
        assert_greedy_equal_up_to_near_tie(ours, theirs, rows,
                                           NEAR_TIE * rows.abs().amax(-1), f"int4, prompt {i}")
    # Speculative modes verify several rows at once, whose bfloat16 roundings differ from one
    # row's: they equal int4 plain decoding up to its near-ties.
    plain_rows = [_logits(packed["none"], p + t)[len(p) - 1: -1]
                  for p, t in zip(PROMPTS, int4_tokens)]
    for spec in ("dflash", "ddtree"):
        tokens = [o.outputs[0].token_ids for o in packed[spec].generate(PROMPTS, params)]
        for i, (ours, plain, rows) in enumerate(zip(tokens, int4_tokens, plain_rows)):
            assert_greedy_equal_up_to_near_tie(ours, plain, rows, NEAR_TIE * rows.abs().amax(-1),
                                               f"{spec}, prompt {i}")


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
