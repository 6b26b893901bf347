"""One rank's share of a TP / EP layout in a group of one process (`init_rank_share`,
bench/random_pair.py's `rank_share`, `random_rank`, `rank_llm`): the shard holds what
`flashtree plan` says one GPU holds, cut as the layout says; its engine runs the collectives
over the group of one and decodes greedily alike plain, chained and tree-verified, in its own
vocabulary slice; random INT4 experts have the float rule's spread."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashtree import SamplingParams
from flashtree.bench.floors import weight_bytes
from flashtree.bench.random_pair import (
    _INPUT_STD,
    _TARGET_RESIDUAL_SCALE,
    _tensors_within,
    parse_layout,
    random_rank,
    rank_llm,
    rank_share,
)
from flashtree.bench.shapes import TINY_MLA
from flashtree.distributed import (
    get_ep_rank,
    get_ep_size,
    get_tp_rank,
    get_tp_size,
    tp_group_active,
)
from flashtree.layers.int4 import dequantize_int4
from flashtree.models.config import ModelConfig
from flashtree.models.loader import model_class
from flashtree.plan import _loaded_bytes, drafter_parts, target_parts

# A tiny Kimi: tiny-mla with experts wide enough to slice 4 ways in INT4 groups of 32 (Kimi's
# group, the one `flashtree plan` counts); 8 experts, 4 heads, vocab 512.
GROUP, MOE_INTER = 32, 128
SHAPE = dict(TINY_MLA, moe_intermediate_size=MOE_INTER)
KIMI_FIXTURE = Path(__file__).parents[1] / "fixtures" / "kimi_k26" / "config.json"
LAYOUTS = ["tp4", "ep4", "tp4ep2"]


def _oracle_config(shape: dict) -> ModelConfig:
    """The target's config as `flashtree plan` reads a checkpoint's: Kimi K2.6's quantization
    block (compressed-tensors INT4 experts), from the fixture, not from random_pair."""
    quant = json.loads(KIMI_FIXTURE.read_text())["quantization_config"]
    assert quant["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    return ModelConfig.from_hf({"architectures": ["DeepseekV3ForCausalLM"], **shape,
                                "quantization_config": quant})


def _target_part(name: str) -> str:
    """The `plan.target_parts` entry that holds parameter `name`."""
    if name.startswith(("embed_tokens", "lm_head")):
        return "embedding" if name.startswith("embed") else "lm_head"
    for key, part in ((".self_attn.", "attention"), (".mlp.experts.", "routed_experts"),
                      (".mlp.shared_experts.", "shared_experts"), (".mlp.gate.", "routers"),
                      (".mlp.", "dense_mlp")):
        if key in name:
            return part
    return "norms"


def _drafter_part(name: str) -> str:
    if name.startswith("fc."):
        return "draft_fc"
    return "draft_layers" if ".self_attn." in name or ".mlp." in name else "draft_norms"


def _held(module: torch.nn.Module, part_of) -> tuple[dict, dict]:
    """Per plan part: (weights, bytes) the module holds. A packed INT4 word is 8 weights; its
    scales are bytes, not weights; `weight_shape` (two int64 of metadata) is neither."""
    params, nbytes = {}, {}
    for name, p in module.named_parameters():
        if name.endswith("weight_shape"):
            continue
        part = part_of(name)
        count = 0 if name.endswith("weight_scale") else p.numel() * (
            8 if name.endswith("weight_packed") else 1)
        params[part] = params.get(part, 0) + count
        nbytes[part] = nbytes.get(part, 0) + p.numel() * p.element_size()
    return params, nbytes


@pytest.fixture(scope="module", params=LAYOUTS)
def bf16_share(request):
    layout = request.param
    with rank_share(layout) as (tp, ep):
        assert (get_tp_size(), get_ep_size(), get_tp_rank(), tp_group_active()) == (
            tp, ep, 0, True)
        target, cfg, drafter = random_rank("tiny-mla", torch.bfloat16, "cpu",
                                           int4_group=GROUP, moe_intermediate_size=MOE_INTER)
    assert (get_tp_size(), get_ep_size(), tp_group_active()) == (1, 1, False)  # reset
    return layout, target, cfg, drafter


def test_shard_bytes_equal_plan_per_gpu(bf16_share):
    layout, target, cfg, drafter = bf16_share
    tp, ep = parse_layout(layout)
    oracle = _oracle_config(SHAPE)
    assert (cfg.quantization, cfg.moe.int4_group) == ("compressed-tensors", GROUP)
    parts = {p.name: p for p in target_parts(oracle, tp, ep)}
    params, nbytes = _held(target, _target_part)
    assert params == {name: p.per_gpu for name, p in parts.items()}
    for name, p in parts.items():
        # The routers are float32 whatever the model dtype (router_fp32); plan counts them at
        # the model dtype, so it undercounts them by half.
        per_param = 4 if name == "routers" else _loaded_bytes(p, oracle, 2)
        assert nbytes[name] == p.per_gpu * per_param, (name, nbytes[name], p)
    d_parts = {p.name: p for p in drafter_parts(drafter.cfg, tp)}
    d_params, d_bytes = _held(drafter, _drafter_part)
    assert d_params == {name: p.per_gpu for name, p in d_parts.items()}
    assert d_bytes == {name: 2 * p.per_gpu for name, p in d_parts.items()}


def test_shards_are_the_full_shapes_cut_as_the_layout_says(bf16_share):
    layout, target, cfg, drafter = bf16_share
    tp, ep = parse_layout(layout)
    m, moe, h = cfg.mla, cfg.moe, cfg.hidden_size
    heads, inter, experts = cfg.num_heads // tp, moe.intermediate_size // (tp // ep), (
        moe.num_experts // ep)
    vocab = cfg.vocab_size // tp
    assert target.embed_tokens.weight.shape == target.lm_head.weight.shape == (vocab, h)
    assert target.embed_tokens.vocab_start == 0 and target.embed_tokens.vocab_end == vocab
    for i, layer in enumerate(target.layers):
        attn = layer.self_attn
        assert attn.num_heads == heads
        assert attn.q_b_proj.weight.shape == (heads * m.qk_head_dim, m.q_lora_rank)
        assert attn.kv_b_proj.weight.shape == (heads * (m.qk_nope_head_dim + m.v_head_dim),
                                               m.kv_lora_rank)
        assert attn.o_proj.weight.shape == (h, heads * m.v_head_dim)
        assert attn.qkv_a_proj.weight.shape == (m.q_lora_rank + m.latent_dim, h)  # replicated
        if not moe.sparse_layers[i]:
            continue
        mlp = layer.mlp
        assert list(mlp.experts) == [str(e) for e in range(experts)]  # rank 0: the first ones
        assert mlp.gate.weight.shape == (moe.num_experts, h)  # every rank routes all
        assert mlp.stacked.gate_up.shape == (experts, 2 * inter, h // 8)
        assert mlp.stacked.down.shape == (experts, h, inter // 8)
        assert mlp.stacked.gate_up_scale.shape == (experts, 2 * inter, h // GROUP)
        assert mlp.stacked.down_scale.shape == (experts, h, inter // GROUP)
        e = mlp.experts["0"]
        assert e.gate_up_proj.weight_shape.tolist() == [moe.intermediate_size, h]  # full
        assert e.down_proj.weight_shape.tolist() == [h, moe.intermediate_size]
        shared = moe.intermediate_size * moe.num_shared_experts // tp
        assert mlp.shared_experts.gate_up_proj.weight.shape == (2 * shared, h)


@pytest.mark.parametrize("layout,rank", [("tp8", 5), ("ep8", 5), ("tp8ep2", 5)])
def test_other_ranks_hold_their_own_experts_and_vocab(layout, rank):
    """A share of rank 5 (shapes only): its vocab slice, its expert group, its slice of each."""
    tp, ep = parse_layout(layout)
    cfg = _oracle_config(dict(SHAPE, num_attention_heads=8, num_key_value_heads=8))
    cfg = replace(cfg, moe=replace(cfg.moe, int4_group=GROUP // 2))
    with rank_share(layout, rank=rank):
        group = get_ep_rank()
        model = model_class(cfg)(cfg)
    assert group == rank // (tp // ep)
    shard = cfg.vocab_size // tp
    assert (model.embed_tokens.vocab_start, model.embed_tokens.vocab_end) == (
        rank * shard, (rank + 1) * shard)
    mlp, per = model.layers[1].mlp, cfg.moe.num_experts // ep
    assert list(mlp.experts) == [str(e) for e in range(group * per, (group + 1) * per)]
    linear = mlp.experts[str(group * per)].gate_up_proj
    assert (linear.rank, linear.shard) == (rank % (tp // ep), MOE_INTER // (tp // ep))


@pytest.mark.parametrize("layout", ["tp8", "ep8"])
def test_kimi_share_weights_equal_plan(layout):
    """Kimi K2.6 itself (5 of its 61 layers, built on the meta device: shapes only): the
    rank's INT4 experts, MLA and vocab slice hold what plan counts per GPU."""
    tp, ep = parse_layout(layout)
    full = json.loads(KIMI_FIXTURE.read_text())
    full["text_config"]["num_hidden_layers"] = 5
    oracle = ModelConfig.from_hf(full)
    cfg = replace(oracle, moe=replace(oracle.moe, int4_group=GROUP))
    with rank_share(layout):
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        model.to(torch.bfloat16)
    parts = {p.name: p for p in target_parts(oracle, tp, ep)}
    params, nbytes = _held(model, _target_part)
    assert params == {name: p.per_gpu for name, p in parts.items()}
    assert nbytes["routed_experts"] == parts["routed_experts"].per_gpu * 0.5625
    assert len(model.layers[1].mlp.experts) == 384 // ep
    assert model.layers[1].mlp.experts["0"].down_proj.shard == 2048 // (tp // ep)
    assert model.layers[0].self_attn.num_heads == 64 // tp
    assert model.embed_tokens.weight.shape[0] == 163840 // tp


