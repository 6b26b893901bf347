"""The one-launch DDTree build compiled on CUDA at the engine's shapes: drafts from random logits
over Qwen3's 151936-token vocabulary through `topk_logprobs`, 15 depths, the top 16, budgets 3
to 511, 1, 8 and 33 rows. Node for node against the reference of its selection, and against the
torch build on the same device where no keys tie; on bf16 logits (ties) the torch build's
multiset of keys. Captured in a CUDA graph (as the engine's RowGraphs would capture it) it
replays to the trees of new inputs. Skips without CUDA or triton."""

from __future__ import annotations

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason=TRITON_MISSING)

from flashtree.graphs.runner import capture_graph  # noqa: E402
from flashtree.speculative.tree import topk_logprobs  # noqa: E402
from flashtree.speculative.tree_kernel import build_trees_in_one_launch  # noqa: E402
from tests.speculative.tree_cases import check_against_torch  # noqa: E402

VOCAB, DEPTH, TOPK = 151936, 15, 16
BUDGETS = [3, 15, 63, 100, 255, 511]
DEVICE = torch.device("cuda")


def engine_drafts(rows: int, dtype: torch.dtype, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top_lp, top_tok, roots) from random drafter logits of `dtype`, as the engine takes them."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(rows, DEPTH, VOCAB, device=DEVICE, generator=gen) * 3
    top_lp, top_tok = topk_logprobs(logits.to(dtype), TOPK)
    return top_lp, top_tok, torch.randint(VOCAB, (rows,), device=DEVICE, generator=gen)


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("budget", BUDGETS)
def test_float32_logits_give_the_torch_builds_trees(budget, rows):
    top_lp, top_tok, roots = engine_drafts(rows, torch.float32, seed=budget * 100 + rows)
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    assert nodes.shape == (rows, 4, budget + 1) and visible.shape == (rows, budget + 1, budget + 1)
    assert nodes.is_cuda and visible.dtype == torch.bool
    untied = check_against_torch(nodes, visible, top_lp, top_tok, roots, budget)
    assert untied >= rows // 2, "exact float32 ties of path keys should be rare"


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("budget", BUDGETS)
def test_bf16_logits_keep_the_best_keys(budget, rows):
    top_lp, top_tok, roots = engine_drafts(rows, torch.bfloat16, seed=budget + rows)
    nodes, visible = build_trees_in_one_launch(top_lp, top_tok, roots, budget)
    check_against_torch(nodes, visible, top_lp, top_tok, roots, budget)


@pytest.mark.parametrize("budget", [3, 63, 511])
def test_a_captured_build_replays_the_trees_of_new_drafts(budget):
    static = engine_drafts(8, torch.float32, seed=0)
    graph, outputs = capture_graph(lambda: build_trees_in_one_launch(*static, budget), DEVICE)
    for seed in (1, 2):
        drafts = engine_drafts(8, torch.float32, seed)
        for buf, new in zip(static, drafts):
            buf.copy_(new)
        graph.replay()
        for got, want in zip(outputs, build_trees_in_one_launch(*drafts, budget)):
            assert torch.equal(got, want), seed


def test_the_engines_replayed_build_is_the_kernels():
    from flashtree.graphs.rows import RowGraphs
    from flashtree.speculative.candidate_builder import _tree_nodes

    rows = RowGraphs(_tree_nodes, [8, 16], DEVICE, use_cuda_graphs=True)
    for seed in (3, 4):
        drafts = engine_drafts(5, torch.float32, seed)
        got = rows(*drafts, budget=63)
        want = build_trees_in_one_launch(*drafts, 63)
        for g, w in zip(got, want):
            assert torch.equal(g, w), seed
