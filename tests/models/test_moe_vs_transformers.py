"""Qwen3-MoE and DeepSeek-V3 (Kimi K2 architecture) against transformers on tiny random
checkpoints that transformers wrote itself (fp32, CPU): every routing variant the configs can
ask for (softmax / sigmoid scoring, group-limited selection with the correction bias,
norm_topk_prob on and off, routed scaling, shared experts, dense-only layers), MLA with and
without a q LoRA, YaRN (cos/sin mscale and DeepSeek's softmax mscale), interleaved and plain
rope layouts. Logits of batched prefills and paged decode steps, captured layer outputs, greedy
tokens through LLM, and DDTree over a random drafter returning exactly the plain tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.layers.moe import SparseMoE
from flashtree.layers.rotary import rope_attention_scaling, rope_inv_freq
from flashtree.models.config import ModelConfig
from flashtree.models.llama import DecoderModel
from flashtree.models.loader import load_hf_model
from flashtree.runner.forward_batch import BatchItem, Mode
from tests.helpers import PagedHarness, reference_hidden_states, reference_logits
from tests.tiny import save_reference_drafter, save_tiny_deepseek_v3, save_tiny_qwen3_moe

ATOL = 1e-4
VOCAB = 96
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 32, "beta_slow": 1}

# name -> (family, config overrides)
CASES = {
    # softmax, renormalized top-2, layer 1 dense (mlp_only_layers).
    "qwen3moe-norm": ("qwen3_moe", dict(mlp_only_layers=[1])),
    # softmax, raw top-3 probabilities, every second layer sparse.
    "qwen3moe-raw-step2": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2,
                                             num_experts_per_tok=3)),
    # sigmoid + correction bias, 2 of 4 groups, renormalized, x2.5, q LoRA, YaRN, interleaved
    # rope, attention biases.
    "dsv3-grouped-yarn": ("deepseek_v3", dict(rope_parameters=YARN, attention_bias=True)),
    # sigmoid, one group, raw weights x1.7, no q LoRA, plain rope layout, two shared experts,
    # no dense layer.
    "dsv3-nolora-raw": ("deepseek_v3", dict(
        q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.7, rope_interleave=False, n_shared_experts=2,
        first_k_dense_replace=0, num_experts_per_tok=3)),
}


@dataclass
class Case:
    name: str
    family: str
    overrides: dict
    path: Path
    hf: torch.nn.Module
    model: DecoderModel
    cfg: ModelConfig


def _reference(path: Path, family: str):
    import transformers as tf

    cls = tf.Qwen3MoeForCausalLM if family == "qwen3_moe" else tf.DeepseekV3ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _save(family: str, path: Path, seed: int, **overrides) -> Path:
    save = save_tiny_qwen3_moe if family == "qwen3_moe" else save_tiny_deepseek_v3
    return save(path, seed=seed, **overrides)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    family, overrides = CASES[request.param]
    path = _save(family, tmp_path_factory.mktemp(request.param), list(CASES).index(request.param),
                 **overrides)
    model, cfg = load_hf_model(path, torch.float32, torch.device("cpu"))
    return Case(request.param, family, overrides, path, _reference(path, family), model, cfg)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, f"{what}: max |logit diff| {err:.3g} > {ATOL}"


def test_config_parsed_as_the_checkpoint_says(case: Case):
    """Guard against vacuous comparisons: each case really routes the way its name says."""
    moe = case.cfg.moe
    assert moe is not None
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in case.model.layers]
    assert sparse == list(moe.sparse_layers)
    if case.family == "qwen3_moe":
        assert moe.scoring_func == "softmax" and moe.num_shared_experts == 0
        assert case.cfg.mla is None and case.cfg.qk_norm
        step = case.overrides.get("decoder_sparse_step", 1)
        dense = case.overrides.get("mlp_only_layers", [])
        assert sparse == [i not in dense and (i + 1) % step == 0 for i in range(3)]
        assert moe.norm_topk_prob == case.overrides.get("norm_topk_prob", True)
        return
    assert (moe.scoring_func, moe.topk_method) == ("sigmoid", "noaux_tc")
    assert moe.n_group == case.overrides.get("n_group", 4)
    assert moe.routed_scaling_factor == case.overrides.get("routed_scaling_factor", 2.5)
    assert sparse[0] == (case.overrides.get("first_k_dense_replace", 1) == 0)
    mla = case.cfg.mla
    assert mla is not None and mla.q_lora_rank == case.overrides.get("q_lora_rank", 24)
    assert mla.rope_interleave == case.overrides.get("rope_interleave", True)
    # The selection bias was loaded (non-zero), and kept in float32.
    gate = case.model.layers[1].mlp.gate
    ref_gate = case.hf.model.layers[1].mlp.gate
    assert torch.equal(gate.e_score_correction_bias, ref_gate.e_score_correction_bias)
    assert gate.e_score_correction_bias.abs().min() > 0
    assert case.model.kv_cache_dims() == (1, 16 + 8, 0)  # latent + rope key, no V


def test_rope_matches_transformers(case: Case):
    ours = rope_inv_freq(case.cfg.rope, case.cfg.head_dim)
    rotary = case.hf.model.rotary_emb
    torch.testing.assert_close(ours, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_scaling(case.cfg.rope) == pytest.approx(rotary.attention_scaling)
    if "rope_parameters" in case.overrides:
        assert rotary.attention_scaling != 1.0  # mscale != mscale_all_dim: cos/sin scaled
        attn = case.model.layers[0].self_attn
        assert attn.scale == pytest.approx(case.hf.model.layers[0].self_attn.scaling)
        assert attn.scale != pytest.approx(16 ** -0.5)


def test_batched_prefill_logits_every_position(case: Case):
    prompts = _prompts([37, 6, 1, 21], seed=1)
    h = PagedHarness(case.model, page_size=4)
    logits, _ = h.prefill_all_logits(prompts)
    for i, p in enumerate(prompts):
        _assert_close(logits[i], reference_logits(case.hf, p), f"prompt {i} (len {len(p)})")


def test_decode_steps_through_paged_cache(case: Case):
    """Prefill chunks, then single-token decode steps, against transformers' logits of the
    whole sequence; one sequence finishes early and its freed pages are reused."""
    prompts = _prompts([19, 8, 13], seed=2)
    steps = [10, 3, 10]
    rng = random.Random(3)
    h = PagedHarness(case.model, page_size=4)
    tokens = [list(p) for p in prompts]
    first, _ = h.forward(Mode.PREFILL, [BatchItem(0, 0, prompts[0][:9]),
                                        BatchItem(1, 0, prompts[1]), BatchItem(2, 0, prompts[2])])
    last, _ = h.forward(Mode.PREFILL, [BatchItem(0, 9, prompts[0][9:])])
    ours = [[last[0][0]], [first[1][0]], [first[2][0]]]
    for step in range(max(steps)):
        for i, n in enumerate(steps):
            if step == n:
                h.pages.free(i)
        live = [i for i, n in enumerate(steps) if step < n]
        items = []
        for i in live:
            tokens[i].append(rng.randrange(VOCAB))
            items.append(BatchItem(i, len(tokens[i]) - 1, tokens[i][-1:]))
        logits, _ = h.forward(Mode.DECODE, items)
        for i, rows in zip(live, logits):
            ours[i].append(rows[0])
    for i, p in enumerate(prompts):
        ref = reference_logits(case.hf, tokens[i])[len(p) - 1:]
        _assert_close(torch.stack(ours[i]), ref, f"sequence {i}")


def test_captured_layer_outputs_match_transformers(case: Case):
    """DFlash taps: the output of decoder layers 0 and 1 (HF hidden_states[1] and [2])."""
    hidden = case.cfg.hidden_size
    prompts = _prompts([11, 4], seed=5)
    h = PagedHarness(case.model, page_size=4, capture_layers=(0, 1))
    _, features = h.prefill_all_logits(prompts)
    assert features is not None
    for p, feats in zip(prompts, features.split([len(p) for p in prompts])):
        ref = reference_hidden_states(case.hf, p)
        torch.testing.assert_close(feats[:, :hidden], ref[1], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(feats[:, hidden:], ref[2], atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def drafter(case: Case, tmp_path_factory) -> Path:
    return save_reference_drafter(tmp_path_factory.mktemp(f"{case.name}-drafter"), case.path,
                                  block_size=4, target_layer_ids=[0, 1])


def test_greedy_tokens_equal_transformers_plain_and_ddtree(case: Case, drafter: Path):
    prompts = _prompts([9, 3, 14], seed=7)
    n = 12
    want = []
    for p in prompts:
        out = case.hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for spec in ("none", "ddtree", "dflash"):
        extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec}
        llm = LLM(model=str(case.path), device="cpu", dtype="float32", skip_tokenizer_init=True,
                  page_size=4, **extra)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, f"spec={spec}"
        assert (llm.engine.speculative is None) == (spec == "none")


def test_tree_verify_logits_through_the_paged_cache(case: Case):
    """A DDTree-shaped verify forward (siblings share a position, ancestor-only mask) after a
    prefill: every node's logits equal transformers' logits of the prompt + its root path. For
    DeepSeek this is the MLA latent path with a tree mask."""
    prompt = _prompts([13], seed=9)[0]
    n = len(prompt)
    # node: (token, parent); 0 is the root (the bonus token).
    nodes = [(5, -1), (17, 0), (40, 0), (61, 1), (2, 1), (33, 3)]
    depth = []
    for _, parent in nodes:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    visible = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i, (_, parent) in enumerate(nodes):
        visible[i, i] = True
        if parent >= 0:
            visible[i] |= visible[parent]
    h = PagedHarness(case.model, page_size=4)
    h.forward(Mode.PREFILL, [BatchItem(0, 0, prompt)])
    logits, _ = h.forward(Mode.VERIFY, [BatchItem(
        0, n, [t for t, _ in nodes], all_logits=True, positions=[n + d for d in depth],
        visible=visible)])
    for i in range(len(nodes)):
        path = [nodes[j][0] for j in range(len(nodes)) if visible[i, j]]
        ref = reference_logits(case.hf, prompt + path)[-1]
        _assert_close(logits[0][i], ref, f"node {i} (path {path})")
