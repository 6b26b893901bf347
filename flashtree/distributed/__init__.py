"""Tensor-parallel state over torch.distributed (gloo on CPU, NCCL on GPUs). Layers read their
rank and the group size from here when they are built, so one model class serves every TP size;
with no group (the default) everything is rank 0 of 1 and the collectives are no-ops. A group of
one (`init_tp(0, 1, ...)`) runs every collective, so the TP code path can be tested on one GPU.
A rank's share (`init_rank_share(tp, ep, ...)`): a real group of one process whose layers shard
as rank `rank` of `tp` (EP `ep`); every collective launches over that group and gathers only its
own part (its vocab slice), so one process runs one real rank's kernels, the wire time aside.

Per-step commands travel over a gloo group on the CPU (no device sync, no NCCL launch); under
NCCL, small all-reduces take a one-shot kernel over peer memory where it measured faster."""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from flashtree.distributed.one_shot import OneShotAllReduce

_RANK, _SIZE = 0, 1
_WORLD = 1  # processes in the group: _SIZE, but 1 in a rank's share (init_rank_share)
_EP_SIZE = 1  # expert-parallel size: divides the TP size (SGLang's --ep convention)
_GROUP = False  # a process group exists: the collectives run
_CPU_GROUP = None  # gloo group for the command stream (the default group under gloo)
_ONE_SHOT: OneShotAllReduce | None = None


def init_tp(rank: int, size: int, backend: str, init_method: str, timeout_s: float = 300,
            device: torch.device | None = None) -> None:
    """Join the TP group (one process per rank). `init_method` is a torch.distributed URL:
    tcp://host:port, or env:// under torchrun. Under NCCL, `device` (this rank's GPU) gets
    the one-shot all-reduce, used for the message sizes where it beat NCCL here."""
    global _RANK, _SIZE, _WORLD, _GROUP, _CPU_GROUP, _ONE_SHOT
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout)
    _RANK, _SIZE, _WORLD, _GROUP = rank, size, size, True
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    if backend == "nccl" and device is not None:
        _ONE_SHOT = OneShotAllReduce.start(device)


def init_rank_share(tp: int, ep: int, backend: str, init_method: str, rank: int = 0,
                    timeout_s: float = 300, device: torch.device | None = None) -> None:
    """Join a group of ONE process (as `init_tp(0, 1, ...)`) whose layers are built as rank
    `rank` of a `tp`-way TP group with expert-parallel size `ep`: one real rank's share of the
    weights, every collective launched over the group of one. Gathers return this rank's part
    alone (the LM head's logits: its vocab slice, token ids vocab_start.. of its own embedding
    slice); all-reduces sum nothing from peers. This process is the driver (it sends the
    per-step commands, as rank 0 does). `destroy_tp` ends it."""
    global _RANK, _SIZE
    if not 0 <= rank < tp or ep < 1 or tp % ep:
        raise ValueError(f"rank {rank} of tp {tp} with ep {ep}: need 0 <= rank < tp and ep "
                         "dividing tp")
    init_tp(0, 1, backend, init_method, timeout_s, device)
    _RANK, _SIZE = rank, tp
    set_ep_size(ep)


def destroy_tp() -> None:
    global _RANK, _SIZE, _WORLD, _EP_SIZE, _GROUP, _CPU_GROUP, _ONE_SHOT
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _WORLD, _EP_SIZE, _GROUP, _CPU_GROUP, _ONE_SHOT = 0, 1, 1, 1, False, None, None


def tp_group_active() -> bool:
    """A process group exists (TP > 1, or a group of one testing the collectives)."""
    return _GROUP


def one_shot_all_reduce() -> OneShotAllReduce | None:
    """The one-shot all-reduce of this rank (NCCL groups that could set it up), or None."""
    return _ONE_SHOT


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
    """Sum partial results of row-parallel layers across the TP group, in place."""
    if not _GROUP:
        return x
    if _ONE_SHOT is not None and _ONE_SHOT.takes(x):
        return _ONE_SHOT.all_reduce(x)
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[*shape] on every rank -> [tp, *shape] (rank order); [1, *shape] in a rank's share."""
    out = x.new_empty(_WORLD * x.numel())
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return out.view(_WORLD, *x.shape)


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' slices (e.g. vocab shards of the LM head) along the last dim."""
    if not _GROUP:
        return x
    return torch.cat(list(tp_all_gather(x)), dim=-1)


def tp_broadcast_object(obj=None, usual=None):
    """Rank 0's `obj` on every rank (the driver's per-step commands), over the CPU group; `obj`
    without a group. When rank 0's `obj == usual` (a step with nothing new) only an 8-byte
    header travels and the other ranks return their own `usual`."""
    if not _GROUP:
        return obj
    driver = _RANK == 0 or _WORLD == 1  # a rank's share drives itself
    header = torch.zeros(1, dtype=torch.int64)
    data = b""
    if driver and obj != usual:
        data = pickle.dumps(obj)
        header[0] = len(data)
    dist.broadcast(header, src=0, group=_CPU_GROUP)
    if header[0] == 0:
        return usual
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if driver
               else torch.empty(int(header[0]), dtype=torch.uint8))
    dist.broadcast(payload, src=0, group=_CPU_GROUP)
    return obj if driver else pickle.loads(payload.numpy().tobytes())


def tp_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' `value`s (e.g. KV pages, so all ranks schedule alike)."""
    if not _GROUP:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
