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


@pytest.mark.parametrize("tp,ep", [(4, 2), (4, 4), (4, 1), (8, 4)])
def test_every_layout_sums_to_the_single_rank_moe_block(models, monkeypatch, tp, ep):
    """SGLang's hybrid `--tp T --ep E` layouts without processes: each simulated rank builds and
    loads its shard of the DeepSeek MoE block (routed experts of its expert group, sliced over
    T/E ranks; shared experts sliced over T), and the ranks' partial outputs (the block's single
    all-reduce replaced by a sum here) equal the unsharded block."""
    import torch

    import flashtree.distributed as dist_state
    import flashtree.layers.moe as moe_mod
    from flashtree.models.loader import load_hf_model

    cpu = torch.device("cpu")
    full, _ = load_hf_model(models["deepseek_v3"], torch.float32, cpu)
    x = torch.randn(37, full.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full.layers[1].mlp(x)
    monkeypatch.setattr(moe_mod, "tp_all_reduce", lambda t: t)
    monkeypatch.setattr(dist_state, "_SIZE", tp)
    monkeypatch.setattr(dist_state, "_EP_SIZE", ep)
    total, held = torch.zeros_like(want), []
    for rank in range(tp):
        monkeypatch.setattr(dist_state, "_RANK", rank)
        if tp <= 4:  # the real loader, skipping other groups' experts
            block = load_hf_model(models["deepseek_v3"], torch.float32, cpu)[0].layers[1].mlp
        else:  # 4 MLA heads do not split 8 ways: build and load the MoE block alone
            block = moe_mod.SparseMoE(full.cfg.moe, full.cfg.hidden_size)
            prefix = "layers.1.mlp."
            _load_block(block, {k[len(prefix):]: v for k, v in _full_state(full).items()
                                if k.startswith(prefix)})
        held.append(sorted(int(e) for e in block.experts))
        with torch.no_grad():
            total += block(x)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)
    per_group = 8 // ep
    assert held == [list(range(r // (tp // ep) * per_group, (r // (tp // ep) + 1) * per_group))
                    for r in range(tp)]


def _full_state(model) -> dict:
    """Checkpoint-named (unstacked) tensors of an unsharded model's MoE blocks."""
    out = {}
    for name, param in model.named_parameters():
        if ".gate_up_proj." in name:
            gate, up = param.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = param
    return out


def _load_block(block, state: dict) -> None:
    modules = dict(block.named_modules())
    for name, tensor in state.items():
        path, _, kind = name.rpartition(".")
        shard = 0
        for src, dst, part in ((".gate_proj", ".gate_up_proj", 0),
                               (".up_proj", ".gate_up_proj", 1)):
            if path.endswith(src):
                path, shard = path[: -len(src)] + dst, part
        expert = path.split(".")[1] if path.startswith("experts.") else None
        if expert is not None and not block.owns(int(expert)):
            continue
        modules[path].load_shard(name, tensor, shard)
