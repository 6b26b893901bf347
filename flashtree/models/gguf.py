"""GGUF checkpoints through the `gguf` package: metadata -> ModelConfig, tensors dequantized to
float at load (any type `gguf.quants.dequantize` supports: Q4_0/Q4_1/Q8_0/K-quants/F16/F32).

Parsing GGUF metadata and dequantizing take tens of seconds on a small CPU, so the first load
also writes the result as a Hugging Face directory (config.json + float32 safetensors + the
converted tokenizer) under the cache folder; later loads read that directory. An int4 load
(`pack_gguf_int4`) caches its packed weights there too."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from flashtree.models.config import ModelConfig

# GGUF architecture -> HF architecture. Only Llama is exercised against transformers' own GGUF
# loader; other architectures are refused rather than loaded on an unverified name mapping.
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_CACHE_FORMAT_VERSION = 1

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_cache_dir(path: Path) -> Path:
    """Cache folder of one GGUF file, keyed by its name, size and modification time."""
    root = Path(os.environ.get("FLASHTREE_CACHE", Path.home() / ".cache" / "flashtree"))
    stat = path.stat()
    # The version changes whenever the conversion (or the packed int4 form) does, so stale
    # caches are never read.
    key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_FORMAT_VERSION}"
    return root / "gguf" / key


def gguf_hf_config(reader) -> dict:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; allowed: {list(_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": None if eos is None else int(eos),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    ModelConfig.from_hf(hf)  # validate before any tensor is read
    return hf


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rotary halves of each q/k head; restore HF's rotate-half
    row order. w: [heads * head_dim, in]."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor of the file."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
            hf = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
        elif base in _GLOBAL_TENSORS:
            hf = f"{_GLOBAL_TENSORS[base]}.{kind}"
        else:
            hf = t.name  # reported as unknown by the model loader
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # owned, writable
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGML lists dims inner-first
        if base.endswith("attn_q"):
            w = _unpermute_rope_rows(w, cfg.num_heads)
        elif base.endswith("attn_k"):
            w = _unpermute_rope_rows(w, cfg.num_kv_heads)
        yield hf, torch.from_numpy(np.ascontiguousarray(w))


def pack_gguf_int4(model, path: Path) -> int:
    """Replace the float weights of `model`'s linear layers (loaded from the GGUF file at
    `path`) by the file's Q4_0 / Q4_1 codes, repacked for the CPU int4 kernel; layers stacked
    from several tensors (q/k/v, gate/up) are packed when all of them are 4-bit. The token
    embedding and LM head are packed too when they are Q8_0, Q4_0 or Q4_1. Returns the number
    of linear layers packed. Reading and checking the file's blocks takes seconds, so the
    packed form is cached beside the float conversion (per PyTorch version: its packed layout
    is private) and later loads read that."""
    from safetensors.torch import load_file, save_file

    cached = packed_cache_file(path)
    if cached.is_file():
        tensors = load_file(str(cached))
    else:
        tensors = _pack_from_file(model, path)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(cached)  # atomic: a half-written cache is never read
        except OSError as e:
            warnings.warn(f"could not cache the packed weights in {cached.parent}: {e}",
                          stacklevel=2)
    return _install_packed(model, tensors)


def packed_cache_file(path: Path) -> Path:
    """Where `pack_gguf_int4` caches the packed weights of the GGUF file at `path`: a folder of
    its own, since the float conversion's loader reads every safetensors file beside it."""
    return gguf_cache_dir(path) / "int4" / f"torch-{torch.__version__}.safetensors"


def _install_packed(model, tensors: dict[str, torch.Tensor]) -> int:
    """`_pack_from_file`'s tensors in place of `model`'s float weights (a tied LM head takes
    the embedding's); returns the number of linear layers packed."""
    from flashtree.layers.int4_cpu import Int4Weight, Q8Weight

    packed = 0
    for name, module in model.named_modules():
        if hasattr(module, "int4") and f"{name}.packed" in tensors:
            module.int4, module.weight = Int4Weight.from_state(tensors, name), None
            packed += 1
    for name in ("embed_tokens", "lm_head"):
        if f"{name}.high.packed" in tensors:
            weight = Q8Weight.from_state(tensors, name)
        elif f"{name}.packed" in tensors:
            weight = Int4Weight.from_state(tensors, name)
        else:
            continue
        module = getattr(model, name)
        module.packed, module.weight = weight, None
    if model.cfg.tie_word_embeddings and model.embed_tokens.packed is not None:
        model.lm_head.packed, model.lm_head.weight = model.embed_tokens.packed, None
    return packed


