"""DeepSeek-V3 checkpoint formats beyond plain safetensors (INT4: test_int4_checkpoints.py): the
Kimi K2.5/K2.6 multimodal wrapper (`text_config`, text weights under `language_model.`, vision
tensors skipped), DeepSeek's FP8 block quantization (`weight_scale_inv`, dequantized at load),
the MTP layer past the decoder stack, and refusals with messages for what is not supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree.models.loader import dequantize_fp8_blocks, load_hf_model
from tests.helpers import fp8_block_quantize, reference_logits
from tests.tiny import save_tiny_deepseek_v3

PROMPT = [3, 17, 42, 5, 88, 1, 9, 60, 33]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    import transformers as tf

    path = save_tiny_deepseek_v3(tmp_path_factory.mktemp("ds"), seed=11)
    hf = tf.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _logits(path: Path) -> torch.Tensor:
    from tests.helpers import PagedHarness

    model, _ = load_hf_model(path, torch.float32, CPU)
    logits, _ = PagedHarness(model).prefill_all_logits([PROMPT])
    return logits[0]


def test_kimi_k25_wrapper_and_language_model_prefix(ds, tmp_path):
    path, hf = ds
    text = json.loads((path / "config.json").read_text())
    text.pop("architectures")
    text["model_type"] = "kimi_k2"
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 16}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    tensors = {f"language_model.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3)
    tensors["mm_projector.proj.0.weight"] = torch.randn(32, 16)
    # The multi-token-prediction layer DeepSeek checkpoints carry past the decoder stack.
    tensors["language_model.model.layers.3.eh_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    model, cfg = load_hf_model(tmp_path, torch.float32, CPU)
    assert cfg.weight_prefix == "language_model." and cfg.architecture == "DeepseekV3ForCausalLM"
    err = (_logits(tmp_path) - reference_logits(hf, PROMPT)).abs().max().item()
    assert err < 1e-4, err


def test_fp8_block_checkpoint(ds, tmp_path):
    """Every projection stored as float8 + weight_scale_inv in 16x16 blocks (several shapes do
    not divide by 16); the reference is transformers' model holding the dequantized weights.
    The routed experts stay float8 with their scales; the rest is dequantized at load."""
    path, hf = ds
    import transformers as tf

    ref = tf.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(path / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name.endswith("_with_mqa.weight"):
            q, scale = fp8_block_quantize(w, 16)
            quantized[name], quantized[f"{name}_scale_inv"] = q, scale
            dequantized[name] = q.float() * scale.repeat_interleave(16, 0)[: w.shape[0]] \
                .repeat_interleave(16, 1)[:, : w.shape[1]]
        else:
            quantized[name] = w
    assert sum(v.dtype == torch.float8_e4m3fn for v in quantized.values()) > 20
    assert any(w.shape[1] % 16 for n, w in tensors.items() if n in dequantized)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # Scales in a different shard than their weights, as large checkpoints split them.
    scales = {k: v for k, v in quantized.items() if k.endswith("_scale_inv")}
    save_file({k: v for k, v in quantized.items() if k not in scales}, tmp_path / "a.safetensors")
    save_file(scales, tmp_path / "b.safetensors")
    hf_state = ref.state_dict()
    converted = {}
    for name, w in dequantized.items():  # transformers fuses experts: set them by hand
        if name in hf_state:
            converted[name] = w
    ref.load_state_dict(converted, strict=False)
    _set_fused_experts(ref, dequantized)
    err = (_logits(tmp_path) - reference_logits(ref, PROMPT)).abs().max().item()
    assert err < 1e-4, err
    # And the quantization really changed the weights (the comparison is not vacuous).
    plain = (_logits(tmp_path) - reference_logits(hf, PROMPT)).abs().max().item()
    assert plain > 1e-3, plain
    model, _ = load_hf_model(tmp_path, torch.bfloat16, CPU)
    moe = model.layers[1].mlp
    gate_up, down = moe.experts["0"].gate_up_proj, moe.experts["0"].down_proj
    assert gate_up.weight.dtype == down.weight.dtype == torch.float8_e4m3fn
    assert gate_up.weight_scale_inv.shape == (2, 2) and down.weight_scale_inv.shape == (2, 1)
    assert gate_up.weight_scale_inv.dtype == torch.float32
    assert moe.stacked.gate_up.dtype == torch.float8_e4m3fn and moe.stacked.fp8_block == (16, 16)
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16


def test_fp8_experts_split_in_whole_blocks(monkeypatch):
    """Tensor parallelism slices FP8 experts along whole scale blocks, or refuses."""
    import flashtree.layers.moe as moe

    monkeypatch.setattr(moe, "get_moe_tp", lambda: (0, 2))  # rank 0 of an expert's 2 slices
    with pytest.raises(ValueError, match="8 intermediate rows or columns per rank do not split "
                                         "into whole 16x16 blocks"):
        moe._ExpertLinear(32, 16, 2, split_dim=0, fp8_block=(16, 16))
    monkeypatch.setattr(moe, "get_moe_tp", lambda: (1, 2))  # rank 1: the second half
    down = moe._ExpertLinear(32, 64, 1, split_dim=1, fp8_block=(16, 16))  # [hidden, inter]
    gate_up = moe._ExpertLinear(32, 64, 2, split_dim=0, fp8_block=(16, 16))
    weights = {}
    for name, full in (("down", (32, 64)), ("gate", (64, 32)), ("up", (64, 32))):
        weights[name] = fp8_block_quantize(torch.randn(full), 16)
    down.load_shard("down.weight", weights["down"][0])
    down.load_shard("down.weight_scale_inv", weights["down"][1])
    for shard, name in enumerate(("gate", "up")):
        gate_up.load_shard(f"{name}.weight", weights[name][0], shard)
        gate_up.load_shard(f"{name}.weight_scale_inv", weights[name][1], shard)

    def dequantized(name):
        q, scale = weights[name]
        return q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(down.matrix(), dequantized("down")[:, 32:])
    assert torch.equal(gate_up.matrix(), torch.cat([dequantized("gate")[32:],
                                                    dequantized("up")[32:]]))


def _set_fused_experts(ref, dequantized: dict[str, torch.Tensor]) -> None:
    """transformers stores each layer's experts as fused [E, 2I, H] / [E, H, I] tensors."""
    with torch.no_grad():
        for li, layer in enumerate(ref.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                pre = f"model.layers.{li}.mlp.experts.{e}"
                gate_up = [dequantized[f"{pre}.{p}_proj.weight"] for p in ("gate", "up")]
                experts.gate_up_proj[e].copy_(torch.cat(gate_up))
                experts.down_proj[e].copy_(dequantized[f"{pre}.down_proj.weight"])


def test_fp8_weight_without_scale_is_refused():
    weights = [("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn))]
    with pytest.raises(ValueError, match="without scales"):
        list(dequantize_fp8_blocks(iter(weights), (2, 2)))
    bad = [("a.weight", torch.zeros(4, 4).to(torch.float8_e4m3fn)),
           ("a.weight_scale_inv", torch.ones(3, 2))]
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        list(dequantize_fp8_blocks(iter(bad), (2, 2)))


def test_unsupported_quantization_is_refused(ds, tmp_path):
    path, _ = ds
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'awq' is not supported; allowed: "
                                         r"\['fp8', 'compressed-tensors'\]"):
        load_hf_model(tmp_path / "m", torch.float32, CPU)


def test_bad_routing_config_names_what_is_allowed(ds, tmp_path):
    path, _ = ds
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["scoring_func"] = "sqrtsoftplus"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"scoring_func 'sqrtsoftplus' is not supported; "
                                         r"allowed: \['softmax', 'sigmoid'\]"):
        load_hf_model(tmp_path / "m", torch.float32, CPU)


def test_loaded_experts_are_views_of_stacked_weights(ds):
    """After loading, and after a later `.to()`, each MoE layer holds its experts' weights
    stacked once for the grouped GEMMs (`layers/fused_moe.py`), every expert's parameters
    viewing that storage."""
    path, _ = ds
    model, _ = load_hf_model(path, torch.float32, CPU)
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert moes
    before = moes[0].stacked.gate_up.clone()
    for dtype in (torch.float32, torch.float64):  # a `.to()` copies them apart: stacked again
        model.to(dtype)
        for moe in moes:
            w13, w2 = moe.stacked.gate_up, moe.stacked.down
            assert w13.shape == (8, 32, 32) and w2.shape == (8, 32, 16) and w13.dtype == dtype
            for i, expert in enumerate(moe.experts.values()):
                for part, whole in ((expert.gate_up_proj, w13), (expert.down_proj, w2)):
                    assert part.weight.untyped_storage().data_ptr() == \
                        whole.untyped_storage().data_ptr()
                    assert torch.equal(part.weight, whole[i])
    assert torch.equal(moes[0].stacked.gate_up, before.double())
