"""benchmarks/mla_bench.py run small on a CPU: the model section builds a DeepSeek-V3-geometry
target from random weights and times decode steps through the engine's runner; the report and
JSON carry them. Where triton is installed, the attention section's call (a latent forward over
a paged cache, a random tree) gives through the Triton kernel what it gives through SDPA, so the
GPU run cannot drift from the backend unnoticed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_mla_bench_model_section_runs_small_on_cpu(tmp_path):
    out = tmp_path / "mla.md"
    res = run_benchmark("mla_bench.py", out, "--shape", "tiny", "--device", "cpu",
                        "--model-ctx", "24", "--model-batches", "1,3", "--reps", "2")
    model = res["model"]
    assert model["graphs"] is False and "attention" not in res
    assert all(model[f"{kind}_b{b}_ms"] > 0 for kind in ("graph", "eager") for b in (1, 3))
    assert "mla_graph_speedup_b1" not in res  # no graphs on a CPU: no speedup claimed
    assert "enforce_eager" in out.read_text()


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the interpreter check: CPU with triton (tests/gpu/ covers CUDA)")
def test_attention_call_matches_sdpa_through_the_interpreter():
    import tests.attention.interpreter  # noqa: F401  (before triton is used)

    sys.path.insert(0, str(ROOT))
    from benchmarks.mla_bench import ATTENTION, latent_call
    from flashtree.attention.sdpa import SdpaBackend
    from flashtree.attention.triton import TritonBackend

    outs = [latent_call(cls, 2, 40, 8, ATTENTION["tiny"], torch.device("cpu"), torch.float32,
                        4, True) for cls in (SdpaBackend, TritonBackend)]
    (ref, read, flops), (got, _, _) = ((fn(), n, f) for fn, n, f in outs)
    assert read == 2 * 48 * 24 * 4  # batch x (context + new) x latent + rope x fp32 bytes
    assert flops == 2 * 16 * 4 * 48 * (2 * 16 + 8)  # rows x heads x keys x (scores + values)
    assert got.shape == ref.shape == (16, 4, 16)
    assert (got - ref).abs().max().item() < 1e-4
