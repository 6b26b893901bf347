"""The grouped-GEMM MoE kernels compiled on CUDA: the interpreter cases of tests/layers/ (fp32,
bf16, dense, INT4 and FP8 experts), and a CUDA graph captured over routing A and replayed on routing
B (other experts, other weights, the same batch size) gives B's result, so nothing about the
routing is baked in and no host sync sits in the forward. Skips without CUDA or triton."""

from __future__ import annotations

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree.layers.fused_moe import fused_experts  # noqa: E402
from flashtree.layers.stacked_experts import StackedExperts  # noqa: E402
from tests.layers.moe_cases import (  # noqa: E402
    CASES,
    check_fused_experts,
    eager_experts,
    pack_int4,
    stack_quantized,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fused_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[4] % 16 == 0])
def test_int4_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda", group=16)


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])  # per pair, EP, grouped
def test_shared_experts_added_on_cuda(case, group):
    check_fused_experts(case, torch.bfloat16, "cuda", group=group, shared=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [c for c in CASES if c[3] % 16 == 0 and c[4] % 16 == 0])
def test_fp8_experts_match_eager_on_cuda(case, dtype):
    check_fused_experts(case, dtype, "cuda", fp8_block=16)


def test_graph_replay_follows_new_routing():
    n, experts, top_k, hidden, inter = 6, 8, 2, 64, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 8
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / 6

    def routing():
        ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k]
                           for _ in range(n)])
        return ids, torch.rand(n, top_k, device="cuda", generator=gen)

    ids, weights = routing()
    stacked = StackedExperts(w13, w2)
    fused_experts(x, stacked, weights, ids, 0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, stacked, weights, ids, 0)
    new_ids, new_weights = routing()
    assert not torch.equal(new_ids, ids)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    want = eager_experts(x, w13, w2, weights, ids, 0)
    assert (out - want).abs().max().item() < 1e-4


def test_packed_unpack_equals_dequantize_int4_exactly():
    """`int4_unpack.scaled_planes` on every nibble value and on scales across bf16's range
    gives `dequantize_int4`'s bf16 weights bit for bit (one rounding of (v - 8) * scale)."""
    import triton
    import triton.language as tl

    from flashtree.layers.int4 import dequantize_int4
    from flashtree.layers.int4_unpack import scaled_planes

    @triton.jit
    def planes_kernel(w_ptr, s_ptr, out_ptr, cols, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        words = tl.load(w_ptr + r * cols + c)
        scale = tl.load(s_ptr + r * (cols * 8 // GROUP) + c * 8 // GROUP)
        planes = scaled_planes(words, scale)
        for j in tl.static_range(8):
            tl.store(out_ptr + r * cols * 8 + c * 8 + j, planes[j])

    rows, cols, group = 64, 256, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (rows, cols), device="cuda", generator=gen,
                          dtype=torch.int32)
    words[0, 0::2] = 0x76543210  # row 0: all 16 values, in both words of each pair
    words[0, 1::2] = 0xFEDCBA98 - 2**32  # (as int32)
    scale = (torch.randn(rows, cols * 8 // group, device="cuda", generator=gen)
             * torch.logspace(-6, 3, rows, device="cuda")[:, None]).bfloat16()
    out = torch.empty(rows, cols * 8, device="cuda", dtype=torch.bfloat16)
    planes_kernel[(rows,)](words, scale, out, cols, GROUP=group, BLOCK=cols)
    assert torch.equal(out.view(torch.int16), dequantize_int4(words, scale, group).view(
        torch.int16))


@pytest.mark.parametrize("case", [CASES[3], CASES[7], (40, 16, 4, 1536, 64, 0, 16)])
def test_packed_unpack_gives_the_scalar_unpacks_result(case, monkeypatch):
    """The grouped INT4 tiles with `int4_unpack`'s PTX and with the scalar unpack feed their
    dots the same bf16 weights, so their results are equal bit for bit (input dim split or
    not)."""
    from flashtree.layers import fused_moe

    n, num_experts, top_k, hidden, inter, first, local = case
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, hidden, generator=gen).bfloat16().cuda()
    w13, w2 = torch.randn(local, 2 * inter, hidden, generator=gen), torch.randn(
        local, hidden, inter, generator=gen)
    experts = StackedExperts(*stack_quantized(
        w13.bfloat16().cuda(), w2.bfloat16().cuda(), lambda w: pack_int4(w, 16)), 16)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=gen)
    assert fused_moe.packed_unpack_applies(x, experts)
    packed = fused_experts(x, experts, weights.cuda(), ids.cuda(), first)
    monkeypatch.setattr(fused_moe, "packed_unpack_applies", lambda *_: False)
    assert torch.equal(packed, fused_experts(x, experts, weights.cuda(), ids.cuda(), first))
