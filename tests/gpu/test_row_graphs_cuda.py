"""RowGraphs with real CUDA graphs: the DDTree candidate build replayed per batch bucket equals
the direct calls, for every batch size (padded buckets included) and budget."""

from __future__ import annotations

import pytest
import torch

from tests.graphs.row_cases import check_rows_match_direct

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_replayed_tree_build_matches_direct_calls():
    check_rows_match_direct(torch.device("cuda"), use_cuda_graphs=True)
