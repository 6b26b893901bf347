"""The tensor-parallel code path under CUDA graphs. On one GPU, a group of one NCCL process runs
every collective (NCCL all-gathers, all-reduces through the one-shot kernel) captured inside the
graphs, and its tokens equal the eager engine's in the same group and the engine's without a
group. On two GPUs, TP=2 from graphs returns TP=2 eager's and TP=1's tokens and per-step
acceptance, and the one-shot all-reduce sums the two GPUs' parts, eager and in a graph. Plain,
DFlash and DDTree decoding, greedy and seeded sampling. Skips without the GPUs."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.distributed import destroy_tp, init_tp, one_shot_all_reduce
from flashtree.distributed.one_shot import BUFFER_BYTES
from flashtree.distributed.tp import free_port
from flashtree.graphs.runner import capture_graph
from tests.helpers import run_ranks
from tests.tiny import TINY_PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _engine_args(small_pair, spec: str) -> dict:
    target, drafter = map(str, small_pair)
    kw = dict(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
              page_size=4, max_num_seqs=8, spec=spec, spec_policy="fixed")
    return kw if spec == "none" else {**kw, "draft": drafter}


PARAMS = [SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=5)
          for t in (0.0, 0.8)]


@pytest.fixture
def group_of_one():
    device = torch.device("cuda", 0)
    init_tp(0, 1, "nccl", f"tcp://127.0.0.1:{free_port()}", device=device)
    try:
        yield device
    finally:
        destroy_tp()


def test_one_shot_all_reduce_is_calibrated_and_replays_in_a_graph(group_of_one):
    one_shot = one_shot_all_reduce()
    assert one_shot is not None
    assert sorted(one_shot.latency_us) == [1 << k for k in range(10, 24)]
    assert all(a > 0 and b > 0 for a, b in one_shot.latency_us.values())
    one_shot.max_bytes = 1 << 20  # a group of one measures nothing worth choosing by
    x = torch.randn(4096, dtype=torch.bfloat16, device=group_of_one)
    assert one_shot.takes(x) and not one_shot.takes(x[1:])  # misaligned: NCCL takes it
    assert not one_shot.takes(torch.empty(1 << 20, dtype=torch.float32, device=x.device))
    graph, _ = capture_graph(lambda: one_shot.all_reduce(x), group_of_one)
    want = torch.randn_like(x)
    x.copy_(want)
    graph.replay()
    assert torch.equal(x, want)  # the sum over one rank


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_group_of_one_graphs_equal_eager_and_no_group(small_pair, spec):
    kw = _engine_args(small_pair, spec)

    def tokens(**extra) -> list[list[list[int]]]:
        llm = LLM(**kw, **extra)
        out = [[o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, p)] for p in PARAMS]
        assert (llm.engine.runner.graphs is not None) == (not extra)  # eager: no graphs
        return out

    want = tokens()
    init_tp(0, 1, "nccl", f"tcp://127.0.0.1:{free_port()}", device=torch.device("cuda", 0))
    try:
        # One rank measures NCCL as free; send every all-reduce one-shot to test it in graphs.
        one_shot_all_reduce().max_bytes = BUFFER_BYTES
        graphed, eager = tokens(), tokens(enforce_eager=True)
    finally:
        destroy_tp()
    assert graphed == eager == want


@two_gpus
@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
def test_tp2_graphs_equal_tp2_eager_and_tp1(small_pair, spec):
    kw = _engine_args(small_pair, spec)
    results = []
    for extra in ({"tensor_parallel_size": 2},
                  {"tensor_parallel_size": 2, "enforce_eager": True}, {}):
        llm = LLM(**kw, **extra)
        try:
            # Per-step acceptance too: a draft's top-k over the wrong vocab slice still
            # commits the right tokens (verification is exact) but accepts fewer of them.
            results.append([[(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths)
                             for o in llm.generate(TINY_PROMPTS, p)] for p in PARAMS])
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


@two_gpus
def test_one_shot_all_reduce_sums_over_two_gpus():
    results = run_ranks(_one_shot_rank)
    base = torch.arange(3000, dtype=torch.float32)
    for rank in (0, 1):
        eager, replays = results[rank]
        torch.testing.assert_close(eager, base * 3, rtol=0, atol=0)
        for step, y in zip((1, 2), replays):
            want = base * 3 + 2 * step
            want[:1024] = base[:1024] * 3 * 2 + 2 * step * 2  # summed twice: twice the sum
            torch.testing.assert_close(y, want, rtol=0, atol=0)
