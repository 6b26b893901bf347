"""Argmax and top-k log-probabilities over a vocabulary split across two gloo ranks equal the
single-device results, including exact ties across the shard boundary (lowest id wins)."""

from __future__ import annotations

import torch

from flashtree.distributed import destroy_tp, init_tp
from flashtree.distributed.vocab import vocab_argmax, vocab_topk_logprobs
from tests.helpers import run_ranks

VOCAB, SHARD, K = 67, 34, 40  # the second slice (33 ids) is narrower than K


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, VOCAB, generator=g)
    x[0, 3] = x[0, 40] = 9.0  # tie across the boundary: id 3 must win
    x[1, 50] = x[1, 60] = 9.0  # tie inside the second slice: id 50
    x[2, :] = 1.0  # all equal: id 0
    return x


def _rank(rank: int, port: int, out: dict) -> None:
    init_tp(rank, 2, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        start = rank * SHARD
        local = _logits()[:, start : min(start + SHARD, VOCAB)]
        lp, ids = vocab_topk_logprobs(local, K, start)
        out[rank] = (vocab_argmax(local, start), lp, ids)
    finally:
        destroy_tp()


def test_sharded_argmax_and_topk_equal_one_device():
    results = run_ranks(_rank)
    x = _logits()
    want_lp, want_ids = torch.log_softmax(x.double(), dim=-1).topk(K, dim=-1)
    for rank in (0, 1):
        argmax, lp, ids = results[rank]
        assert argmax.tolist() == x.argmax(dim=-1).tolist() and argmax[:3].tolist() == [3, 50, 0]
        assert lp.dtype == torch.float32  # a few float32 roundings of the normaliser and sum
        atol = 8 * 2**-24 * (1 + want_lp.abs().max().item())
        torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=atol)
        assert ids[3:].tolist() == want_ids[3:].tolist()  # no ties: the same order
        for r in (0, 1):  # a tie at the top: the same ids, tied ones in either order
            assert sorted(ids[r].tolist()) == sorted(want_ids[r].tolist())
