"""Cases for the grouped-GEMM MoE (`layers/fused_moe.py`), shared by the CPU interpreter tests
and tests/gpu/: the fused result against pair-by-pair eager expert MLPs, rounded where the
eager path rounds; INT4 experts against the same MLPs on `dequantize_int4`'s weights (which
tests/models/test_int4_checkpoints.py checks against the compressed-tensors format), FP8
experts on their block-scaled weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.layers.int4 import dequantize_int4
from flashtree.layers.stacked_experts import StackedExperts
from tests.helpers import fp8_block_quantize

# (tokens, experts in the model, top_k, hidden, inter, this rank's first expert and count)
CASES = [
    (1, 8, 2, 64, 32, 0, 8),  # a decode step
    (5, 8, 2, 96, 48, 0, 8),  # widths that are not multiples of the tiles
    (33, 16, 4, 64, 80, 4, 8),  # expert parallel: other ranks' pairs are left out
    (70, 4, 3, 32, 16, 0, 4),  # several blocks per expert
    (3, 16, 4, 64, 80, 4, 8),  # expert parallel with a block per pair
    (2, 8, 2, 384, 128, 0, 8),  # gate/up's input dim split (INT4: tiles wider than it)
    (2, 8, 2, 1536, 64, 0, 8),  # gate/up's input dim split over programs (INT4 too)
    (20, 8, 4, 512, 32, 0, 8),  # grouped, gate/up's input dim split over programs
    (2, 8, 2, 4096, 64, 0, 8),  # INT4 per pair on the CPU: each split's loop over 2 tiles
    (4, 16, 3, 64, 48, 4, 8),  # a top_k not a power of two, expert parallel, GEMVs per pair
]


def eager_experts(x, w13, w2, weights, ids, first):
    """sum over slots of weight * down(silu(gate(x)) * up(x)), one pair at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = F.linear(x[t : t + 1], w13[e])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(act, w2[e]).float() * weights[t, s]
            out[t] += y[0].to(x.dtype).float()
    return out.to(x.dtype)


def pack_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (int32 [rows, cols / 8], eight nibbles value + 8 lowest first; scales
    [rows, cols / group]) for symmetric INT4 in groups along cols."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // group, group)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(w.dtype)
    q = (groups / scale.float()[..., None]).round().clamp(-8, 7).long().view(rows, cols) + 8
    shifts = torch.arange(0, 32, 4, device=w.device)
    words = (q.view(rows, cols // 8, 8) << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), scale


def stack_quantized(gate_up: torch.Tensor, down: torch.Tensor, quantize
                    ) -> tuple[torch.Tensor, ...]:
    """`quantize(w) -> (weight, scale)` over each expert: (gate_up, down, their scales)."""
    (w13, s13), (w2, s2) = ([torch.stack(t) for t in zip(*(quantize(w) for w in ws))]
                            for ws in (gate_up, down))
    return w13, w2, s13, s2


def dequantized(experts: StackedExperts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights in `dtype`, dequantized as the eager path does."""
    if experts.fp8_block:
        bo, bi = experts.fp8_block
        return tuple(
            (w.float() * s.repeat_interleave(bo, 1).repeat_interleave(bi, 2)).to(dtype)
            for w, s in ((experts.gate_up, experts.gate_up_scale),
                         (experts.down, experts.down_scale)))
    if not experts.group:
        return experts.gate_up, experts.down
    assert experts.gate_up_scale is not None and experts.down_scale is not None
    return tuple(torch.stack([dequantize_int4(p, s, experts.group) for p, s in zip(w, sc)])
                 for w, sc in ((experts.gate_up, experts.gate_up_scale),
                               (experts.down, experts.down_scale)))


def check_fused_experts(case, dtype: torch.dtype, device: str, seed: int = 0,
                        group: int = 0, fp8_block: int = 0, shared: bool = False) -> None:
    """`shared`: a shared experts' output is added, after the routed sum's rounding."""
    from flashtree.layers.fused_moe import fused_experts

    n, num_experts, top_k, hidden, inter, first, local = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rand(n, hidden)
    w13, w2 = rand(local, 2 * inter, hidden, scale=hidden**-0.5), rand(local, hidden, inter,
                                                                         scale=inter**-0.5)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=gen)
    ids, weights = ids.to(device), weights.to(device)
    if group:
        experts = StackedExperts(*stack_quantized(w13, w2, lambda w: pack_int4(w, group)), group)
    elif fp8_block:
        experts = StackedExperts(*stack_quantized(
            w13, w2, lambda w: fp8_block_quantize(w, fp8_block)), fp8_block=(fp8_block,) * 2)
    else:
        experts = StackedExperts(w13, w2)
    plus = rand(n, hidden) if shared else None
    got = fused_experts(x, experts, weights, ids, first, shared=plus)
    want = eager_experts(x, *dequantized(experts, dtype), weights, ids, first)
    if plus is not None:
        want = want + plus
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), (case, dtype, err)
    assert want.float().abs().max() > 0  # some pair was this rank's
