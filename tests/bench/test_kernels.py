"""benchmarks/kernels.py: the whole script small on a CPU (the SDPA reference and the torch tree
build timed; Triton, the GEMV and the tree kernel need CUDA), and, where triton is installed,
each timed call (a paged GQA layer call, MLA's latent forward over a random tree) gives through
the Triton kernel what it gives through SDPA, so the GPU run cannot drift from the backends
unnoticed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.bench.scripts import check_goals, run_script


def test_kernels_run_small_on_cpu(tmp_path):
    out = tmp_path / "k.md"
    data = run_script("kernels", out, "--device", "cpu", "--mla-shape", "tiny-mla",
                      "--batches", "1,2", "--contexts", "24", "--mla-contexts", "24",
                      "--mla-batches", "1,2", "--budgets", "3,63", "--reps", "2")
    rows = data["attention"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        (m, b) for m in ("decode", "chain", "tree") for b in (1, 2)]
    assert [r["tokens"] for r in rows] == [1, 1, 16, 16, 64, 64]
    assert all(r["sdpa_ms"] > 0 and "triton_ms" not in r for r in rows)
    mla = data["mla"]
    assert mla["backend"] == "SdpaBackend" and mla["shape"] == [4, 16, 8]
    assert [(r["step"], r["batch"]) for r in mla["rows"]] == [
        ("decode", 1), ("decode", 2), ("verify 64", 1)]
    assert all(r["ms"] > 0 and r["tbps"] > 0 for r in mla["rows"])
    assert "gemv" not in data and data["mla_decode_tbps_16k_b32"] is None
    tree = data["tree"]  # the torch build alone off CUDA
    assert [(r["rows"], r["budget"]) for r in tree] == [(1, 3), (1, 63), (2, 3), (2, 63)]
    assert all(r["torch_ms"] > 0 and "kernel_ms" not in r for r in tree)
    assert "| 2 | 63 |" in out.read_text()
    check_goals(out, data, ("mla_decode_tbps_16k_b32", "mla_verify64_over_decode"))


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the interpreter check: CPU with triton (tests/gpu/ covers CUDA)")
@pytest.mark.parametrize("tree", [False, True])
def test_timed_calls_match_sdpa_through_the_interpreter(tree):
    import tests.attention.interpreter  # noqa: F401  (before triton is used)
    from benchmarks.kernels import gqa_call, latent_call
    from flashtree.attention.sdpa import SdpaBackend
    from flashtree.attention.triton import TritonBackend

    cpu = torch.device("cpu")
    (ref, read), (got, _) = (gqa_call(cls, 2, 40, 8, 4, 2, 16, tree, cpu, torch.float32, 4)
                             for cls in (SdpaBackend, TritonBackend))
    assert read == 2 * 2 * 40 * 2 * 16 * 4  # K and V x batch x context x KV heads x dim x fp32
    # float32 attention over 48 keys: the kernels sum in different orders, about 1e-6 apart.
    assert (got() - ref()).abs().max().item() < 1e-4
    outs = [latent_call(cls, 2, 40, 8, (4, 16, 8), tree, cpu, torch.float32, 4)
            for cls in (SdpaBackend, TritonBackend)]
    (ref, read, flops), (got, _, _) = ((fn(), n, f) for fn, n, f in outs)
    assert read == 2 * 48 * 24 * 4  # batch x (context + new) x latent + rope x fp32 bytes
    assert flops == 2 * 16 * 4 * 48 * (2 * 16 + 8)  # rows x heads x keys x (scores + values)
    assert got.shape == ref.shape == (16, 4, 16)
    assert (got - ref).abs().max().item() < 1e-4
