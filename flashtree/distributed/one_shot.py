"""One-shot all-reduce over peer memory (what vLLM and SGLang call a custom all-reduce), from
torch's symmetric memory: each rank's kernel copies its input into its own buffer, waits for the
peers at a barrier, then reads every peer's buffer and sums. One launch and one hop, against
NCCL's ring, so it wins for the small messages of a decode step; NCCL wins for large ones.

Which one runs is measured per message size when the group starts (the slowest rank's time
decides, so every rank chooses alike): all-reduces up to `max_bytes` go one-shot."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BUFFER_BYTES = 8 << 20  # per rank; a decode step's all-reduces are a few KB to a few MB
_SIZES = [1 << k for k in range(10, 24)]  # 1 KiB .. 8 MiB, the calibration's message sizes
_ALIGN = 16  # the kernel's vector width in bytes


@dataclass
class OneShotAllReduce:
    buffer: torch.Tensor  # uint8 symmetric memory, BUFFER_BYTES
    group_name: str
    max_bytes: int = 0  # the largest message sent one-shot (0: none)
    # message bytes -> (NCCL us, one-shot us), the slowest rank's
    latency_us: dict[int, tuple[float, float]] = field(default_factory=dict)

    @staticmethod
    def allocate(device: torch.device) -> OneShotAllReduce:
        """Map every rank's buffer of the default group (a collective call); takes nothing
        until calibrated or given a `max_bytes`."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
        group_name = dist.group.WORLD.group_name
        symm_mem.rendezvous(buffer, group_name)
        return OneShotAllReduce(buffer, group_name)

    @staticmethod
    def start(device: torch.device) -> OneShotAllReduce | None:
        """Allocate and calibrate on every rank of the default NCCL group; None, with a
        warning saying why, where peer memory cannot be mapped."""
        try:
            one_shot = OneShotAllReduce.allocate(device)
            one_shot.calibrate()  # fails alike on every rank (e.g. a world size it lacks)
        except (ImportError, RuntimeError) as e:
            warnings.warn(f"one-shot all-reduce unavailable ({e}); every all-reduce uses NCCL",
                          stacklevel=2)
            return None
        return one_shot

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (nbytes <= self.max_bytes and x.is_contiguous() and nbytes % _ALIGN == 0
                and x.data_ptr() % _ALIGN == 0 and x.dtype in (torch.bfloat16, torch.float32))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (a caller checked `takes(x)`)."""
        flat = x.view(-1)
        symm = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        return x

    def calibrate(self, dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> None:
        """Time NCCL and one-shot at each size in _SIZES; `max_bytes` is the largest size
        below which one-shot was faster at every size measured."""
        device = self.buffer.device
        times = torch.tensor([[_time_us(dist.all_reduce, n, dtype, iters, device),
                               _time_us(self.all_reduce, n, dtype, iters, device)]
                              for n in _SIZES], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        self.latency_us = {n: (float(a), float(b)) for n, (a, b) in zip(_SIZES, times.tolist())}
        self.max_bytes = 0
        for n in _SIZES:
            nccl, one_shot = self.latency_us[n]
            if one_shot >= nccl:
                break
            self.max_bytes = n


def _time_us(fn, nbytes: int, dtype: torch.dtype, iters: int, device: torch.device) -> float:
    """Mean microseconds of `fn(x)` on an `nbytes` message, replayed from a CUDA graph of
    `iters` calls as a decode step replays them (no host launch cost in the number)."""
    from flashtree.graphs.runner import capture_graph

    x = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=device)
    graph, _ = capture_graph(lambda: [fn(x) for _ in range(iters)], device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters
