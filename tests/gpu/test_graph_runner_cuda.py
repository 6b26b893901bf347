"""The graph runner with real CUDA graphs: for every mode and bucket (padded ones included) the
replay equals the forward run eagerly on the real batch, with every static buffer poisoned
before each copy; a replay with a field removed raises the error that names it."""

from __future__ import annotations

import pytest
import torch

from flashtree.graphs.runner import GraphRunner
from flashtree.graphs.schema import GraphInputError, GraphMode
from tests.graphs.inputs import DIMS, make_inputs, model_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOKENS = {GraphMode.DECODE: 1, GraphMode.DRAFT: 4, GraphMode.VERIFY_CHAIN: 4,
          GraphMode.VERIFY_TREE: 5, GraphMode.PREFILL: 6}
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def runner():
    r = GraphRunner(model_like, DIMS, torch.device("cuda"), BUCKETS, poison=True)
    assert r.use_cuda_graphs
    for mode, tokens in TOKENS.items():
        r.capture(mode, tokens)
    return r


@pytest.mark.parametrize("mode", list(GraphMode))
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8])
def test_graph_equals_eager(runner, mode, batch):
    t = TOKENS[mode]
    for seed in range(3):
        ragged = mode not in (GraphMode.DECODE, GraphMode.DRAFT)
        q_lens = [1 + (seed + i) % t if ragged else t for i in range(batch)]
        inputs = make_inputs(mode, q_lens, "cuda", seed=seed)
        got = runner.run(mode, batch, max(q_lens), inputs)
        torch.cuda.synchronize()
        expected = model_like(None, inputs)
        assert torch.equal(got[: expected.shape[0]], expected), (mode, batch, seed)


def test_replay_with_a_field_removed_raises_the_named_error(runner):
    inputs = make_inputs(GraphMode.VERIFY_TREE, [5, 3, 2], "cuda")
    del inputs["new_token_mask"]
    with pytest.raises(GraphInputError, match=r"mode=verify_tree bucket=\(batch 4, tokens 5\)"
                                              r".*'new_token_mask': missing"):
        runner.run(GraphMode.VERIFY_TREE, 3, 5, inputs)
    inputs = make_inputs(GraphMode.DECODE, [1, 1], "cpu")  # host tensors for a CUDA graph
    with pytest.raises(GraphInputError, match=r"mode=decode .*'input_ids': on cpu"):
        runner.run(GraphMode.DECODE, 2, 1, inputs)
