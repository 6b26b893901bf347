"""flashtree's decoder family against transformers on tiny random checkpoints that transformers
wrote itself: logits of batched prefills, chunked prefills and decode steps through the paged KV
cache (page_size 4, pages interleaved between sequences), RoPE frequencies (incl. Llama-3
scaling) and captured hidden states."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flashtree.layers.rotary import rope_inv_freq
from flashtree.models.config import ModelConfig
from flashtree.models.llama import DecoderModel
from flashtree.models.loader import load_hf_model
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from tests.helpers import (
    LLAMA3_ROPE,
    PagedHarness,
    checkpoint_tensor_names,
    load_reference,
    reference_hidden_states,
    reference_logits,
    save_checkpoint,
)

ATOL = 1e-4
SHARD = 20_000  # bytes: every tensor above this gets a shard of its own

# name -> (arch, config overrides, max_shard_size)
CASES = {
    # head_dim 32 with theta 500k and original context 32 puts rotary frequencies in all three
    # Llama-3 bands (kept, smoothed, divided by the factor).
    "llama3-rope-untied": (
        "llama",
        dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=500000.0,
             rope_scaling=LLAMA3_ROPE),
        None,
    ),
    "llama-bias-tied-sharded": (
        "llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True), SHARD
    ),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True), None),
    "qwen2-bias-untied-sharded": ("qwen2", dict(num_key_value_heads=1), SHARD),
    # head_dim 12 != hidden 32 / 4 heads.
    "qwen3-qknorm-untied": ("qwen3", dict(head_dim=12), None),
    "qwen3-qknorm-tied-sharded": (
        "qwen3", dict(head_dim=12, tie_word_embeddings=True, rope_theta=1000.0), SHARD
    ),
}


@dataclass
class Case:
    name: str
    arch: str
    overrides: dict
    sharded: bool
    path: Path
    hf: torch.nn.Module
    model: DecoderModel
    cfg: ModelConfig


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    arch, overrides, shard = CASES[request.param]
    seed = list(CASES).index(request.param)
    path = save_checkpoint(
        tmp_path_factory.mktemp(request.param), arch, seed=seed, max_shard_size=shard,
        **overrides,
    )
    model, cfg = load_hf_model(path, torch.float32, torch.device("cpu"))
    return Case(request.param, arch, overrides, shard is not None, path,
                load_reference(path, arch), model, cfg)


def _prompts(lengths: list[int], seed: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, (
        f"{what}: max |logit diff| {err:.3g} > {ATOL} (logit scale {ref.abs().max().item():.3g})"
    )


def test_checkpoint_exercises_the_feature(case: Case):
    """Guard against a vacuous comparison: each checkpoint really has the feature it names."""
    names = checkpoint_tensor_names(case.path)
    tied = case.overrides.get("tie_word_embeddings", False)
    assert case.cfg.tie_word_embeddings == tied
    assert ("lm_head.weight" in names) == (not tied)
    if tied:
        assert case.model.lm_head.weight is case.model.embed_tokens.weight
    else:
        assert not torch.equal(case.model.lm_head.weight, case.model.embed_tokens.weight)
    shards = sorted(case.path.glob("*.safetensors"))
    if case.sharded:
        assert (case.path / "model.safetensors.index.json").is_file()
        assert len(shards) > 2, [s.name for s in shards]
    else:
        assert [s.name for s in shards] == ["model.safetensors"]
    if case.arch == "qwen2" or case.overrides.get("attention_bias"):
        bias = case.model.layers[1].self_attn.qkv_proj.bias
        ref_attn = case.hf.model.layers[1].self_attn
        ref_bias = torch.cat([ref_attn.q_proj.bias, ref_attn.k_proj.bias, ref_attn.v_proj.bias])
        assert bias is not None and bias.abs().min() > 0
        assert torch.equal(bias, ref_bias)
    if case.overrides.get("attention_bias"):
        assert case.model.layers[1].self_attn.o_proj.bias is not None
        assert case.model.layers[1].mlp.down_proj.bias is not None
    if case.arch == "qwen3":
        assert case.cfg.qk_norm and case.cfg.head_dim * case.cfg.num_heads != case.cfg.hidden_size
        q_norm = case.model.layers[0].self_attn.q_norm.weight
        assert torch.equal(q_norm, case.hf.model.layers[0].self_attn.q_norm.weight)
        assert not torch.equal(q_norm, torch.ones_like(q_norm))
    if "rope_scaling" in case.overrides:
        assert case.cfg.rope.rope_type == "llama3" and case.cfg.rope.theta == 500000.0


def test_rope_frequencies_match_transformers(case: Case):
    ours = rope_inv_freq(case.cfg.rope, case.cfg.head_dim)
    ref = case.hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert case.hf.model.rotary_emb.attention_scaling == 1.0
    if case.cfg.rope.rope_type == "llama3":
        plain = rope_inv_freq(
            type(case.cfg.rope)(theta=case.cfg.rope.theta), case.cfg.head_dim
        )
        ratio = plain / ours
        kept = torch.isclose(ratio, torch.tensor(1.0))
        divided = torch.isclose(ratio, torch.tensor(LLAMA3_ROPE["factor"]))
        assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio


def test_batched_prefill_logits_every_position(case: Case):
    """Several prompts of different lengths (one of them a single token, one past the Llama-3
    original context of 32) prefilled in ONE forward over non-contiguous pages."""
    prompts = _prompts([41, 7, 1, 23], seed=1)
    h = PagedHarness(case.model, page_size=4)
    logits, features = h.prefill_all_logits(prompts)
    assert features is None
    table = h.pages.table(0)
    assert any(b != a + 1 for a, b in zip(table, table[1:])), table
    for i, p in enumerate(prompts):
        _assert_logits_close(logits[i], reference_logits(case.hf, p), f"prompt {i} (len {len(p)})")


def test_decode_steps_through_paged_cache(case: Case):
    """Prefill (last-token logits only, as the engine asks), then single-token decode steps
    whose logits equal transformers' logits of the whole sequence. One sequence finishes early
    and its freed pages (still holding its stale K/V) are reused by the others."""
    prompts = _prompts([30, 9, 17], seed=2)
    steps = [12, 4, 12]  # decode steps per sequence
    rng = random.Random(3)
    h = PagedHarness(case.model, page_size=4)
    tokens = [list(p) for p in prompts]
    logits, _ = h.forward(Mode.PREFILL, [BatchItem(i, 0, list(p)) for i, p in enumerate(prompts)])
    ours = [[row[0]] for row in logits]

    freed: list[int] = []
    for step in range(max(steps)):
        for i, n in enumerate(steps):
            if step == n:
                freed += h.pages.table(i)
                h.pages.free(i)
        live = [i for i, n in enumerate(steps) if step < n]
        items = []
        for i in live:
            tokens[i].append(rng.randrange(case.cfg.vocab_size))
            items.append(BatchItem(i, len(tokens[i]) - 1, tokens[i][-1:]))
        logits, _ = h.forward(Mode.DECODE, items)
        for i, rows in zip(live, logits):
            assert rows.shape == (1, case.cfg.vocab_size)
            ours[i].append(rows[0])

    # The early finisher's pages went back to the pool and were handed to the others.
    assert set(freed) & set(h.pages.table(0) + h.pages.table(2)), freed
    for i, (p, n) in enumerate(zip(prompts, steps)):
        assert len(tokens[i]) == len(p) + n
        ref = reference_logits(case.hf, tokens[i])[len(p) - 1:]
        _assert_logits_close(torch.stack(ours[i]), ref, f"sequence {i}")


def test_mixed_chunks_in_one_forward(case: Case):
    """One forward that mixes a decode token, a continuation chunk of a partly prefilled prompt
    (context + several new tokens) and a fresh prompt."""
    a, b, c = _prompts([13, 25, 6], seed=4)
    a = a + [5]
    h = PagedHarness(case.model, page_size=4)
    first, _ = h.forward(
        Mode.PREFILL, [BatchItem(0, 0, a[:13], all_logits=True),
                       BatchItem(1, 0, b[:10], all_logits=True)],
    )
    second, _ = h.forward(
        Mode.PREFILL, [BatchItem(2, 0, c, all_logits=True),
                       BatchItem(1, 10, b[10:], all_logits=True),
                       BatchItem(0, 13, a[13:], all_logits=True)],
    )
    ref_a, ref_b = reference_logits(case.hf, a), reference_logits(case.hf, b)
    _assert_logits_close(first[0], ref_a[:13], "a prefill")
    _assert_logits_close(first[1], ref_b[:10], "b first chunk")
    _assert_logits_close(second[0], reference_logits(case.hf, c), "c prefill")
    _assert_logits_close(second[1], ref_b[10:], "b second chunk")
    _assert_logits_close(second[2], ref_a[13:], "a decode")


def test_captured_hidden_states_match_transformers(case: Case):
    """capture_layers=(0, 2) returns the OUTPUT of decoder layers 0 and 2, which transformers
    reports as hidden_states[1] and hidden_states[3], for every token of a batched prefill."""
    assert case.cfg.num_layers == 4  # layer 2 is not the last: hidden_states[3] is un-normed
    hidden = case.cfg.hidden_size
    prompts = _prompts([19, 5, 33], seed=5)
    sizes = [len(p) for p in prompts]
    h = PagedHarness(case.model, page_size=4, capture_layers=(0, 2))
    logits, features = h.prefill_all_logits(prompts)
    assert features is not None and features.shape == (sum(sizes), 2 * hidden)
    refs = [reference_hidden_states(case.hf, p) for p in prompts]
    for i, (ref, feats) in enumerate(zip(refs, features.split(sizes))):
        assert len(ref) == case.cfg.num_layers + 1
        for j, layer in enumerate((0, 2)):
            torch.testing.assert_close(
                feats[:, j * hidden:(j + 1) * hidden], ref[layer + 1], atol=ATOL, rtol=1e-4,
                msg=lambda m, i=i, layer=layer: f"prompt {i}, layer {layer}: {m}",
            )
        _assert_logits_close(logits[i], reference_logits(case.hf, prompts[i]), f"prompt {i}")
        # A layer mix-up would pass unnoticed if consecutive layers were nearly equal.
        assert (ref[1] - ref[3]).abs().max() > 100 * ATOL

    # The model itself: captured outputs come back in the order asked for, and its returned
    # hidden state is the final-normed one (transformers' last hidden_states entry).
    # `on_captured` gets them once, as soon as the last of them (layer 2) has run.
    batch = ForwardBatch.build(
        Mode.PREFILL, [BatchItem(i, 0, p) for i, p in enumerate(prompts)], h.pages,
        torch.device("cpu"),
    )
    ran, handed = [], []
    hooks = [layer.register_forward_hook(lambda *_, i=i: ran.append(i))
             for i, layer in enumerate(case.model.layers)]
    with torch.inference_mode():
        h.runner.backend.begin_forward(batch.attn)
        final, captured = case.model(
            batch.input_ids, batch.positions, h.runner.backend, capture_layers=(2, 0),
            on_captured=lambda tensors: handed.append((list(ran), tensors)),
        )
    for hook in hooks:
        hook.remove()
    assert [layers for layers, _ in handed] == [[0, 1, 2]] and ran == [0, 1, 2, 3]
    assert all(a is b for a, b in zip(handed[0][1], captured, strict=True))
    assert len(captured) == 2
    for i, ref in enumerate(refs):
        torch.testing.assert_close(captured[0].split(sizes)[i], ref[3], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(captured[1].split(sizes)[i], ref[1], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(final.split(sizes)[i], ref[-1], atol=ATOL, rtol=1e-4)
