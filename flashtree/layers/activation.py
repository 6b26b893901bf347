"""SiLU-gated linear unit activation (SwiGLU's middle step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.layers import fused_kernels_apply


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [n, 2 * inter] (gate first, as the stacked gate_up projections produce it) ->
    silu(gate) * up: [n, inter]; one kernel on CUDA."""
    if fused_kernels_apply(gate_up):
        from flashtree.layers.fused import silu_mul as fused_silu_mul

        return fused_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
