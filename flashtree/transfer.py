"""Copies between host and device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until
the stream has finished all earlier work: each such call is a device sync, and a speculative
step made ~20 of them. Here the values go through pinned memory with one asynchronous copy
(stream-ordered, so kernels queued after it read them; torch's host allocator keeps the pinned
block alive until the copy is done). The other way, `device_to_host` queues a copy into pinned
memory that the host reads after the step's one device read, instead of a second sync."""

from __future__ import annotations

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


def device_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` as it is now in stream order (a snapshot: later writes to
    `tensor` do not reach it), queued on the current stream without a device sync. From a
    CUDA tensor it holds the values only once the host has waited for work queued after the
    copy on the same stream (any blocking read of a later result); read it after that."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class HostSnapshots:
    """`device_to_host` into one pinned buffer reused from copy to copy (growing to the most
    rows asked for): `benchmarks/host_profile.py` (cProfile) put a pinned allocation at
    20-30 us of host time on the H200's host, where a small model's decode step takes ~3 ms.
    A snapshot holds until the next one is taken; the caller reads each before."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return device_to_host(tensor)
        rows, buffer = tensor.shape[0], self._buffer
        if (buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != tensor.shape[1:]
                or buffer.dtype != tensor.dtype):
            buffer = self._buffer = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                pin_memory=True)
        return buffer[:rows].copy_(tensor, non_blocking=True)


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
