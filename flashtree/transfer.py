"""Copies between host and device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until
the stream has finished all earlier work: each such call is a device sync, and a speculative
step made many of them. Here the values go through pinned memory with one asynchronous copy
(stream-ordered, so kernels queued after it read them; torch's host allocator keeps the pinned
block alive until the copy is done)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """A tensor of `values` on `device`, copied without a device sync."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, made without a device sync."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def lists_to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several int64 lists in one copy: 1-D tensors (views of one device buffer), in order.
    Each view starts a multiple of 16 bytes into the buffer (lists are padded to an even
    length): Triton specializes kernels on their pointers' 16-byte alignment, so views at
    whatever offsets the lengths before them gave would compile a kernel variant per parity
    pattern, a stall the first time each appears in a running engine."""
    flat: list[int] = []
    for values in lists:
        flat += values
        flat += [0] * (len(values) % 2)
    parts = to_device(flat, device).split([len(v) + len(v) % 2 for v in lists])
    return [part[: len(values)] for part, values in zip(parts, lists)]


def start_to_host(values: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start copying `values` to the host; the returned function waits for that copy alone
    (not for device work queued after it) and gives the host tensor."""
    if values.device.type != "cuda":
        host = values.cpu()
        return lambda: host
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> torch.Tensor:
        copied.synchronize()
        return host
    return wait
