"""Data-parallel drafter training over the processes `torchrun` starts: every rank trains on its
own batches and the gradients are averaged before each optimizer step, so all ranks hold the same
drafter; rank 0 logs, validates and saves. One process (no WORLD_SIZE) needs none of this."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join_from_env(device: str | None) -> str | None:
    """Join the process group torchrun describes when WORLD_SIZE > 1 (NCCL on GPUs, one GPU per
    local rank; gloo on CPU) and return this rank's device; otherwise return `device` as is."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if kind == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return device or kind


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_parameters(params: list[torch.Tensor]) -> None:
    """Every rank starts from rank 0's weights."""
    for p in params:
        dist.broadcast(p.data, src=0)


def average_gradients(params: list[torch.Tensor]) -> None:
    """Replace each rank's gradients by their mean over ranks (one all-reduce for all)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))


def agree_on_min(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values (e.g. how many steps a time budget allows)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def check_in_step(params: list[torch.Tensor]) -> None:
    """Raise unless every rank holds the same weights (a checksum per rank compared)."""
    total = torch.stack([p.detach().double().sum() for p in params]).sum().view(1)
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RuntimeError(f"ranks drifted apart: weight checksums range {low.item()} to "
                           f"{high.item()}")
