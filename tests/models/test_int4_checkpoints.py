"""Kimi K2.5/K2.6's INT4 format: a DeepSeek-V3 checkpoint whose routed experts are compressed-
tensors `pack-quantized` W4A16 (group 32, symmetric, bf16 scales), written by the compressed-
tensors package's own compressor. flashtree keeps the experts packed; they unpack to exactly
what that package's decompressor gives, and the model matches transformers holding those
decompressed weights (logits, and greedy tokens plain, DFlash and DDTree); the experts split
over tensor- and expert-parallel ranks give the single-process tokens; unsupported schemes and
quantized modules other than routed experts are refused with messages."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree import LLM, SamplingParams
from flashtree.models.loader import load_hf_model
from tests.helpers import PagedHarness, reference_logits
from tests.tiny import save_reference_drafter, save_tiny_deepseek_v3

compressors = pytest.importorskip("compressed_tensors.compressors")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

PROMPT = [3, 17, 42, 5, 88, 1, 9, 60, 33]
CPU = torch.device("cpu")
GROUP = 32
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
KIMI_QUANTIZATION = {  # as Kimi K2.5/K2.6 ship it
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
}
SCHEME = QuantizationConfig.model_validate(KIMI_QUANTIZATION).config_groups["group_0"]
PACKED = compressors.PackedQuantizationCompressor


def compress_int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's weight [out, in] as compressed-tensors writes it for SCHEME: its min-max
    group scales (in bf16, as Kimi ships them) and its `pack-quantized` compressor's
    `weight_packed`, `weight_scale` and `weight_shape`."""
    groups = w.view(w.shape[0], -1, GROUP)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    return PACKED.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, SCHEME)


