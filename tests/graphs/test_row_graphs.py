"""RowGraphs without CUDA graphs: padded static buffers, the same outputs as direct calls."""

from __future__ import annotations

import torch

from flashtree.graphs.rows import RowGraphs
from tests.graphs.row_cases import check_rows_match_direct


def test_padded_rows_match_direct_calls():
    check_rows_match_direct(torch.device("cpu"), use_cuda_graphs=False)


def test_padding_rows_are_stale_but_never_returned():
    calls = []

    def double(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(x.shape[0])
        return (x * 2,)

    graphs = RowGraphs(double, [4], torch.device("cpu"), use_cuda_graphs=False)
    (out,) = graphs(torch.arange(3.0)[:, None])
    assert out.flatten().tolist() == [0.0, 2.0, 4.0]
    (out,) = graphs(torch.ones(1, 1))
    assert out.flatten().tolist() == [2.0] and calls == [4, 4]  # padded to the bucket
    (out,) = graphs(torch.ones(5, 1))  # past the largest bucket: eager, unpadded
    assert out.shape == (5, 1) and calls[-1] == 5


def test_padding_rows_take_the_pad_value_of_inputs_that_steer_writes():
    """A function that writes through an index (as injection writes cache slots): padding rows
    must write to the pad slot, never to a slot a stale row of an earlier call names."""
    store = torch.zeros(10)

    def write(values: torch.Tensor, slots: torch.Tensor) -> tuple[()]:
        store.index_copy_(0, slots, values)
        return ()

    graphs = RowGraphs(write, [4], torch.device("cpu"), use_cuda_graphs=False, pads=(None, 9))
    graphs(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 1, 2, 3]))
    graphs(torch.tensor([5.0]), torch.tensor([4]))
    assert store[:5].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # rows 1-3 of the second call: slot 9