def test_int4_experts_have_the_float_rules_spread(bf16_share):
    _, target, cfg, _ = bf16_share
    e = target.layers[1].mlp.experts["0"]
    for linear, std in ((e.gate_up_proj, _INPUT_STD),
                        (e.down_proj, _TARGET_RESIDUAL_SCALE / linear_fan_in(e.down_proj) ** 0.5)):
        w = dequantize_int4(linear.weight_packed, linear.weight_scale.float(), GROUP)
        rms = w.pow(2).mean().sqrt().item()
        assert abs(rms / std - 1) < 0.05, (rms, std)
        values = (w / linear.weight_scale.float().repeat_interleave(GROUP, 1)).round()
        assert values.min() == -8 and values.max() == 7  # random nibbles: every value


def linear_fan_in(linear) -> int:
    return linear.weight_packed.shape[1] * 8


BLOCK = 8


@pytest.mark.parametrize("layout", ["tp4", "ep4"])
def test_rank_decodes_alike_plain_chain_and_tree_in_its_vocab_slice(layout, monkeypatch):
    with rank_share(layout) as (tp, ep):  # open while the engines decode
        target, cfg, drafter = random_rank("tiny-mla", torch.float32, "cpu", int4_group=GROUP,
                                           moe_intermediate_size=MOE_INTER)
        _decode_alike(layout, tp, ep, target, cfg, drafter, monkeypatch)


