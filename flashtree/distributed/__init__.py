"""Tensor-parallel state. World size 1 until the TP issue wires torch.distributed in; layers
already read their rank and size from here so they shard without being rewritten."""

from __future__ import annotations

import torch


def get_tp_rank() -> int:
    return 0


def get_tp_size() -> int:
    return 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of row-parallel layers across the TP group."""
    assert get_tp_size() == 1, "tensor parallelism is not wired in yet"
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate vocab shards of the LM head along the last dimension."""
    assert get_tp_size() == 1, "tensor parallelism is not wired in yet"
    return x
