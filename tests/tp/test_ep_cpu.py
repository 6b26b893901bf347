"""Expert parallelism over gloo with real worker processes: `--tp 2 --ep 2` (each rank holds half
of the routed experts, whole) and `--tp 2 --ep 1` (every expert sliced in two) return exactly the
single-process tokens at temperature 0, for Qwen3-MoE and for DeepSeek-V3 (MLA heads split over
the ranks, the latent cache on both), plain and with DDTree over a random drafter."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from tests.tiny import save_reference_drafter, save_tiny_deepseek_v3, save_tiny_qwen3_moe

PROMPTS = [[1, 5, 7, 9, 30, 31], [3, 4], [10, 11, 12, 13, 14, 15, 16, 40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    qwen = save_tiny_qwen3_moe(root / "qwen", seed=2, vocab_size=67)
    ds = save_tiny_deepseek_v3(root / "ds", seed=3, vocab_size=67)
    drafter = save_reference_drafter(root / "drafter", ds, block_size=4, target_layer_ids=[0, 1])
    return {"qwen3_moe": qwen, "deepseek_v3": ds, "drafter": drafter}


def _tokens(models, family: str, tp: int, ep: int, spec: str = "none") -> list[list[int]]:
    extra = {} if spec == "none" else {"draft": str(models["drafter"]), "spec": spec}
    llm = LLM(model=str(models[family]), device="cpu", dtype="float32",
              skip_tokenizer_init=True, tensor_parallel_size=tp, expert_parallel_size=ep,
              **extra)
    try:
        if tp > 1:
            moe = llm.model.layers[1].mlp
            experts = sorted(int(e) for e in moe.experts)
            if ep == 2:  # rank 0 holds experts 0..3 whole
                assert experts == [0, 1, 2, 3], experts
                assert moe.experts["0"].down_proj.weight.shape == (32, 16)
            else:  # every expert, half of its intermediate dim
                assert experts == list(range(8)), experts
                assert moe.experts["0"].down_proj.weight.shape == (32, 8)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_ep2_equals_ep1(models, family):
    want = _tokens(models, family, 1, 1)
    assert _tokens(models, family, 2, 2) == want


def test_tp2_without_ep_and_ddtree_with_ep2_equal_single_process(models):
    want = _tokens(models, "deepseek_v3", 1, 1)
    assert _tokens(models, "deepseek_v3", 2, 1) == want
    assert _tokens(models, "deepseek_v3", 2, 2, spec="ddtree") == want


def test_ep_must_divide_tp(models):
    with pytest.raises(ValueError, match="expert_parallel_size 2 must be >= 1 and divide "
                                         "tensor_parallel_size 1"):
        LLM(model=str(models["qwen3_moe"]), device="cpu", skip_tokenizer_init=True,
            expert_parallel_size=2)
