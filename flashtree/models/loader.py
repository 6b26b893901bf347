"""Build a target model from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from flashtree.layers.int4 import int4_group_size
from flashtree.models.config import QUANT_METHODS, ModelConfig
from flashtree.models.llama import DecoderModel


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory"
        )
    cfg = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            cfg["eos_token_id"] = gen["eos_token_id"]
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index.name} lists shards that do not exist: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def model_class(cfg: ModelConfig) -> type[DecoderModel]:
    if cfg.architecture == "Qwen3MoeForCausalLM":
        from flashtree.models.qwen3_moe import Qwen3MoeModel

        return Qwen3MoeModel
    if cfg.architecture == "DeepseekV3ForCausalLM":
        from flashtree.models.deepseek_v3 import DeepseekV3Model

        return DeepseekV3Model
    return DecoderModel


ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def dequantize_fp8_blocks(
    weights: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int],
    keep: re.Pattern | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek FP8 checkpoints: each float8 `X.weight` [out, in] comes with
    `X.weight_scale_inv` [ceil(out / bo), ceil(in / bi)] (one float scale per block); the real
    weight is fp8 * scale. Dequantized here, at load (float32 out; the model casts it), but for
    weights whose names `keep` matches: those pass on as they are, scale and all. The pair may
    sit in different shards: whichever comes first waits for the other."""
    pending: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    bo, bi = block
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            base = name.removesuffix("_scale_inv")
            if base not in pending:
                scales[base] = tensor
                continue
            name, tensor, scale = base, pending.pop(base), tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name not in scales:
                pending[name] = tensor
                continue
            scale = scales.pop(name)
        else:
            yield name, tensor
            continue
        out, inp = tensor.shape
        expected = (-(-out // bo), -(-inp // bi))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{name}_scale_inv has shape {tuple(scale.shape)}, expected "
                             f"{expected} for a {(out, inp)} weight in {bo}x{bi} blocks")
        if keep is not None and keep.fullmatch(name):
            yield name, tensor
            yield f"{name}_scale_inv", scale
            continue
        full = scale.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
        yield name, tensor.float() * full
    left = sorted(pending) + [f"{n}_scale_inv" for n in sorted(scales)]
    if left:
        raise ValueError(f"FP8 checkpoint has weights without scales or scales without "
                         f"weights: {left[:5]}")


def build_model(
    cfg: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
    device: torch.device,
) -> DecoderModel:
    if cfg.quantization == "fp8":
        # Routed experts (most of a MoE model's bytes) stay FP8; the rest is dequantized.
        keep = None if cfg.moe is None else ROUTED_EXPERT
        if cfg.moe is not None:
            cfg = replace(cfg, moe=replace(cfg.moe, fp8_block=cfg.quant_block))
        weights = dequantize_fp8_blocks(weights, cfg.quant_block, keep)
    elif cfg.quantization == "compressed-tensors":
        if cfg.moe is None:
            raise ValueError("INT4 compressed-tensors weights are supported for the routed "
                             "experts of MoE models; this model has none")
        cfg = replace(cfg, moe=replace(cfg.moe, int4_group=int4_group_size(cfg.quant_config)))
    elif cfg.quantization is not None:
        raise ValueError(
            f"checkpoint quantization {cfg.quantization!r} is not supported; allowed: "
            f"{list(QUANT_METHODS)} (block FP8, dequantized at load; compressed-tensors INT4 "
            f"routed experts, kept packed) or unquantized weights"
        )
    with torch.device(device):
        model = model_class(cfg)(cfg)
    model.to(dtype)
    model.load_weights(weights)
    return model.eval()


def load_hf_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device
) -> tuple[DecoderModel, ModelConfig]:
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    model = build_model(cfg, iter_safetensors(safetensors_files(model_dir)), dtype, device)
    return model, model.cfg  # the loader may have filled in quantization details
