"""Build a target model from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flashtree.config import ModelConfig
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


def build_model(
    cfg: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
    device: torch.device,
) -> DecoderModel:
    with torch.device(device):
        model = DecoderModel(cfg)
    model.to(dtype)
    model.load_weights(weights)
    return model.eval()


def load_hf_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device
) -> tuple[DecoderModel, ModelConfig]:
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    model = build_model(cfg, iter_safetensors(safetensors_files(model_dir)), dtype, device)
    return model, cfg
