"""`align_by_expert` (one Triton program) against a brute-force grouping: every pair routed to
this rank's experts lands exactly once in a block of its expert, blocks hold one expert each,
padding and blocks past the end are marked, and the sizes depend on the batch size alone
(graph-capturable). Through Triton's interpreter on CPU, compiled where CUDA exists; skipped
where triton is not installed (a failure under CI=true)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_MISSING, allow_module_level=True)
if not torch.cuda.is_available():
    import tests.attention.interpreter  # noqa: F401  (before triton is used)

from flashtree.layers.moe_align import align_by_expert  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("pairs,experts,block_m,seed", [
    (1, 4, 4, 0), (8, 4, 4, 1), (37, 8, 16, 2), (64, 3, 8, 3), (200, 16, 16, 4), (5, 8, 16, 5),
    (2500, 384, 16, 6),  # Kimi's expert count, more pairs than one loop step of the kernel
])
def test_pairs_grouped_by_expert(pairs, experts, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    local = torch.randint(0, experts + 1, (pairs,), generator=gen)  # `experts`: another rank's
    sorted_pairs, block_experts = (t.cpu() for t in align_by_expert(local.to(DEVICE), experts,
                                                                      block_m))
    size = -(-(pairs + experts * (block_m - 1)) // block_m) * block_m
    assert sorted_pairs.shape == (size,) and block_experts.shape == (size // block_m,)
    blocks = sorted_pairs.view(-1, block_m)
    seen = []
    for b, expert in enumerate(block_experts.tolist()):
        members = [p for p in blocks[b].tolist() if p != pairs]
        if expert == -1:
            assert not members, (b, members)
            continue
        assert all(local[p] == expert for p in members), (b, expert, members)
        seen += members
    want = sorted(p for p in range(pairs) if local[p] < experts)
    assert sorted(seen) == want  # each of this rank's pairs once, other ranks' pairs never
    # An expert's blocks are contiguous and full but for the last.
    for expert in range(experts):
        rows = [b for b, e in enumerate(block_experts.tolist()) if e == expert]
        assert rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        members = [p for b in rows for p in blocks[b].tolist() if p != pairs]
        assert sorted(members) == [p for p in range(pairs) if local[p] == expert]
        assert len(rows) == -(-len(members) // block_m)