def _pack_from_file(model, path: Path) -> dict[str, torch.Tensor]:
    """The packed weights of `pack_gguf_int4`, from the file's blocks, by module name, each
    checked against the float weight `model` loaded from the same file."""
    from gguf import GGMLQuantizationType, GGUFReader

    from flashtree.layers.int4_cpu import (
        Q8Weight,
        check_layout,
        gguf_q4_blocks,
        gguf_q8_blocks,
    )

    cfg = model.cfg
    q4 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
    blocks: dict[str, tuple[np.ndarray, ...]] = {}  # HF module path -> codes, scales, zeros
    state: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(path)).tensors:
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if base in ("token_embd", "output") and kind == "weight":
            check_layout()  # their rows are read back from the packed layout
            if t.tensor_type == GGMLQuantizationType.Q8_0:
                codes, scales = (torch.from_numpy(a) for a in gguf_q8_blocks(np.asarray(t.data)))
                _check_exact(base, codes.float().view(*scales.shape, -1) * scales[..., None],
                             _float_weight(model, base))
                state.update(Q8Weight(codes, scales).state(_HEAD_MODULES[base]))
            elif t.tensor_type in q4:
                arrays = gguf_q4_blocks(np.asarray(t.data), t.tensor_type == q4[1])
                weight = _packed_q4(*(torch.from_numpy(a) for a in arrays), base,
                                    _float_weight(model, base))
                state.update(weight.state(_HEAD_MODULES[base]))
            continue
        if t.tensor_type not in q4 or kind != "weight" or len(parts) != 3 or (
                parts[0] != "blk" or parts[2] not in _LAYER_TENSORS):
            continue
        arrays = gguf_q4_blocks(np.asarray(t.data), t.tensor_type == q4[1])
        if parts[2] in ("attn_q", "attn_k"):
            heads_of = cfg.num_heads if parts[2] == "attn_q" else cfg.num_kv_heads
            arrays = tuple(_unpermute_rope_rows(a, heads_of) for a in arrays)
        blocks[f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"] = arrays
    sources: dict[str, list[str]] = {}  # stacked target -> its HF suffixes in order
    for suffix, (target, _) in sorted(model.stacked.items(), key=lambda kv: kv[1][1]):
        sources.setdefault(target, []).append(suffix)
    for name, module in model.named_modules():
        if not hasattr(module, "int4"):
            continue
        target = next((t for t in sources if name.endswith(t)), None)
        parts = [name] if target is None else [name[: -len(target)] + s for s in sources[target]]
        if not all(p in blocks for p in parts):
            continue
        codes, scales, zeros = (torch.from_numpy(np.concatenate([blocks[p][i] for p in parts]))
                                for i in range(3))
        state.update(_packed_q4(codes, scales, zeros, name, module.weight).state(name))
    return state


_HEAD_MODULES = {"token_embd": "embed_tokens", "output": "lm_head"}  # GGUF name -> module


def _float_weight(model, base: str) -> torch.Tensor:
    """The float weight loaded for GGUF tensor `base` (token_embd or output)."""
    return model.embed_tokens.weight if base == "token_embd" else model.lm_head.weight


def _packed_q4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, name: str,
               loaded: torch.Tensor):
    from flashtree.layers.int4_cpu import Int4Weight

    _check_exact(name, (codes.view(*scales.shape, -1) - 8) * scales[..., None] + zeros[..., None],
                 loaded)
    return Int4Weight(codes, scales, zeros)


def _check_exact(name: str, dequantized: torch.Tensor, loaded: torch.Tensor) -> None:
    """The float weight loaded from the same file is the codes' exact dequantization."""
    assert torch.allclose(dequantized.view_as(loaded), loaded, rtol=1e-6, atol=1e-6), (
        f"{name}: GGUF codes do not match the loaded weight")


def load_gguf_model(path: Path, dtype: torch.dtype, device: torch.device):
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from flashtree.models.loader import build_model, load_hf_model

    cache = gguf_cache_dir(path)
    if (cache / "model.safetensors").is_file():
        return load_hf_model(cache, dtype, device)
    reader = GGUFReader(str(path))
    hf_config = gguf_hf_config(reader)
    cfg = ModelConfig.from_hf(hf_config)
    tensors = dict(gguf_tensors(reader, cfg))
    model = build_model(cfg, iter(tensors.items()), dtype, device)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "config.json").write_text(json.dumps(hf_config, indent=2))
        tmp = cache / "model.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.rename(cache / "model.safetensors")  # atomic: a half-written cache is never read
    except OSError as e:
        warnings.warn(f"could not cache the converted GGUF in {cache}: {e}", stacklevel=2)
    return model, cfg
