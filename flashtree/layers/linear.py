"""Megatron-style linear layers. Each parameter carries a `weight_loader` that copies this
rank's shard of a full checkpoint tensor, so checkpoint loading never needs to know the layout."""

from __future__ import annotations

import torch
from torch import nn

from flashtree.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from flashtree.layers import dense
from flashtree.layers.int4_cpu import Int4Weight


def _copy_checked(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"tensor {name} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def _check_full_shape(loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    """A checkpoint tensor must have the full (unsharded) shape before this rank narrows it;
    narrowing first would silently drop extra rows/columns or fail on missing ones."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split along the output dimension; optionally several logical
    outputs stacked in one matrix (q/k/v or gate/up), each sharded on its own. A logical output
    with `replicas[i] > 1` is split into tp / replicas[i] parts only, each held by that many
    consecutive ranks (GQA with fewer KV heads than ranks)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 replicas: list[int] | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        self.replicas = replicas or [1] * len(out_sizes)
        parts = [tp // r for r in self.replicas]
        assert all(tp % r == 0 for r in self.replicas), f"replicas {self.replicas}, tp={tp}"
        assert all(s % n == 0 for s, n in zip(out_sizes, parts)), (
            f"{out_sizes} not divisible into {parts} parts (tp={tp})")
        self.shard_sizes = [s // n for s, n in zip(out_sizes, parts)]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(out_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.int4: Int4Weight | None = None  # replaces weight on the CPU (gguf.pack_gguf_int4)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's rows of logical output `shard` from the full tensor `loaded`."""
        size, offset = self.shard_sizes[shard], self.shard_offsets[shard]
        replicas = self.replicas[shard]
        target = self.weight if loaded.dim() == 2 else self.bias
        assert target is not None, f"{name}: checkpoint has a bias this layer does not"
        _check_full_shape(loaded, (size * get_tp_size() // replicas, *target.shape[1:]), name)
        rows = loaded.narrow(0, get_tp_rank() // replicas * size, size)
        _copy_checked(target.data.narrow(0, offset, size), rows, name)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x W^T + b; with `norm` (an RMSNorm), norm(x) W^T + b (one launch where it can)."""
        if self.int4 is not None:
            y = self.int4.matmul(x if norm is None else norm(x))
            return y if self.bias is None else y + self.bias
        return dense(x, self.weight, self.bias, norm)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b with W split along the input dimension.
    `reduce=False` returns this rank's partial sum (the caller reduces once for several layers,
    e.g. a MoE block's shared and routed experts); it must then have no bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: bool = True) -> None:
        super().__init__()
        assert reduce or not bias, "a partial-sum (reduce=False) layer cannot add a bias"
        self.reduce = reduce
        tp = get_tp_size()
        assert in_features % tp == 0, f"in_features {in_features} not divisible by tp={tp}"
        self.in_shard = in_features // tp
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.int4: Int4Weight | None = None  # replaces weight on the CPU (gguf.pack_gguf_int4)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if loaded.dim() == 1:
            assert self.bias is not None, f"{name}: checkpoint has a bias this layer does not"
            _copy_checked(self.bias, loaded, name)
            return
        _check_full_shape(loaded, (self.weight.shape[0], self.in_shard * get_tp_size()), name)
        cols = loaded.narrow(1, get_tp_rank() * self.in_shard, self.in_shard)
        _copy_checked(self.weight, cols, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.weight) if self.int4 is None else self.int4.matmul(x)
        if not self.reduce:
            return y
        y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias
