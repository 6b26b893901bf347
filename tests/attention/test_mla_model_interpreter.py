"""A DeepSeek-V3-geometry model (MLA, tiny) through the Triton backend's latent attention, on
CPU through Triton's interpreter: prefill chunks, decode steps and a tree verify give the same
logits as the same model through the SDPA reference backend, with the eager ops between the
projections and the attention or `fused_mla.mla_prologue` (forced on, as CUDA runs it).
Skipped where triton is not installed (a failure under CI=true);
tests/gpu/test_families_start_cuda.py runs the model compiled, graphs on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/ runs the compiled kernels", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)

import tests.attention.interpreter  # noqa: E402, F401  (before triton is used)
from flashtree.attention.triton import TritonBackend  # noqa: E402
from flashtree.models import deepseek_v3  # noqa: E402
from flashtree.models.loader import load_hf_model  # noqa: E402
from flashtree.runner.forward_batch import BatchItem, Mode  # noqa: E402
from tests.helpers import PagedHarness  # noqa: E402
from tests.tiny import save_tiny_deepseek_v3  # noqa: E402


def _run(model, triton: bool) -> list[torch.Tensor]:
    h = PagedHarness(model, page_size=4)
    if triton:
        h.runner.backend = TritonBackend(h.cache, num_splits=2)
    out = []
    logits, _ = h.forward(Mode.PREFILL, [BatchItem(0, 0, [3, 17, 40, 8, 22, 5, 61], True),
                                         BatchItem(1, 0, [12, 4, 7], True)])
    out += logits
    logits, _ = h.forward(Mode.PREFILL, [BatchItem(0, 7, [9, 30, 2], True)])
    out += logits
    for step in range(3):
        logits, _ = h.forward(Mode.DECODE, [BatchItem(0, 10 + step, [11 + step]),
                                            BatchItem(1, 3 + step, [50 + step])])
        out += logits
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                           dtype=torch.bool)
    logits, _ = h.forward(Mode.VERIFY, [BatchItem(1, 6, [5, 6, 7, 8], True,
                                                  positions=[6, 7, 7, 8], visible=visible)])
    return out + logits


@pytest.mark.parametrize("prologue", [False, True])
def test_mla_model_through_triton_equals_sdpa(tmp_path, monkeypatch, prologue):
    path = save_tiny_deepseek_v3(tmp_path / "dsv3", seed=3)
    model, _ = load_hf_model(path, torch.float32, torch.device("cpu"))
    want = _run(model, triton=False)
    if prologue:
        monkeypatch.setattr(deepseek_v3, "fused_kernels_apply", lambda x: True)
    got = _run(model, triton=True)
    assert len(got) == len(want) == 10  # 2 + 1 prompts, 3 x 2 decodes, 1 tree
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        err = (g - w).abs().max().item()
        assert err < 1e-4, (i, err)
