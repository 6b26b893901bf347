"""The real tiny target and drafter captured in CUDA graphs (Triton attention, static padded
buffers poisoned before every copy) replay the eager SDPA forward's logits and features for
decode, chain verify, tree verify, prompt-chunk and draft batches, three requests padded into a
bucket of four. Skips without CUDA or triton."""

from __future__ import annotations

import random

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

# Skip before importing triton: on CPU the interpreter tests must import it first.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)
model_cases = pytest.importorskip("tests.graphs.model_cases")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return model_cases.make_engine(tmp_path_factory.mktemp("graph_model_cuda"), "cuda")


@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree", "prefill"])
def test_target_graph_equals_eager_on_cuda(engine, mode):
    for seed in range(3):
        model_cases.check_target(engine, mode, random.Random(f"{mode}{seed}"))


def test_draft_graph_equals_eager_on_cuda(engine):
    model_cases.check_draft(engine)
