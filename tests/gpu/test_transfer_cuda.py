"""A device tensor's host copy queued without a sync holds its values once the host has read
a result queued after it, and is a snapshot of the tensor at the time it was queued."""

from __future__ import annotations

import pytest
import torch

from flashtree.transfer import HostSnapshots, device_to_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_host_copy_arrives_with_the_next_blocking_read():
    source = torch.rand(64, 16, dtype=torch.float64, device="cuda")
    expected = source.cpu()
    big = torch.rand(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    busy = big @ big  # keeps the stream busy past the copy's queuing (~1 TFLOP)
    copy = device_to_host(source)
    assert not torch.cuda.current_stream().query(), "device_to_host waited for the device"
    assert copy.is_pinned()
    source.zero_()  # queued after the copy: not in it
    busy.sum().item()  # the blocking read of a later result
    assert torch.equal(copy, expected)


def test_reused_snapshots_hold_each_copy_until_the_next_and_grow_as_needed():
    snapshots, big = HostSnapshots(), torch.rand(8192, 8192, device="cuda")
    for rows in (4, 2, 16, 16, 3):
        source = torch.rand(rows, 6, dtype=torch.float64, device="cuda")
        expected = source.cpu()
        busy = big @ big
        copy = snapshots.take(source)
        assert not torch.cuda.current_stream().query(), "take waited for the device"
        assert copy.is_pinned() and copy.shape == (rows, 6)
        source.zero_()  # queued after the copy: not in it
        busy.sum().item()
        assert torch.equal(copy, expected)
    first = snapshots.take(torch.ones(2, 6, dtype=torch.float64, device="cuda"))
    torch.cuda.synchronize()
    assert snapshots.take(torch.ones(2, 5, dtype=torch.float64, device="cuda")).shape == (2, 5)
    torch.cuda.synchronize()
    assert torch.equal(first, torch.ones(2, 6, dtype=torch.float64))  # a new width: new buffer
