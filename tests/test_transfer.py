"""Host lists to device tensors: values, order, and the 16-byte alignment of every view that
keeps Triton from compiling a kernel variant per alignment pattern."""

from __future__ import annotations

import torch

from flashtree.transfer import lists_to_device


def test_lists_arrive_in_order_each_view_16_byte_aligned():
    lists = [[5, 6, 7], [], [1], [2, 3], [9, 8, 7, 6, 5]]  # odd, empty and even lengths
    views = lists_to_device(lists, torch.device("cpu"))
    assert [v.tolist() for v in views] == lists
    assert all(v.dtype == torch.int64 for v in views)
    filled = [v for v in views if v.numel()]
    assert [v.data_ptr() % 16 for v in filled] == [0] * len(filled)
    base = filled[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in filled)  # one buffer's views
