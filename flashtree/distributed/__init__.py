"""Tensor-parallel state over torch.distributed (gloo on CPU, NCCL on GPUs). Layers read their
rank and the group size from here when they are built, so one model class serves every TP size;
with no group (the default) everything is rank 0 of 1 and the collectives are no-ops."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_RANK, _SIZE = 0, 1
_EP_SIZE = 1  # expert-parallel size: divides the TP size (SGLang's --ep convention)


def init_tp(rank: int, size: int, backend: str, init_method: str, timeout_s: float = 300) -> None:
    """Join the TP group (one process per rank). `init_method` is a torch.distributed URL:
    tcp://host:port, or env:// under torchrun."""
    global _RANK, _SIZE
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _RANK, _SIZE = rank, size


def destroy_tp() -> None:
    global _RANK, _SIZE, _EP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _EP_SIZE = 0, 1, 1
_EP_SIZE = 1  # expert-parallel size: divides the TP size (SGLang's --ep convention)


def set_ep_size(ep: int) -> None:
    """Split routed experts over `ep` groups of the TP ranks (set before building a model).
    ep == tp: each rank holds num_experts / ep whole experts; 1 < ep < tp: each expert is also
    sharded over tp / ep ranks along its intermediate dim; ep == 1: pure TP inside experts."""
    global _EP_SIZE
    if ep < 1 or _SIZE % ep:
        raise ValueError(f"expert parallel size {ep} must be >= 1 and divide the tensor "
                         f"parallel size {_SIZE} (experts are split across the TP ranks)")
    _EP_SIZE = ep


def get_ep_size() -> int:
    return _EP_SIZE


def get_ep_rank() -> int:
    """This rank's expert group: ranks [g * tp/ep, (g + 1) * tp/ep) hold the same experts."""
    return _RANK // (_SIZE // _EP_SIZE)


def get_moe_tp() -> tuple[int, int]:
    """(rank, size) of the intermediate-dim split inside one expert: tp / ep parts."""
    size = _SIZE // _EP_SIZE
    return _RANK % size, size


def get_tp_rank() -> int:
    return _RANK


def get_tp_size() -> int:
    return _SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of row-parallel layers across the TP group."""
    if _SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[*shape] on every rank -> [tp, *shape] (rank order)."""
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' slices (e.g. vocab shards of the LM head) along the last dim."""
    if _SIZE == 1:
        return x
    return torch.cat(list(tp_all_gather(x)), dim=-1)


def tp_broadcast_object(obj=None):
    """Rank 0's `obj` on every rank (the driver's per-step commands); `obj` without a group."""
    if _SIZE == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tp_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' `value`s (e.g. KV pages, so all ranks schedule alike)."""
    if _SIZE == 1:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
