"""`draft_ahead` builds its batch on the device (`ForwardBatch.device_blocks`: the blocks'
first positions are device values the host has not read). Field by field it must be the batch
that `ForwardBatch.build` makes on the host from the same blocks once those positions are
known: the same token ids, positions, KV slots over pages interleaved between requests, KV
lengths, layout and scored rows (a draft block's mask slots, not its bonus)."""

from __future__ import annotations

import random

import pytest
import torch

from flashtree.kv.cache import PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode

PAGE, BLOCK, MASK = 4, 5, 99


def _interleaved_pages(ends: list[int]) -> PageTables:
    """Pages handed out one per request in turn: no request's pages are contiguous."""
    pages = PageTables(num_pages=64, page_size=PAGE)
    for upto in range(PAGE, max(ends) + PAGE, PAGE):
        for seq_id, end in enumerate(ends):
            pages.reserve(seq_id, min(end, upto))
    return pages


@pytest.mark.parametrize("mode", [Mode.DRAFT, Mode.VERIFY])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_blocks_equal_the_host_built_batch(mode, seed):
    rng = random.Random(seed)
    r, most = 3, 6
    starts = [rng.randrange(0, 20) for _ in range(r)]
    advance = [rng.randrange(1, most + 1) for _ in range(r)]
    bonus = [rng.randrange(0, 50) for _ in range(r)]
    pages = _interleaved_pages([s + most + BLOCK for s in starts])
    block_ids = torch.tensor([[b] + [MASK] * (BLOCK - 1) for b in bonus])  # [R, BLOCK]
    got = ForwardBatch.device_blocks(mode, list(range(r)), starts, torch.tensor(advance),
                                     block_ids, max(starts) + most + BLOCK, pages)
    items = [BatchItem(i, s + a, ids, all_logits=True)
             for i, (s, a, ids) in enumerate(zip(starts, advance, block_ids.tolist()))]
    want = ForwardBatch.build(mode, items, pages, torch.device("cpu"))
    for name in ("input_ids", "positions", "logit_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("query_start", "kv_lens", "slot_mapping", "page_tables"):
        assert torch.equal(getattr(got.attn, name), getattr(want.attn, name)), name
    assert got.attn.max_query_len == want.attn.max_query_len == BLOCK
    assert got.attn.max_kv_len >= want.attn.max_kv_len  # a host bound: advance is not read
    assert got.attn.new_token_mask is None and want.attn.new_token_mask is None
    scored = BLOCK - 1 if mode is Mode.DRAFT else BLOCK
    assert got.logit_rows.shape == (r * scored,)
