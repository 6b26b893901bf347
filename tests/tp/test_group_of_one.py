"""The tensor-parallel code path with a group of one process: every collective runs (gloo here;
NCCL and graphs in tests/gpu), and the engine returns the tokens of the engine without a group,
for plain and speculative decoding, greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from flashtree import LLM, SamplingParams
from flashtree.distributed import destroy_tp, init_tp, tp_group_active
from flashtree.distributed.tp import free_port
from tests.tiny import TINY_PROMPTS


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_group_of_one_equals_no_group(small_pair, spec, monkeypatch):
    target, drafter = map(str, small_pair)
    kw = dict(model=target, device="cpu", skip_tokenizer_init=True, spec=spec)
    if spec != "none":
        kw["draft"] = drafter
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=4)
              for t in (0.0, 0.8)]
    want = [[o.outputs[0].token_ids for o in LLM(**kw).generate(TINY_PROMPTS, p)]
            for p in params]
    all_reduce, calls = dist.all_reduce, []
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, *a, **k: calls.append(t.shape) or all_reduce(t, *a, **k))
    init_tp(0, 1, "gloo", f"tcp://127.0.0.1:{free_port()}")
    try:
        assert tp_group_active()
        llm = LLM(**kw)
        got = [[o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, p)] for p in params]
    finally:
        destroy_tp()
    assert got == want
    assert len(calls) > 100  # two per layer per step: the row-parallel layers' sums ran
