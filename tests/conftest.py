"""Session-wide fixtures: the expensive loads of the embedded default model (about 15 s each
on a laptop CPU), and a tiny chat model with a drafter for the server and benchmark tests;
under CI=true a test skipped for a missing triton fails instead."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through its interpreter, which triton reads when first
    # imported (some test dependencies import it early).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.layers.needs_triton import TRITON_MISSING
from tests.tiny import save_reference_drafter, save_tiny_llama, save_tiny_qwen3

# The models under test are tiny (or 135M parameters at most): one intra-op thread is faster
# than two on a 2-core machine, and far faster when another process holds one of the cores.
torch.set_num_threads(1)


def _fails_in_ci(report: pytest.CollectReport | pytest.TestReport) -> bool:
    """A skip for a missing triton (module level, importorskip, skip mark or in a test) while
    CI=true: CI must run the kernel tests, so there it is a failure."""
    return (report.skipped and os.environ.get("CI", "").lower() in ("true", "1")
            and isinstance(report.longrepr, tuple)
            and report.longrepr[2] == f"Skipped: {TRITON_MISSING}")


def _fail(report: pytest.CollectReport | pytest.TestReport) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{TRITON_MISSING}, and CI=true: install the [test] extra, which pins "
                       "triton, so that CI runs the kernel tests")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if _fails_in_ci(report):
        _fail(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _fails_in_ci(report):
        _fail(report)
    return report


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


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    from flashtree.models.registry import default_model_path
    from flashtree.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny_chat")
    tok = Tokenizer.load(default_model_path())
    save_tiny_llama(path, seed=3, vocab_size=len(tok.hf), initializer_range=0.2,
                    eos_token_id=tok.eos_token_id)
    tok.hf.save_pretrained(path)
    drafter = save_reference_drafter(tmp_path_factory.mktemp("tiny_drafter"), path,
                                     block_size=4)
    return path, drafter


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A tiny Qwen3 target over 5 tokens and a random reference drafter for it (block 8),
    shared by the speculative-decoding tests."""
    root = tmp_path_factory.mktemp("pair")
    target = save_tiny_qwen3(root / "t", seed=5, vocab_size=5, initializer_range=0.3)
    drafter = save_reference_drafter(root / "d", target, seed=7, block_size=8,
                                     initializer_range=0.3)
    return target, drafter
