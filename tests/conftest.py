"""Session-wide fixtures for the expensive loads of the embedded default model (about 15 s each
on a laptop CPU), shared by every module that compares it against transformers."""

from __future__ import annotations

import pytest
import torch

# The models under test are tiny (or 135M parameters at most): one intra-op thread is faster
# than two on a 2-core machine, and far faster when another process holds one of the cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_llm():
    """flashtree's LLM on the default SmolLM2-135M-Instruct GGUF, fp32 on CPU."""
    from flashtree import LLM

    return LLM(model="default", device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own reading of the same GGUF file (it dequantizes with `gguf` too)."""
    from transformers import AutoModelForCausalLM

    from flashtree.models.registry import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()
