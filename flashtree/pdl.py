"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while the kernel before it in the stream is finishing, so a decode step's chain of small
kernels overlaps each one's launch and first loads with the tail of the one before.

A kernel taking part calls `wait_for_previous(PDL)` before it reads anything an earlier
kernel wrote or writes anything at all; what it loads before (a GEMV's weights, nobody's
output) overlaps. The call also lets the next kernel start. `FLASHTREE_PDL=0` turns it off;
off CUDA, on GPUs before Hopper and under Triton's interpreter it is off."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (their `PDL` constexpr and `launch_pdl`)."""
    return (device.type == "cuda" and os.environ.get("FLASHTREE_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """A launch's PDL arguments on `device`: the kernel's `PDL` constexpr and `launch_pdl`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    # Waits until the previous kernel has finished and its writes are visible, then lets
    # the next kernel launch (it in turn waits for this one before reading its output).
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
