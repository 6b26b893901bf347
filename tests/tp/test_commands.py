"""The per-step command stream: rank 0's objects reach every rank over the CPU group, and a
step with nothing new (rank 0's object equal to `usual`) sends only a header, so the other
ranks return their own `usual` object instead of an unpickled copy."""

from __future__ import annotations

from flashtree.distributed import destroy_tp, init_tp, tp_broadcast_object
from tests.helpers import run_ranks

STEP = [("step",)]
SENT = [STEP, [("add", [1, 2, 3], {"t": 0.5}), ("step",)], STEP, [("abort", 7)], STEP]


def _rank(rank: int, port: int, out: dict) -> None:
    init_tp(rank, 2, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        usual = [("step",)]  # this rank's own object, equal to rank 0's
        got = [tp_broadcast_object(obj if rank == 0 else None, usual=usual) for obj in SENT]
        out[rank] = (got, [g is usual for g in got])
    finally:
        destroy_tp()


def test_commands_reach_every_rank_and_an_unchanged_step_sends_no_payload():
    got, own = run_ranks(_rank)[1]
    assert got == SENT
    assert own == [True, False, True, False, True]
