"""Programmatic dependent launch (`pdl.py`): a chain of the kernels that take part (the
RMSNorm, the GEMV, SiLU-and-multiply, the router), each reading the one before's output,
gives the same bits launched with PDL and without, eagerly and replayed from a CUDA graph
(where the launches become programmatic edges). Skips without a Hopper GPU or triton."""

from __future__ import annotations

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a Hopper (sm_90) or later GPU", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree.layers.config import MoEConfig  # noqa: E402
from flashtree.layers.fused import rms_norm, silu_mul  # noqa: E402
from flashtree.layers.gemv import gemv  # noqa: E402
from flashtree.layers.moe_router import route  # noqa: E402


def chain(x, residual, norm_w, w_up, w_down, router_w, bias, cfg):
    h, total = rms_norm(x, norm_w, 1e-6, residual)
    up = gemv(h, w_up)  # waits for the norm, whose output it reads
    act = silu_mul(up)
    y = gemv(act, w_down)
    weights, ids = route(gemv(h, router_w), bias, cfg)
    return y, total, weights, ids


@torch.inference_mode()
def test_pdl_chain_gives_the_same_bits_eager_and_replayed(monkeypatch):
    gen = torch.Generator("cuda").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x, residual, norm_w = rand(1, 7168), rand(1, 7168), rand(7168)
    w_up, w_down = rand(512, 7168) / 85, rand(7168, 256) / 16
    router_w, bias = rand(384, 7168, dtype=torch.float32) / 85, rand(384, dtype=torch.float32)
    cfg = MoEConfig(num_experts=384, top_k=8, intermediate_size=2048, sparse_layers=(True,),
                    scoring_func="sigmoid",
                    topk_method="noaux_tc", routed_scaling_factor=2.827, norm_topk_prob=True)
    args = (x, residual, norm_w, w_up, w_down, router_w, bias, cfg)
    for use in (False, True):
        monkeypatch.setattr("flashtree.pdl.pdl", lambda device, use=use: use)
        if not use:
            want = chain(*args)
            continue
        eager = chain(*args)
        graph = torch.cuda.CUDAGraph()
        chain(*args)  # compiled before capture
        with torch.cuda.graph(graph):
            replayed = chain(*args)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        for got in (eager, replayed):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