def decompress_int4(compressed: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of `compress_int4`'s tensors, in float32 (the
    bf16 scales widened first, so that no product is rounded)."""
    widened = {**compressed, "weight_scale": compressed["weight_scale"].float()}
    return PACKED.decompress(widened, SCHEME)["weight"]


def write_int4(dense: Path, out: Path, quantization: dict | None = None) -> dict[str, torch.Tensor]:
    """`dense`'s checkpoint with its routed experts compressed as INT4 into `out`; returns
    compressed-tensors' decompression of each expert weight, by name."""
    tensors, dequantized = load_file(dense / "model.safetensors"), {}
    for name in [n for n in tensors if EXPERT.fullmatch(n)]:
        base = name.removesuffix(".weight")
        compressed = compress_int4(tensors.pop(name))
        dequantized[name] = decompress_int4(compressed)
        tensors.update({f"{base}.{kind}": t for kind, t in compressed.items()})
    out.mkdir(exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = quantization or KIMI_QUANTIZATION
    (out / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(dense checkpoint, INT4 checkpoint, transformers on the experts compressed-tensors
    decompresses, drafter, those experts by name); moe_intermediate_size 64 so that an expert
    split over 2 ranks keeps whole groups."""
    import transformers as tf

    root = tmp_path_factory.mktemp("int4")
    dense = save_tiny_deepseek_v3(root / "dense", seed=13, moe_intermediate_size=64)
    dequantized = write_int4(dense, root / "int4")
    ref = tf.DeepseekV3ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers fuses each layer's experts into [E, 2I, H] / [E, H, I]
        for li, layer in enumerate(ref.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            for e in range(0 if experts is None else experts.gate_up_proj.shape[0]):
                pre = f"model.layers.{li}.mlp.experts.{e}"
                experts.gate_up_proj[e].copy_(torch.cat(
                    [dequantized[f"{pre}.{p}_proj.weight"] for p in ("gate", "up")]))
                experts.down_proj[e].copy_(dequantized[f"{pre}.down_proj.weight"])
    drafter = save_reference_drafter(root / "drafter", dense, block_size=4,
                                     target_layer_ids=[0, 1])
    return dense, root / "int4", ref, drafter, dequantized


def _logits(path: Path) -> torch.Tensor:
    model, _ = load_hf_model(path, torch.float32, CPU)
    return PagedHarness(model).prefill_all_logits([PROMPT])[0][0]


def test_experts_unpack_as_compressed_tensors_decompresses_them(kimi):
    """Every routed expert's packed weights, as flashtree loaded them, unpack to exactly
    compressed-tensors' decompression (integers times bf16 scales: exact in float32)."""
    _, int4, _, _, dequantized = kimi
    model, _ = load_hf_model(int4, torch.float32, CPU)
    checked = 0
    for li, layer in enumerate(model.layers):
        for e, expert in getattr(layer.mlp, "experts", {}).items():
            pre = f"model.layers.{li}.mlp.experts.{e}"
            want = {"gate_up_proj": torch.cat([dequantized[f"{pre}.{p}_proj.weight"]
                                               for p in ("gate", "up")]),
                    "down_proj": dequantized[f"{pre}.down_proj.weight"]}
            for kind, weight in want.items():
                got = getattr(expert, kind).matrix()
                assert torch.equal(got, weight), f"{pre}.{kind}: {(got - weight).abs().max()}"
                checked += 1
    assert checked == 2 * len(dequantized) // 3 > 0


def test_logits_match_transformers_on_the_dequantized_experts(kimi):
    dense, int4, ref, _, _ = kimi
    err = (_logits(int4) - reference_logits(ref, PROMPT)).abs().max().item()
    # float32 on both sides from the same weights, summed in other orders: within about 1e-4
    # of the logit scale, which is about 3 here.
    assert err < 1e-4, err
    # The quantization really changed the experts (the comparison is not vacuous).
    assert (_logits(int4) - _logits(dense)).abs().max().item() > 1e-3


def test_experts_stay_packed(kimi):
    _, int4, _, _, _ = kimi
    model, cfg = load_hf_model(int4, torch.bfloat16, CPU)
    assert cfg.moe is not None and cfg.moe.int4_group == GROUP
    expert = model.layers[1].mlp.experts["0"]
    gate_up, down = expert.gate_up_proj, expert.down_proj
    assert not hasattr(gate_up, "weight") and not hasattr(down, "weight")
    assert gate_up.weight_packed.dtype == torch.int32 and gate_up.weight_packed.shape == (128, 4)
    assert down.weight_packed.shape == (32, 8) and down.weight_scale.shape == (32, 2)
    # Half a byte per weight plus a bf16 scale per group, against 2 bytes in bf16.
    stored = sum(p.numel() * p.element_size() for n, p in expert.named_parameters()
                 if not n.endswith("weight_shape"))
    assert stored == 3 * 64 * 32 * (0.5 + 2 / GROUP)


def test_greedy_tokens_equal_transformers_plain_dflash_and_ddtree(kimi):
    _, int4, ref, drafter, _ = kimi
    prompts, n = [PROMPT, [5, 6, 7], [60, 2, 2, 9, 41]], 10
    want = [ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for spec in ("none", "dflash", "ddtree"):
        extra = {} if spec == "none" else {"draft": str(drafter), "spec": spec}
        llm = LLM(model=str(int4), device="cpu", dtype="float32", skip_tokenizer_init=True,
                  **extra)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, spec


def test_experts_split_over_ranks_give_the_single_process_tokens(kimi):
    """TP2 slices every packed expert along its intermediate dim (whole groups per rank);
    EP2 holds half of the experts whole on each rank."""
    _, int4, _, _, _ = kimi
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for tp, ep in ((1, 1), (2, 1), (2, 2)):
        llm = LLM(model=str(int4), device="cpu", dtype="float32", skip_tokenizer_init=True,
                  tensor_parallel_size=tp, expert_parallel_size=ep)
        try:
            down = llm.model.layers[1].mlp.experts[str(0)].down_proj
            assert down.weight_packed.shape == (32, 8 // (2 if (tp, ep) == (2, 1) else 1))
            outputs.append([o.outputs[0].token_ids for o in llm.generate([PROMPT], params)])
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


@pytest.mark.parametrize("change,message", [
    ({"format": "naive-quantized"}, "format 'naive-quantized'"),
    ({"weights": {"num_bits": 8}}, "weights of 8 bits"),
    ({"weights": {"symmetric": False}}, "symmetric False"),
    ({"input_activations": {"num_bits": 8, "type": "float"}}, "quantized activations"),
])
def test_unsupported_schemes_are_refused(kimi, tmp_path, change, message):
    dense, _, _, _, _ = kimi
    q = json.loads(json.dumps(KIMI_QUANTIZATION))
    group = q["config_groups"]["group_0"]
    if "format" in change:
        q["format"] = change["format"]
    elif "weights" in change:
        group["weights"].update(change["weights"])
    else:
        group.update(change)
    write_int4(dense, tmp_path / "m", q)
    with pytest.raises(ValueError, match=re.escape(message) + ".*allowed: compressed-tensors "
                                         "format pack-quantized"):
        load_hf_model(tmp_path / "m", torch.float32, CPU)


def test_quantized_attention_is_refused(kimi, tmp_path):
    _, int4, _, _, _ = kimi
    shutil.copytree(int4, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj"
    compressed = compress_int4(tensors.pop(f"{name}.weight"))
    tensors.update({f"{name}.{kind}": t for kind, t in compressed.items()})
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"supported for routed experts only; quantized here: "
                                         r"\['model.layers.0.self_attn.q_a_proj.weight_packed'\]"):
        load_hf_model(tmp_path / "m", torch.float32, CPU)
