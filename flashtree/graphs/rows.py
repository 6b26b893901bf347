"""Row-wise tensor work replayed from CUDA graphs: the DDTree candidate build in torch ops
(top-k levels and the best-first tree) is ~100 small kernels whose launches, not their
arithmetic, cost the host milliseconds per step. Every input and output has the requests as
its first dimension and rows never read each other, so a batch runs padded to a bucket of rows:
captured on the first call per (bucket, input shapes past the rows, static arguments; engines
make those calls at start-up), replayed after copying the real rows in. Without CUDA graphs
(CPU, eager mode) the function runs on the padded static buffers the same way, so the padding
is exercised everywhere."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashtree.graphs.runner import capture_graph

RowFunction = Callable[..., tuple[torch.Tensor, ...]]


@dataclass
class _Entry:
    static: list[torch.Tensor]
    graph: torch.cuda.CUDAGraph | None
    outputs: tuple[torch.Tensor, ...] | None


class RowGraphs:
    def __init__(self, fn: RowFunction, buckets: Sequence[int], device: torch.device,
                 use_cuda_graphs: bool, pads: Sequence[float | None] = ()) -> None:
        """`fn(*tensors, **static)` -> tensors, each with the rows first; `buckets`: row counts
        to pad to (more rows than the largest run eagerly, unpadded). `pads[i]`: the value of
        input i's padding rows (for inputs that steer writes, such as cache slots); inputs
        without one keep stale padding rows, which only padding outputs read."""
        assert not use_cuda_graphs or device.type == "cuda", f"CUDA graphs on {device}"
        self.fn, self.device, self.use_cuda_graphs = fn, device, use_cuda_graphs
        self.pads = tuple(pads)
        self.buckets = sorted(set(buckets))
        self._entries: dict[tuple, _Entry] = {}
        self._pool = None

    def __call__(self, *inputs: torch.Tensor, **static) -> tuple[torch.Tensor, ...]:
        """`fn(*inputs, **static)` for the real rows (fresh tensors, not the static buffers)."""
        rows = inputs[0].shape[0]
        assert all(t.shape[0] == rows for t in inputs), [tuple(t.shape) for t in inputs]
        i = bisect.bisect_left(self.buckets, rows)
        if i == len(self.buckets):
            return self.fn(*inputs, **static)
        bucket = self.buckets[i]
        key = (bucket, *((tuple(t.shape[1:]), t.dtype) for t in inputs),
               *sorted(static.items()))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._capture(bucket, inputs, static)
        for j, (buf, t) in enumerate(zip(entry.static, inputs)):
            buf[:rows].copy_(t)
            if j < len(self.pads) and self.pads[j] is not None and rows < bucket:
                buf[rows:].fill_(self.pads[j])
        if entry.graph is None:
            outputs = self.fn(*entry.static, **static)
        else:
            entry.graph.replay()
            outputs = entry.outputs
        return tuple(o[:rows].clone() for o in outputs)

    def _capture(self, bucket: int, inputs: Sequence[torch.Tensor], static: dict) -> _Entry:
        buffers = [torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=self.device)
                   for t in inputs]
        if not self.use_cuda_graphs:
            return _Entry(buffers, None, None)
        graph, outputs = capture_graph(lambda: self.fn(*buffers, **static), self.device,
                                       self._pool)
        self._pool = graph.pool()
        return _Entry(buffers, graph, outputs)
