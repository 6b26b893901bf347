"""The benchmark toolkit (flashtree/bench/): goals defined once and reported as measured, the step
timer's check that a step replayed a CUDA graph, floors against closed forms of the shapes,
the shapes against the checkpoints they stand for, and random checkpoints that transformers
decodes as flashtree does."""

from __future__ import annotations

import ast
import dataclasses
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.floors import step_floor_bytes, weight_bytes
from flashtree.bench.random_pair import random_drafter, random_target, save_drafter, save_target
from flashtree.bench.results import GOALS, write_results
from flashtree.bench.shapes import DRAFTERS, SHAPES, TINY, TINY_MOE, moe_layer, with_layers
from flashtree.bench.timing import EagerFallback, Scratch, replay_ms, step_ms
from flashtree.graphs.runner import GraphRunner
from flashtree.graphs.schema import GraphKey, GraphMode
from flashtree.models.config import ModelConfig
from tests.bench.scripts import REPO, check_goals
from tests.graphs.inputs import DIMS, make_inputs, model_like


def test_every_goal_is_defined_once_in_the_registry():
    """Goal(...) appears in flashtree/bench/results.py only, once per key."""
    keys = []
    for path in [REPO / "flashtree/bench/results.py", *sorted((REPO / "benchmarks").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Goal":
                assert path.name == "results.py", f"a goal defined in {path}"
                keys.append(node.args[0].value)
    assert len(keys) == len(set(keys)) == len(GOALS), keys


def test_benchmark_scripts_share_only_the_toolkit():
    """At most 8 scripts and 3,000 lines; none imports another or edits sys.path."""
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert len(scripts) <= 8
    assert sum(len(p.read_text().splitlines()) for p in scripts) <= 3000
    for path in scripts:
        text = path.read_text()
        assert "sys.path" not in text, path
        imported = [n.module or "" for n in ast.walk(ast.parse(text))
                    if isinstance(n, ast.ImportFrom)]
        assert not any(m.startswith("benchmarks") for m in imported), path


def test_results_json_and_goals_table_agree(tmp_path):
    out = tmp_path / "r.md"
    # Values at the thresholds of a >= and a > goal: met, and not met.
    data = {"ar_step_over_floor": 1.1, "draft_over_ar_step": 0.3, "verify64_over_ar_step": None,
            "ddtree_over_dflash_e2e": float("nan"), "ttft_off_over_on": 5.0,
            "ar_speed_over_compiled_peer": 1.0, "rows": [1.5, float("inf")]}
    keys = tuple(k for k in data if k != "rows")
    written = write_results(out, "t", ["## body"], data, keys)
    on_disk = json.loads(out.with_suffix(".json").read_text())  # strict JSON: no NaN
    assert on_disk == written and on_disk["rows"] == [1.5, None]
    assert on_disk["ddtree_over_dflash_e2e"] is None  # NaN: not measured
    assert [on_disk["goals"][k]["met"] for k in keys] == [True, False, None, None, True, False]
    assert on_disk["machine"]["cores"] >= 1 and on_disk["command"].startswith("python")
    check_goals(out, on_disk, keys)
    assert out.read_text().rstrip().endswith("## body")


@pytest.fixture(scope="module")
def tiny_llm():
    target, cfg = random_target(TINY, torch.float32, "cpu")
    return LLM.from_modules(target, cfg, spec="none", max_num_seqs=4, max_model_len=256)


def test_step_ms_refuses_an_eager_step_where_graphs_are_captured(tiny_llm, monkeypatch):
    with Scratch(tiny_llm) as s:
        assert step_ms(tiny_llm, s.decode(1, 16), reps=2) > 0  # no graphs here: nothing owed
        # The runner as an engine that captured CUDA graphs leaves it, none holding this
        # batch: the forward falls back to eager (ModelRunner._replay finds no bucket).
        graphs = GraphRunner(model_like, DIMS, torch.device("cpu"), [1])
        graphs.use_cuda_graphs = True
        monkeypatch.setattr(tiny_llm.engine.runner, "graphs", graphs)
        with pytest.raises(EagerFallback, match="0 graph replays in 3 timed calls"):
            step_ms(tiny_llm, s.decode(1, 16), reps=2, warmup=1)


def test_scratch_gives_back_the_pages_of_a_batch_the_pool_could_not_hold(tiny_llm):
    """A batch too big for the KV pool raises OutOfPages part way (the benchmark then skips
    that batch); the requests reserved before it must not keep their pages."""
    from flashtree.kv.cache import OutOfPages

    pages = tiny_llm.engine.pages
    free = pages.num_free
    with Scratch(tiny_llm) as s, pytest.raises(OutOfPages):
        s.take(free, 200, 1)  # ~13 pages each: the pool holds a few of them
    assert pages.num_free == free


class _Graph:
    """Stands in for a captured CUDA graph (CPU): replaying it runs nothing."""

    def replay(self) -> None:
        pass


def test_graph_runner_counts_replays_not_eager_runs():
    runner = GraphRunner(model_like, DIMS, torch.device("cpu"), [1, 2])
    runner.capture(GraphMode.DECODE, 1)
    inputs = make_inputs(GraphMode.DECODE, [1, 1], "cpu")
    runner.run(GraphMode.DECODE, 2, 1, inputs)  # no graph on a CPU: the forward runs eagerly
    assert runner.replays == 0
    runner._entries[GraphKey(GraphMode.DECODE, 2, 1)].graph = _Graph()
    runner.run(GraphMode.DECODE, 2, 1, inputs)
    assert runner.replays == 1


class _CountedGraph(_Graph):
    def __init__(self) -> None:
        self.replayed = 0

    def replay(self) -> None:
        self.replayed += 1


def test_replay_ms_times_the_one_graph_a_step_replayed_alone():
    """The guard's device time: the graph the step replayed, replayed again by itself (warm-up
    and reps); nothing where the step replayed none or several, or graphs are off."""
    runner = GraphRunner(model_like, DIMS, torch.device("cpu"), [1, 2])
    runner.capture(GraphMode.DECODE, 1)
    graph = _CountedGraph()
    runner._entries[GraphKey(GraphMode.DECODE, 2, 1)].graph = graph
    runner.use_cuda_graphs = True  # as an engine that captured graphs (captures_graphs)
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(
        graphs=runner, device=torch.device("cpu"))))
    inputs = make_inputs(GraphMode.DECODE, [1, 1], "cpu")
    step = partial(runner.run, GraphMode.DECODE, 2, 1, inputs)
    assert replay_ms(llm, step, reps=4) >= 0
    assert graph.replayed == 1 + 3 + 4 and runner.last_graph is graph  # step, warm-up, reps
    assert replay_ms(llm, lambda: (step(), step()), reps=4) is None
    assert replay_ms(llm, lambda: None, reps=4) is None
    runner.use_cuda_graphs = False
    assert replay_ms(llm, step, reps=4) is None


