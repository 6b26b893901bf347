"""The real target and drafter run through the graph runner (static padded buffers, poisoned
before every copy, Triton attention under the CPU interpreter) give the eager SDPA forward's
logits and features for decode, chain verify, tree verify, prompt-chunk and draft batches.
Skipped without triton; where CUDA exists tests/gpu/ captures the same forwards in CUDA graphs."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ captures these forwards", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from tests.graphs.model_cases import check_draft, check_target, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(tmp_path_factory.mktemp("graph_model"), "cpu")


@pytest.mark.parametrize("mode", ["decode", "verify_chain", "verify_tree", "prefill"])
def test_target_graph_equals_eager(engine, mode):
    check_target(engine, mode, random.Random(mode))


def test_draft_graph_equals_eager(engine):
    check_draft(engine)
