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

from flashtree.config import ModelConfig
from flashtree.engine.scheduler import ScheduledChunk
from flashtree.layers.rotary import rope_inv_freq
from flashtree.models.llama import DecoderModel
from flashtree.models.loader import load_hf_model
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
        assert bias is not None and bias.abs().min() > 0
        assert torch.equal(bias, torch.cat([
            getattr(case.hf.model.layers[1].self_attn, p).bias for p in ("q_proj", "k_proj",
                                                                         "v_proj")
        ]))
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
    chunks = [ScheduledChunk(h.new_seq(p), 0, len(p)) for p in prompts]
    h.reserve_interleaved(chunks)
    table = h.pages.table(0)
    assert any(b != a + 1 for a, b in zip(table, table[1:])), table
    logits, _ = h.forward_all(chunks)
    for i, p in enumerate(prompts):
        _assert_logits_close(logits[i], reference_logits(case.hf, p), f"prompt {i} (len {len(p)})")


def test_decode_steps_through_paged_cache(case: Case):
    """Prefill through ModelRunner.forward (last-token logits), then decode steps whose logits
    equal transformers' logits of the whole sequence. One sequence finishes early and its freed
    pages (still holding its stale K/V) are reused by the others."""
    prompts = _prompts([30, 9, 17], seed=2)
    steps = [12, 4, 12]  # decode steps per sequence
    rng = random.Random(3)
    freed: list[int] = []
    h = PagedHarness(case.model, page_size=4)
    seqs = [h.new_seq(p) for p in prompts]
    chunks = [ScheduledChunk(s, 0, s.num_tokens) for s in seqs]
    h.reserve_interleaved(chunks)
    ours: list[list[torch.Tensor]] = [[row] for row in h.runner.forward(chunks)]

    for step in range(max(steps)):
        live = [s for s, n in zip(seqs, steps) if step < n]
        for s, n in zip(seqs, steps):
            if step == n:
                freed += h.pages.table(s.seq_id)
                h.pages.free(s.seq_id)
        for s in live:
            s.output_ids.append(rng.randrange(case.cfg.vocab_size))
            h.pages.reserve(s.seq_id, s.num_tokens)
        out = h.runner.forward([ScheduledChunk(s, s.num_computed, 1) for s in live])
        assert out.shape == (len(live), case.cfg.vocab_size)
        for s, row in zip(live, out):
            ours[s.seq_id].append(row)

    # The early finisher's pages went back to the pool and were handed to the others.
    assert set(freed) & set(h.pages.table(0) + h.pages.table(2)), freed
    for s, n in zip(seqs, steps):
        full = s.prompt_ids + s.output_ids
        assert len(full) == len(s.prompt_ids) + n
        ref = reference_logits(case.hf, full)[len(s.prompt_ids) - 1:]
        _assert_logits_close(torch.stack(ours[s.seq_id]), ref, f"sequence {s.seq_id}")


def test_mixed_chunks_in_one_forward(case: Case):
    """One forward that mixes a decode token, a continuation chunk of a partly prefilled prompt
    (context + several new tokens) and a fresh prompt."""
    a, b, c = _prompts([13, 25, 6], seed=4)
    h = PagedHarness(case.model, page_size=4)
    sa, sb, sc = h.new_seq(a), h.new_seq(b), h.new_seq(c)
    first = [ScheduledChunk(sa, 0, 13), ScheduledChunk(sb, 0, 10)]
    h.reserve_interleaved(first)
    logits_first, _ = h.forward_all(first)

    sa.output_ids.append(5)
    second = [ScheduledChunk(sc, 0, 6), ScheduledChunk(sb, 10, 15), ScheduledChunk(sa, 13, 1)]
    h.reserve_interleaved(second)
    logits_second, _ = h.forward_all(second)

    ref_a = reference_logits(case.hf, a + [5])
    ref_b = reference_logits(case.hf, b)
    _assert_logits_close(logits_first[0], ref_a[:13], "a prefill")
    _assert_logits_close(logits_first[1], ref_b[:10], "b first chunk")
    _assert_logits_close(logits_second[0], reference_logits(case.hf, c), "c prefill")
    _assert_logits_close(logits_second[1], ref_b[10:], "b second chunk")
    _assert_logits_close(logits_second[2], ref_a[13:], "a decode")


def test_captured_hidden_states_match_transformers(case: Case):
    """capture_layers=(0, 2) returns the OUTPUT of decoder layers 0 and 2, which transformers
    reports as hidden_states[1] and hidden_states[3]; the returned final hidden is normed."""
    assert case.cfg.num_layers == 4  # layer 2 is not the last: hidden_states[3] is un-normed
    prompts = _prompts([19, 5, 33], seed=5)
    h = PagedHarness(case.model, page_size=4)
    chunks = [ScheduledChunk(h.new_seq(p), 0, len(p)) for p in prompts]
    h.reserve_interleaved(chunks)
    with torch.inference_mode():
        meta = h.runner.build_metadata(chunks)
        h.runner.backend.begin_forward(meta)
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        hidden, captured = case.model(ids, positions, h.runner.backend, capture_layers=(0, 2))
    assert len(captured) == 2
    sizes = [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        ref = reference_hidden_states(case.hf, p)
        assert len(ref) == 5
        for layer, ours in zip((0, 2), captured):
            torch.testing.assert_close(
                ours.split(sizes)[i], ref[layer + 1], atol=ATOL, rtol=1e-4,
                msg=lambda m, i=i, layer=layer: f"prompt {i}, layer {layer}: {m}",
            )
        torch.testing.assert_close(hidden.split(sizes)[i], ref[-1], atol=ATOL, rtol=1e-4)
        # A mix-up between layers would still pass if consecutive layers were nearly equal.
        assert (ref[1] - ref[3]).abs().max() > 100 * ATOL

    # The order of capture_layers is the order of the returned list.
    with torch.inference_mode():
        h.runner.backend.begin_forward(meta)
        _, swapped = case.model(ids, positions, h.runner.backend, capture_layers=(2, 0))
    torch.testing.assert_close(swapped[0], captured[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(swapped[1], captured[0], atol=1e-6, rtol=0)
