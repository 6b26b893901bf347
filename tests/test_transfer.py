"""Host lists to device tensors: values, order, and the 16-byte alignment of every view that
keeps Triton from compiling a kernel variant per alignment pattern; device tensors to host
snapshots."""

from __future__ import annotations

import torch

from flashtree.transfer import device_to_host, lists_to_device


def test_lists_arrive_in_order_each_view_16_byte_aligned():
    lists = [[5, 6, 7], [], [1], [2, 3], [9, 8, 7, 6, 5]]  # odd, empty and even lengths
    views = lists_to_device(lists, torch.device("cpu"))
    assert [v.tolist() for v in views] == lists
    assert all(v.dtype == torch.int64 for v in views)
    filled = [v for v in views if v.numel()]
    assert [v.data_ptr() % 16 for v in filled] == [0] * len(filled)
    base = filled[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in filled)  # one buffer's views


def test_a_host_copy_is_a_snapshot_of_the_tensor_when_it_was_queued():
    """A host copy keeps the values its source had when it was queued, whatever is written
    to the source after."""
    source = torch.arange(6, dtype=torch.float64).view(2, 3)
    copy = device_to_host(source)
    source.zero_()
    assert copy.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert copy.dtype == torch.float64 and copy.device.type == "cpu"