def _dense_bytes(shape: dict, layers: int, experts: bool) -> int:
    """float32 bytes a Qwen3 decode step reads besides routed experts, from the config: per
    layer q, k, v, o, q/k norms, two norms (and the router); the final norm and LM head."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    mlp = 0 if experts else 3 * h * shape["intermediate_size"]
    router = shape["num_experts"] * h if experts else 0
    per_layer = h * (q + 2 * kv) + q * h + 2 * d + 2 * h + mlp + router
    return 4 * (layers * per_layer + h + shape["vocab_size"] * h)


def test_floors_match_the_shapes_closed_forms():
    target, cfg = random_target(TINY, torch.float32, "cpu")
    total, read = weight_bytes(target)
    assert read == _dense_bytes(TINY, 4, experts=False)
    assert total - read == 4 * TINY["vocab_size"] * TINY["hidden_size"]  # the embedding
    moe, moe_cfg = random_target(TINY_MOE, torch.float32, "cpu")
    llm = LLM.from_modules(moe, moe_cfg, spec="none", max_num_seqs=4, max_model_len=256)
    expert = 4 * 3 * TINY_MOE["hidden_size"] * TINY_MOE["moe_intermediate_size"]
    kv = llm.engine.cache.bytes_per_token
    assert kv == 4 * 2 * 4 * 2 * 16  # fp32 x (K, V) x layers x kv heads x head_dim
    with Scratch(llm) as s:  # one token touches exactly top_k experts in each of 4 layers
        one = step_floor_bytes(llm, s.decode(1, 20), 20)
        assert one == _dense_bytes(TINY_MOE, 4, experts=True) + 4 * 2 * expert + 20 * kv
        three = step_floor_bytes(llm, s.decode(3, 20), 60) - 60 * kv
    touched = (three - _dense_bytes(TINY_MOE, 4, experts=True)) / expert
    assert 4 * 2 <= touched <= 4 * 6 and touched == int(touched)


def test_draft_floor_is_the_drafters_layers_the_lm_head_and_its_kv():
    """A draft block reads the drafter's 2 Qwen3 layers, its final and hidden norms and its fc
    (the target's 2 captured layers into the hidden size), the target's LM head, and its own
    KV: float32 K and V of 2 layers x 2 KV heads x head_dim 16 a token."""
    target, cfg = random_target(TINY, torch.float32, "cpu")
    drafter = random_drafter(cfg, DRAFTERS["tiny"], torch.float32, "cpu", layers=2, block_size=8)
    llm = LLM.from_modules(target, cfg, drafter, spec="dflash", max_num_seqs=2,
                           max_model_len=256)
    h = TINY["hidden_size"]
    layers_and_head = _dense_bytes(TINY, 2, experts=False)  # 2 layers, a norm, the LM head
    fc_and_hidden_norm = 4 * (2 * h * h + h)
    kv = 4 * 2 * 2 * 2 * 16
    assert step_floor_bytes(llm, None, 40, drafter=True) == (layers_and_head
                                                             + fc_and_hidden_norm + 40 * kv)


def test_shapes_state_the_configs_they_stand_for():
    fixture = json.loads((REPO / "tests/fixtures/kimi_k26/config.json").read_text())
    ignore = {"quantization", "quant_config", "quant_block", "weight_prefix", "eos_token_ids",
              "bos_token_id", "checkpoint_dtype"}
    kimi, real = (dataclasses.asdict(ModelConfig.from_hf(c)) for c in (SHAPES["kimi-k2.6"],
                                                                          fixture))
    assert {k: v for k, v in kimi.items() if k not in ignore} == {
        k: v for k, v in real.items() if k not in ignore}
    deepseek = ModelConfig.from_hf(SHAPES["deepseek-v3"])
    assert deepseek.moe.sparse_layers[:4] == (False, False, False, True)  # first_k_dense 3
    cut = ModelConfig.from_hf(with_layers(SHAPES["deepseek-v3"], 2, first_dense=1))
    assert cut.num_layers == 2 and cut.moe.sparse_layers == (False, True)
    hidden, layer = moe_layer("kimi-k2.6")
    assert (hidden, layer.num_experts, layer.top_k, layer.int4_group) == (7168, 384, 8, 32)
    assert moe_layer("qwen3-30b-a3b")[1].int4_group == 0
    with pytest.raises(ValueError, match="no MoE layers"):
        moe_layer("qwen3-8b")
    assert set(DRAFTERS) == set(SHAPES)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_saved_random_target_decodes_as_transformers_does(tmp_path, name):
    """The checkpoint loads in both engines, which decode the same greedy tokens: the
    permutation's images of the current token (a decisive target), and the saved drafter
    speculates losslessly over it."""
    from transformers import AutoModelForCausalLM

    target = save_target(tmp_path / "t", SHAPES[name], "cpu")
    drafter = save_drafter(tmp_path / "d", 4, DRAFTERS[name], 2, 8, "cpu")
    prompts = [[5, 9, 200], [77]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLM(
        model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=2,
        skip_tokenizer_init=True).generate(prompts, sp)]
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                              min_new_tokens=8, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens
    emb = hf.model.embed_tokens.weight
    succ = (emb @ hf.lm_head.weight.T).argmax(-1)  # the permutation's image of each token
    assert all(succ[t].item() == n for p, o in zip(prompts, ours) for t, n in zip(
        [p[-1], *o[:-1]], o))
    spec = LLM(model=str(target), draft=str(drafter), spec="ddtree", spec_policy="fixed",
               device="cpu", dtype="float32", max_num_seqs=2, skip_tokenizer_init=True)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == ours
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] and cfg["block_size"] == 8


def test_random_drafter_and_saved_drafter_share_their_config(tmp_path):
    _, cfg = random_target(TINY, torch.float32, "cpu")
    module = random_drafter(cfg, DRAFTERS["tiny"], torch.float32, "cpu", layers=2, block_size=8)
    saved = json.loads((save_drafter(tmp_path, 4, DRAFTERS["tiny"], 2, 8, "cpu")
                        / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == list(module.cfg.target_layer_ids)
    assert Path(tmp_path / "model.safetensors.index.json").exists()


def test_docs_cite_only_results_and_scripts_that_exist():
    """Every `benchmarks/...` path the README and docs/ name exists (results moved to
    benchmarks/results/archive/ with their citations), and every script they run as
    `python -m benchmarks.NAME` is one of benchmarks/."""
    import re

    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for path in re.findall(r"benchmarks/[\w./-]*\w", text):
            if "DATE" in path:  # a command's placeholder
                continue
            assert (REPO / path).exists() or (REPO / path).with_suffix(".py").exists(), (
                doc.name, path)
        for name in re.findall(r"python -m benchmarks\.([a-z]\w*)", text):
            assert (REPO / "benchmarks" / f"{name}.py").exists(), (doc.name, name)
