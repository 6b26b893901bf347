"""The tensor-parallel code path on one GPU: a group of one NCCL process runs every collective
(NCCL all-gathers, all-reduces through the one-shot kernel), captured inside the CUDA graphs;
its tokens equal the eager engine's in the same group and the engine's without a group, for
plain, DFlash and DDTree decoding, greedy and seeded sampling. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.distributed import destroy_tp, init_tp, one_shot_all_reduce
from flashtree.distributed.one_shot import BUFFER_BYTES
from flashtree.graphs.runner import capture_graph
from tests.server.conftest import _free_port
from tests.tiny import TINY_PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def group_of_one():
    device = torch.device("cuda", 0)
    init_tp(0, 1, "nccl", f"tcp://127.0.0.1:{_free_port()}", device=device)
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
    target, drafter = map(str, small_pair)
    kw = dict(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
              page_size=4, max_num_seqs=8, spec=spec, spec_policy="fixed")
    if spec != "none":
        kw["draft"] = drafter
    params = [SamplingParams(temperature=t, max_tokens=32, ignore_eos=True, seed=5)
              for t in (0.0, 0.8)]

    def tokens(**extra) -> list[list[list[int]]]:
        llm = LLM(**kw, **extra)
        out = [[o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, p)] for p in params]
        assert (llm.engine.runner.graphs is not None) == (not extra)  # eager: no graphs
        return out

    want = tokens()
    init_tp(0, 1, "nccl", f"tcp://127.0.0.1:{_free_port()}", device=torch.device("cuda", 0))
    try:
        # One rank measures NCCL as free; send every all-reduce one-shot to test it in graphs.
        one_shot_all_reduce().max_bytes = BUFFER_BYTES
        graphed, eager = tokens(), tokens(enforce_eager=True)
    finally:
        destroy_tp()
    assert graphed == eager == want

