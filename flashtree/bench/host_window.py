"""The host's work between a speculative step's device read and the next launch: what the GPU
may wait on once the work queued ahead of the read (the next step's drafts) has run out.

`read_to_launch` turns a cProfile on when a device step's read returns and off at the next
forward's launch (a CUDA graph's replay; on the CPU, where nothing is replayed, the eager
forward's start), and times each such window."""

from __future__ import annotations

import cProfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from flashtree.runner.model_runner import ModelRunner
from flashtree.speculative import device_verifier


@contextmanager
def read_to_launch(prof: cProfile.Profile | None, device: torch.device) -> Iterator[list[float]]:
    """Inside: `prof` (if any) runs only in the windows; yields the list of their lengths in
    seconds, filled as they close (one left open at the end is not counted)."""
    windows: list[float] = []
    opened: list[float] = []
    real_start_to_host = device_verifier.start_to_host

    def start_to_host(values: torch.Tensor):
        wait = real_start_to_host(values)

        def read() -> torch.Tensor:
            host = wait()
            opened.append(time.perf_counter())
            if prof is not None:
                prof.enable()
            return host
        return read

    def close(counted: bool = True) -> None:
        if opened:
            if prof is not None:
                prof.disable()
            seconds = time.perf_counter() - opened.pop()
            if counted:
                windows.append(seconds)

    if device.type == "cuda":
        launch, name = torch.cuda.CUDAGraph, "replay"
    else:
        launch, name = ModelRunner, "run"
    real_launch = getattr(launch, name)

    def closing_launch(self, *args, **kwargs):
        close()
        return real_launch(self, *args, **kwargs)

    with (mock.patch.object(device_verifier, "start_to_host", start_to_host),
          mock.patch.object(launch, name, closing_launch)):
        try:
            yield windows
        finally:
            close(counted=False)  # a window the calls left open (no launch followed)
