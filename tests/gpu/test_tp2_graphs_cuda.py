"""Tensor parallelism over two GPUs (NCCL): TP=2 replaying CUDA graphs, with its all-reduces
one-shot or NCCL as the group measured, returns TP=2 eager's and TP=1's tokens and per-step
acceptance (float32, a decisive tiny model), for plain, DFlash and DDTree decoding, greedy and
seeded sampling; the one-shot all-reduce sums two GPUs' parts, eager and in a graph. Skips with
fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.graphs.runner import capture_graph
from tests.server.conftest import _free_port
from tests.tiny import TINY_PROMPTS

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_tp2_graphs_equal_tp2_eager_and_tp1(small_pair, spec):
    target, drafter = map(str, small_pair)
    kw = dict(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
              page_size=4, max_num_seqs=8, spec=spec, spec_policy="fixed")
    if spec != "none":
        kw["draft"] = drafter
    params = [SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=6)
              for t in (0.0, 0.8)]
    results = []
    for extra in ({"tensor_parallel_size": 2},
                  {"tensor_parallel_size": 2, "enforce_eager": True}, {}):
        llm = LLM(**kw, **extra)
        try:
            # Per-step acceptance too: a draft's top-k over the wrong vocab slice still
            # commits the right tokens (verification is exact) but accepts fewer of them.
            results.append([[(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths)
                             for o in llm.generate(TINY_PROMPTS, p)] for p in params])
        finally:
            llm.shutdown()
    graphed, eager, one = results
    assert graphed == eager == one


def _one_shot_rank(rank: int, port: int, out: dict) -> None:
    """Rank `rank` of two, on GPU `rank`: the one-shot sum of distinct parts, eager and
    replayed from a graph (symmetric memory maps one buffer per device: two processes cannot
    share a GPU here)."""
    import torch.distributed as dist

    from flashtree.distributed.one_shot import OneShotAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        one_shot = OneShotAllReduce.allocate(device)
        one_shot.max_bytes = 1 << 20

        def part(step: int) -> torch.Tensor:
            return torch.arange(3000, dtype=torch.float32, device=device) * (rank + 1) + step

        x = part(0)
        one_shot.all_reduce(x)
        y = part(0)
        graph, _ = capture_graph(lambda: [one_shot.all_reduce(y[:1024]), one_shot.all_reduce(y)],
                                 device)
        replays = []
        for step in (1, 2):
            y.copy_(part(step))
            graph.replay()
            replays.append(y.cpu())
        out[rank] = (x.cpu(), replays)
    finally:
        dist.destroy_process_group()


def test_one_shot_all_reduce_sums_over_two_gpus():
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_one_shot_rank, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    base = torch.arange(3000, dtype=torch.float32)
    for rank in (0, 1):
        eager, replays = results[rank]
        torch.testing.assert_close(eager, base * 3, rtol=0, atol=0)
        for step, y in zip((1, 2), replays):
            want = base * 3 + 2 * step
            want[:1024] = base[:1024] * 3 * 2 + 2 * step * 2  # summed twice: twice the sum
            torch.testing.assert_close(y, want, rtol=0, atol=0)
