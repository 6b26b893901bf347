"""Captured forwards, one per (mode, batch bucket, tokens per request), replayed with padding.

`forward(key, static)` is the fixed-shape work of one mode (the model forward over the schema's
static buffers): it must read its inputs only from `static` and must not sync with the host or
allocate shapes from device data. The runner owns the static buffers (schema.allocate), checks
every real batch against the schema (schema.validate: errors name mode, bucket and field), copies
it in place (schema.copy_inputs) and replays the CUDA graph. Without CUDA graphs (CPU, or tests)
the same buffers, validation and copy run and `forward` is called eagerly on the static
buffers, so everything but the capture itself is exercised on CPU.

Variable-size work stays outside: DFlash context-feature injection into the draft KV, page
reservation and page-table edits, tree construction and the walk run before or after a replay."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashtree.graphs.schema import (
    GraphDims,
    GraphInputError,
    GraphKey,
    GraphMode,
    Inputs,
    allocate,
    copy_inputs,
    validate,
)

Forward = Callable[[GraphKey, dict[str, torch.Tensor]], Any]

_POISON = {torch.int64: -(2**40), torch.bool: True}  # floats: NaN


@dataclass
class _Entry:
    static: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None
    outputs: Any  # the captured forward's outputs, overwritten by every replay


def batch_buckets(max_batch: int) -> list[int]:
    """Request counts to capture up to `max_batch`: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two per
    octave: a padded replay runs at most a third more rows than the batch) and `max_batch`."""
    buckets, size = [], 1
    while size < max_batch:
        buckets += [size] + ([size * 3 // 2] if size >= 2 else [])
        size *= 2
    return sorted({b for b in buckets if b < max_batch} | {max_batch})


class GraphRunner:
    def __init__(
        self, forward: Forward, dims: GraphDims, device: torch.device,
        batch_buckets: Sequence[int], use_cuda_graphs: bool | None = None,
        poison: bool = False,
    ) -> None:
        """`batch_buckets`: request counts to capture (the largest must cover max_num_seqs).
        `use_cuda_graphs`: default on for CUDA devices. `poison`: fill every static buffer with
        garbage before each copy (debugging: a field the copy misses then shows up in the
        outputs instead of silently reading the previous batch)."""
        use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        assert not use_cuda_graphs or device.type == "cuda", f"CUDA graphs on {device}"
        assert batch_buckets and all(b >= 1 for b in batch_buckets), batch_buckets
        self.forward, self.dims, self.device = forward, dims, device
        self.batch_buckets = sorted(set(batch_buckets))
        self.use_cuda_graphs, self.poison = use_cuda_graphs, poison
        self._entries: dict[GraphKey, _Entry] = {}
        # bucket()'s answers: every step asks, and adaptive speculation captures many keys.
        self._buckets: dict[tuple[GraphMode, int, int], GraphKey | None] = {}
        self._pool = None  # memory pool shared by all captures (they never run concurrently)
        self.replays = 0  # CUDA graph replays so far (benchmarks check their steps replayed)
        self.last_graph: torch.cuda.CUDAGraph | None = None  # benchmarks time it alone

    @property
    def keys(self) -> list[GraphKey]:
        return list(self._entries)

    def capture(self, mode: GraphMode, tokens: int, max_rows: int | None = None) -> None:
        """Allocate (and on CUDA capture) every batch bucket for `mode` at `tokens` tokens per
        request, or those of at most `max_rows` token rows (bigger batches then run eagerly).
        Largest first, so smaller graphs fit in the memory the largest reserved."""
        assert tokens >= 1, f"{mode.value}: tokens per request {tokens}"
        self._buckets.clear()  # new keys can hold batches that others held before
        for batch in reversed(self.batch_buckets):
            if max_rows is not None and batch * tokens > max_rows:
                continue
            key = GraphKey(mode, batch, tokens)
            static = allocate(key, self.dims, self.device)
            graph, outputs = self._capture(key, static) if self.use_cuda_graphs else (None, None)
            self._entries[key] = _Entry(static, graph, outputs)

    def bucket(self, mode: GraphMode, batch: int, tokens: int) -> GraphKey | None:
        """The smallest captured key holding `batch` requests of up to `tokens` tokens, or None
        (the caller then runs eagerly)."""
        asked = (mode, batch, tokens)
        if asked not in self._buckets:
            fits = [k for k in self._entries
                    if k.mode == mode and k.batch >= batch and k.tokens >= tokens]
            self._buckets[asked] = min(fits, key=lambda k: (k.batch * k.tokens, k.tokens),
                                       default=None)
        return self._buckets[asked]

    def run(self, mode: GraphMode, batch: int, tokens: int, inputs: Inputs) -> Any:
        """Replay the bucket for `batch` requests of up to `tokens` tokens on `inputs` (schema
        field name -> tensor). The outputs are static buffers, valid until the next run: rows
        past the real tokens (and scored rows past the real ones) are padding."""
        key = self.bucket(mode, batch, tokens)
        if key is None:
            captured = sorted((k.batch, k.tokens) for k in self._entries if k.mode == mode)
            raise GraphInputError(
                f"mode={mode.value} bucket=(batch {batch}, tokens {tokens}) field 'batch': "
                f"no captured bucket holds it; captured (batch, tokens): {captured}"
            )
        return self.replay(key, batch, inputs)

    def replay(self, key: GraphKey, batch: int, inputs: Inputs) -> Any:
        """`run` on a key from `bucket` (callers that fall back to eager when there is none)."""
        entry = self._entries[key]
        validate(key, batch, inputs, self.dims, self.device)
        if self.poison:
            for buf in entry.static.values():
                buf.fill_(_POISON.get(buf.dtype, float("nan")))
        copy_inputs(key, entry.static, inputs, self.dims)
        if entry.graph is None:
            return self.forward(key, entry.static)
        entry.graph.replay()
        self.replays += 1
        self.last_graph = entry.graph
        return entry.outputs

    def _capture(self, key: GraphKey, static: dict[str, torch.Tensor]
                 ) -> tuple[torch.cuda.CUDAGraph, Any]:
        graph, outputs = capture_graph(lambda: self.forward(key, static), self.device,
                                       self._pool)
        self._pool = graph.pool()
        return graph, outputs


def capture_graph(fn: Callable[[], Any], device: torch.device, pool=None
                  ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn()` (which reads and writes only static tensors) after two warm-up calls on a
    side stream (kernel compilation and library handles stay out of the graph), and replay it
    once: a graph's first launch also uploads it to the device, a stall that would otherwise
    land on the first step to use it (an adaptive engine reaches some graphs only in the
    middle of serving: a budget or a context-row bucket met late). The garbage collector is
    off while it captures: a collection then could free another engine's graphs, and
    destroying a graph is not permitted while a stream captures."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    graph.replay()
    return graph, outputs
