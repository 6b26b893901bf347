from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.layers import fused_kernels_apply


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the HF reference does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if loaded.shape != self.weight.shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(self.weight.shape)}"
            )
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        if fused_kernels_apply(x):
            from flashtree.layers.fused import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        if x.dtype == self.weight.dtype == torch.float32:  # one op, the same bits
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [n, dim] -> (norm(s), s) for s = x + residual in x's dtype; one kernel
        on CUDA."""
        if fused_kernels_apply(x):
            from flashtree.layers.fused import rms_norm

            normed, total = rms_norm(x, self.weight, self.eps, residual)
            assert total is not None
            return normed, total
        total = x + residual
        return self.forward(total), total
