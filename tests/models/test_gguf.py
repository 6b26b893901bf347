"""The default SmolLM2-135M-Instruct GGUF (Q4_1) as flashtree reads it against transformers'
own GGUF loader: configuration, dequantized weights (incl. the q/k rotary row order that
llama.cpp permutes) and logits of a batched prefill through the paged KV cache, of a
conversion made afresh."""

from __future__ import annotations

import pytest
import torch

from flashtree.models.gguf import gguf_cache_dir, load_gguf_model
from flashtree.models.registry import default_model_path
from tests.helpers import PagedHarness, reference_logits
from tests.models.near_ties import assert_argmax_equal_outside_near_ties

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]
# Both sides compute in float32 from the same dequantized weights and differ only in the order
# of their sums: a float32 sum of K products can round differently by up to K * 2^-24 of their
# magnitude, about 1e-4 for the longest here (the MLP's 1536 products): the tolerance, relative
# to the logit scale.
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ours(default_llm):
    return default_llm.model


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The GGUF converted afresh, into an empty cache folder (`LLM("default")` may read
    flashtree's cached conversion): (model, cache root)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHTREE_CACHE", str(root))
        path = default_model_path()
        assert not gguf_cache_dir(path).exists()
        model, _ = load_gguf_model(path, torch.float32, torch.device("cpu"))
    return model, root


def test_config_matches_transformers(default_llm, hf_gguf_model):
    cfg, ref = default_llm.model_config, hf_gguf_model.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim
    )
    assert cfg.num_kv_heads < cfg.num_heads  # GQA: the k permutation uses the kv head count
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert cfg.rope.theta == pytest.approx(ref.rope_parameters["rope_theta"])
    assert cfg.tie_word_embeddings and default_llm.model.lm_head.weight is (
        default_llm.model.embed_tokens.weight
    )


def _assert_weights_equal(mine, hf_model, layers=(0, 29)) -> None:
    """Both sides dequantize the same Q4_1 blocks with `gguf`: equal to the last bit."""

    def same(a, b, what):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"{what}: {m}")

    same(mine.embed_tokens.weight, hf_model.model.embed_tokens.weight, "embed_tokens")
    same(mine.norm.weight, hf_model.model.norm.weight, "norm")
    for layer in layers:
        ref, ours_layer = hf_model.model.layers[layer], mine.layers[layer]
        attn = ours_layer.self_attn
        q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.shard_sizes)
        same(q, ref.self_attn.q_proj.weight, f"layer {layer} q_proj")
        same(k, ref.self_attn.k_proj.weight, f"layer {layer} k_proj")
        same(v, ref.self_attn.v_proj.weight, f"layer {layer} v_proj")
        same(attn.o_proj.weight, ref.self_attn.o_proj.weight, f"layer {layer} o_proj")
        gate, up = ours_layer.mlp.gate_up_proj.weight.chunk(2)
        same(gate, ref.mlp.gate_proj.weight, f"layer {layer} gate_proj")
        same(up, ref.mlp.up_proj.weight, f"layer {layer} up_proj")
        same(ours_layer.mlp.down_proj.weight, ref.mlp.down_proj.weight, f"layer {layer} down")
        same(ours_layer.input_layernorm.weight, ref.input_layernorm.weight, f"layer {layer} ln1")
        same(ours_layer.post_attention_layernorm.weight, ref.post_attention_layernorm.weight,
             f"layer {layer} ln2")


def test_dequantized_weights_match_transformers(ours, hf_gguf_model):
    _assert_weights_equal(ours, hf_gguf_model)


def test_uncached_conversion_matches_transformers(monkeypatch, fresh, ours, hf_gguf_model):
    """The GGUF reading itself (dequantization, the q/k rotary row un-permutation) against
    transformers', and the cache it writes reads back equal."""
    converted, root = fresh
    monkeypatch.setenv("FLASHTREE_CACHE", str(root))
    path = default_model_path()
    assert (gguf_cache_dir(path) / "model.safetensors").is_file()
    _assert_weights_equal(converted, hf_gguf_model, layers=(0, 17))
    reread, _ = load_gguf_model(path, torch.float32, torch.device("cpu"))
    theirs = ours.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, reread.state_dict()[name]), f"cache round trip: {name}"
        assert torch.equal(tensor, theirs[name]), f"LLM('default') differs: {name}"


def test_prefill_logits_match_transformers(default_llm, fresh, hf_gguf_model):
    """Logits of the fresh conversion (every layer's weights, not only those compared above)
    within float32 rounding of transformers'; the same argmax wherever the top two are further
    apart than that rounding can move them (each by the tolerance)."""
    prompts = [default_llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    h = PagedHarness(fresh[0], page_size=4, num_pages=32)
    logits, _ = h.prefill_all_logits(prompts)
    for p, mine in zip(prompts, logits):
        ref = reference_logits(hf_gguf_model, p)
        tolerance = LOGIT_TOLERANCE * ref.abs().max().item()
        err = (mine - ref).abs().max().item()
        assert err <= tolerance, f"max |logit diff| {err:.3g} > {tolerance:.3g}"
        assert_argmax_equal_outside_near_ties(mine, ref, 2 * tolerance, f"prompt {p[:4]}")
