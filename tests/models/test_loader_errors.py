"""Bad checkpoints fail at load time with an exception that names what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree import LLM
from flashtree.models.config import SUPPORTED_ARCHITECTURES
from flashtree.models.loader import load_hf_model
from tests.helpers import save_checkpoint

CPU = torch.device("cpu")


def _load(path: Path):
    return load_hf_model(path, torch.float32, CPU)


@pytest.fixture(scope="module")
def good_llama(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def good_qwen2(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", num_hidden_layers=2)


def _copy_with_tensors(src: Path, dst: Path, edit) -> Path:
    """Copy the single-file checkpoint `src` to `dst`, passing its tensors through `edit`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_good_checkpoint_loads(good_llama, good_qwen2):
    # The baseline for the edits below: unedited copies load.
    _load(_copy_with_tensors(good_llama, good_llama.parent / "copy", lambda t: None))
    _load(good_qwen2)


@pytest.mark.parametrize(
    "fixture, name",
    [
        ("good_llama", "model.layers.1.mlp.down_proj.weight"),
        ("good_llama", "model.layers.0.self_attn.k_proj.weight"),  # one part of stacked qkv
        ("good_llama", "model.layers.1.post_attention_layernorm.weight"),
        ("good_llama", "model.norm.weight"),
        ("good_llama", "model.embed_tokens.weight"),
        ("good_llama", "lm_head.weight"),  # untied: the head is required
        ("good_qwen2", "model.layers.0.self_attn.v_proj.bias"),
    ],
)
def test_missing_tensor_is_named(request, tmp_path, fixture, name):
    src = request.getfixturevalue(fixture)
    path = _copy_with_tensors(src, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as err:
        _load(path)
    # The checkpoint's own name for the tensor, not an internal one.
    assert re.search(rf"'{re.escape(name)}'", str(err.value)), str(err.value)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.rotary_emb.inv_freq", (4,)),
        ("model.layers.0.self_attn.o_proj.bias", (32,)),  # Llama without attention_bias
        ("model.layers.2.mlp.up_proj.weight", (64, 32)),  # a layer the config does not have
        ("model.layers.0.mlp.experts.0.weight", (64, 32)),
        ("model.vision_tower.weight", (8, 8)),
    ],
)
def test_extra_unknown_tensor_is_named(good_llama, tmp_path, name, shape):
    def add(tensors):
        tensors[name] = torch.zeros(shape)

    path = _copy_with_tensors(good_llama, tmp_path / "ckpt", add)
    with pytest.raises(ValueError, match="does not know") as err:
        _load(path)
    assert f"'{name}'" in str(err.value)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (32, 32)),  # too many rows (expects 16)
        ("model.layers.0.self_attn.k_proj.weight", (8, 32)),  # too few rows
        ("model.layers.1.mlp.gate_proj.weight", (64, 48)),
        ("model.layers.1.mlp.down_proj.weight", (32, 80)),  # too many columns (expects 64)
        ("model.layers.0.self_attn.o_proj.weight", (16, 32)),
        ("model.embed_tokens.weight", (95, 32)),
        ("model.norm.weight", (33,)),
    ],
)
def test_wrong_shape_is_named(good_llama, tmp_path, name, shape):
    def reshape(tensors):
        tensors[name] = torch.zeros(shape)

    path = _copy_with_tensors(good_llama, tmp_path / "ckpt", reshape)
    with pytest.raises(ValueError) as err:
        _load(path)
    message = str(err.value)
    assert name in message and str(tuple(shape)) in message, message


def test_unknown_architecture_is_named_with_the_allowed_ones(good_llama, tmp_path):
    cfg = json.loads((good_llama / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes((good_llama / "model.safetensors").read_bytes())
    for load in (_load, lambda p: LLM(model=str(p), device="cpu", skip_tokenizer_init=True)):
        with pytest.raises(ValueError) as err:
            load(path)
        message = str(err.value)
        assert "GPT2LMHeadModel" in message
        assert all(arch in message for arch in SUPPORTED_ARCHITECTURES), message


def test_nonexistent_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        _load(missing)
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        LLM(model=str(missing), device="cpu", skip_tokenizer_init=True)
    assert str(missing) in str(err.value)


def test_directory_without_weights(good_llama, tmp_path):
    (tmp_path / "config.json").write_text((good_llama / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        _load(tmp_path)


def test_index_listing_a_missing_shard(tmp_path):
    path = save_checkpoint(tmp_path / "sharded", "llama", num_hidden_layers=2,
                           max_shard_size=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(shard)):
        _load(path)