def _decode_alike(layout, tp, ep, target, cfg, drafter, monkeypatch) -> None:
    slice_end = cfg.vocab_size // tp
    rng = random.Random(0)
    prompts = [[rng.randrange(slice_end) for _ in range(n)] for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reduces, gathers = [], []
    all_reduce, all_gather = dist.all_reduce, dist.all_gather_into_tensor
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, *a, **k: reduces.append(t.shape) or all_reduce(t, *a, **k))
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, x, *a, **k: (
        gathers.append((out.numel(), x.numel())) or all_gather(out, x, *a, **k)))
    outs = {}
    for spec in ("none", "dflash", "ddtree"):
        llm = rank_llm(target, cfg, drafter, spec=spec, spec_policy="fixed",
                       block_size=BLOCK if spec != "none" else None, max_num_seqs=4,
                       max_model_len=512)
        assert (get_tp_size(), get_ep_size()) == (tp, ep)  # LLM() left the share's layout
        got = llm.generate(prompts, params)
        outs[spec] = [list(o.outputs[0].token_ids) for o in got]
        if spec != "none":
            assert llm.engine.spec_stats.num_drafts > 0, spec
    assert outs["none"] == outs["dflash"] == outs["ddtree"], layout
    # The decisive target follows its permutation inside the slice it holds.
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    succ = (emb @ head.T).argmax(-1)
    for prompt, out in zip(prompts, outs["none"]):
        assert len(out) == 24 and all(0 <= t < slice_end for t in out)
        chain = [prompt[-1]] + out
        assert out == [succ[t].item() for t in chain[:-1]]
    # Every layer's all-reduces ran (attention, MoE, embedding) over the group of one; the
    # vocab gathers gathered this rank's part alone.
    assert len(reduces) > 3 * cfg.num_layers * 24
    assert gathers and all(n == m for n, m in gathers)


def test_scratch_steps_route_like_real_tokens():
    """The benchmarks' scratch decode and verify draw tokens the share embeds: ids past its
    vocab slice embed to zero in a group of one, and zero router inputs tie every expert."""
    from flashtree.bench.timing import Scratch
    from flashtree.layers.moe import SparseMoE

    with rank_share("tp4"):
        target, cfg, drafter = random_rank("tiny-mla", torch.float32, "cpu", int4_group=GROUP,
                                           moe_intermediate_size=MOE_INTER)
        llm = rank_llm(target, cfg, drafter, spec="dflash", block_size=BLOCK, max_num_seqs=8,
                       max_model_len=256)
        inputs = []
        for layer in (m for m in target.modules() if isinstance(m, SparseMoE)):
            layer.gate.register_forward_hook(lambda _m, i, _o: inputs.append(i[0]))
        with Scratch(llm) as scratch:
            scratch.decode(8, 32)()
            scratch.verify(8, 32, tree=False)()
            scratch.verify(8, 32, tree=True)()
        assert inputs and all((x.norm(dim=-1) > 0).all() for x in inputs)


def test_share_layout_refusals():
    for bad in ("tp", "ep8ep2", "pp8", "tp8ep"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)
    assert [parse_layout(s) for s in ("tp8", "ep8", "tp8ep2", "tp1")] == [
        (8, 1), (8, 8), (8, 2), (1, 1)]
    from flashtree.distributed import init_rank_share

    for tp, ep, rank in ((8, 3, 0), (8, 8, 8), (4, 8, 0)):
        with pytest.raises(ValueError, match="rank"):
            init_rank_share(tp, ep, "gloo", "tcp://127.0.0.1:1", rank)
    assert not dist.is_initialized()


def test_kimi_drafter_is_the_seeds():
    """The Kimi drafter random_rank builds: 6 bf16 layers at the target's width, blocks of 8,
    about 6.5 GB whole (counted by plan from its config, not built)."""
    from flashtree.bench.random_pair import DRAFTER_LAYOUT, _drafter_config
    from flashtree.bench.shapes import DRAFTERS, KIMI_K26
    from flashtree.models.dflash import DFlashConfig

    layers, block = DRAFTER_LAYOUT["kimi-k2.6"]
    d = DFlashConfig.from_hf(_drafter_config(61, DRAFTERS["kimi-k2.6"], layers, block))
    assert (d.layers.num_layers, d.block_size, d.layers.hidden_size) == (
        6, 8, KIMI_K26["hidden_size"])
    whole = 2 * sum(p.per_gpu for p in drafter_parts(d, 1))
    assert 6.3e9 < whole < 6.9e9, whole


def test_repeated_layers_share_weights_and_compute_as_copies_would():
    """`built_layers`: the layers past those built share a built MoE layer's weights (no
    tensor copied) and write their own KV cache layer; a step's floor counts their bytes; an
    engine over them commits the tokens and fills the KV cache bit for bit as one over a model
    whose extra layers are independent copies (plain `deepcopy`)."""
    kw = dict(int4_group=GROUP, moe_intermediate_size=MOE_INTER)
    with rank_share("tp4"):
        deep, cfg, drafter = random_rank("tiny-mla", torch.float32, "cpu", layers=6,
                                         built_layers=3, **kw)
        copied, built_cfg, _ = random_rank("tiny-mla", torch.float32, "cpu", layers=3, **kw)
        for i, j in ((3, 1), (4, 2), (5, 1)):  # layer 0 is dense: the MoE layers repeat
            mine, source = deep.layers[i], deep.layers[j]
            assert mine is not source and mine.self_attn.layer == i
            assert [p.data_ptr() for p in mine.parameters()] == [
                p.data_ptr() for p in source.parameters()]
            layer = copy.deepcopy(copied.layers[j])
            layer.self_attn.layer = i
            copied.layers.append(layer)
        copied.cfg = replace(built_cfg, num_layers=6, moe=replace(
            built_cfg.moe, sparse_layers=built_cfg.moe.sparse_layers + (True,) * 3))
        assert cfg == copied.cfg
        assert weight_bytes(deep)[1] == weight_bytes(copied)[1]  # a step reads every layer's
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        runs = []
        for target in (deep, copied):
            llm = rank_llm(target, target.cfg, drafter, spec="dflash", block_size=BLOCK,
                           max_num_seqs=2, max_model_len=256)
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate([[5, 9, 2, 7]] * 2,
                                                                          params)]
            runs.append((tokens, llm.engine.cache.k.clone()))
        held = {i: {t.data_ptr() for t in _tensors_within(deep.layers[i]).values()}
                for i in range(6)}
        assert held[3] == held[5] == held[1] and held[4] == held[2]  # still, after serving
    (deep_tokens, deep_k), (copied_tokens, copied_k) = runs
    assert deep_tokens == copied_tokens and torch.equal(deep_k, copied_k)
    assert all(deep_k[i].abs().sum() > 0 for i in range(6))  # every layer wrote its own
