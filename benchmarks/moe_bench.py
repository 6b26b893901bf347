"""MoE at speed, random weights built on the device. One routed-expert layer of a real shape: the
grouped-GEMM kernels (`flashtree/layers/fused_moe.py`, eager and graph-replayed) against the
per-expert loop they replace, per token count (decode batches, and verify trees of 16 and 64
nodes at batch 1), against the layer's bandwidth floor: the bytes of the distinct experts the
tokens touch, the router and the shared experts, at the measured copy bandwidth. Then a whole
Qwen3-30B-A3B-shaped target: decode steps at batch 1 to 128 and 16- and 64-node verifies,
against the same kind of floor (with the KV read).

    python benchmarks/moe_bench.py --shapes qwen3-30b-a3b,kimi-k2.6 --out moe.md
    python benchmarks/moe_bench.py --shapes tiny --model tiny-moe --device cpu --ctx 32 \
        --out /tmp/moe.md   # a check

Shapes: Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top-8, bf16) and Kimi K2.6 (hidden
7168, 384 experts of 2048, top-8, sigmoid routing with a selection bias, one shared expert,
routed experts INT4 in groups of 32 as Kimi ships them). The JSON beside the report carries
`fused_over_loop_b1` (the Qwen3 layer's loop time over its fused time at one token),
`int4_layer_over_floor_b1` (the Kimi layer, graph-replayed, over its floor),
`moe_ar_step_over_floor_b1` and `moe_verify64_over_ar_step` (the whole target). On a CPU only
the loop runs (a check of the script)."""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_bench import (  # noqa: E402
    Scratch,
    copy_bandwidth,
    median_ms,
    sync,
    verify_forward,
)
from benchmarks.results_file import write_results  # noqa: E402
from flashtree import LLM  # noqa: E402
from flashtree.bench.random_pair import SHAPES as MODEL_SHAPES  # noqa: E402
from flashtree.bench.random_pair import random_drafter, random_target  # noqa: E402
from flashtree.config import MoEConfig  # noqa: E402
from flashtree.layers.moe import SparseMoE  # noqa: E402
from flashtree.runner.forward_batch import BatchItem, Mode  # noqa: E402

SHAPES = {  # hidden, MoEConfig arguments, INT4 group (0: bf16 experts)
    "qwen3-30b-a3b": (2048, dict(num_experts=128, top_k=8, intermediate_size=768), 0),
    "kimi-k2.6": (7168, dict(num_experts=384, top_k=8, intermediate_size=2048,
                             scoring_func="sigmoid", topk_method="noaux_tc",
                             routed_scaling_factor=2.827, num_shared_experts=1,
                             router_fp32=True), 32),
    "tiny": (64, dict(num_experts=8, top_k=2, intermediate_size=32), 16),
}
TOKENS = (1, 8, 32, 128, 16, 64)  # the last two: a 16- and a 64-node tree verified at batch 1
BATCHES = (1, 8, 32, 128)  # the whole model's decode steps


def build_layer(shape: str, device: torch.device, dtype: torch.dtype) -> SparseMoE:
    """The layer with random weights made on the device, its experts stacked as after a load."""
    hidden, moe_args, group = SHAPES[shape]
    cfg = MoEConfig(**moe_args, sparse_layers=(True,), int4_group=group)
    with torch.device(device):
        layer = SparseMoE(cfg, hidden)
    layer.to(dtype)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype == torch.int32:  # packed INT4 words: any bits are valid nibbles
                p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=device,
                                      dtype=torch.int32))
            elif name.endswith("weight_shape"):
                continue
            elif name.endswith("weight_scale"):
                p.copy_(torch.rand(p.shape, generator=gen, device=device) * 0.02)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1]**-0.5)
    layer.weights_loaded()
    return layer


def expert_bytes(layer: SparseMoE) -> int:
    """Weight bytes of one routed expert as the layer holds it."""
    return sum(p.numel() * p.element_size()
               for n, p in next(iter(layer.experts.values())).named_parameters()
               if not n.endswith("weight_shape"))


def floor_bytes(layer: SparseMoE, ids: torch.Tensor) -> int:
    """Weight bytes one forward must read: the distinct routed experts touched, the router, the
    shared experts."""
    rest = sum(p.numel() * p.element_size() for n, p in layer.named_parameters()
               if not n.startswith("experts."))
    return ids.unique().numel() * expert_bytes(layer) + rest


def measure(shape: str, args: argparse.Namespace, bandwidth: float) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = build_layer(shape, device, dtype)
    fused = device.type == "cuda"
    rows = []
    for n in TOKENS:
        x = torch.randn(n, SHAPES[shape][0], device=device).to(dtype)
        rows.append(time_tokens(layer, x, bandwidth, fused, args.reps))
        print(shape, rows[-1], flush=True)
    if not fused:
        return {"rows": rows}
    one = rows[0]
    return {"rows": rows, "fused_over_loop_b1": one["loop_ms"] / one["fused_ms"],
            "layer_over_floor_b1": one["fused_graph_ms"] / one["floor_ms"]}


@torch.inference_mode()
def time_tokens(layer: SparseMoE, x: torch.Tensor, bandwidth: float, fused: bool,
                reps: int) -> dict:
    """One row: the whole layer through the per-expert loop, and through the grouped GEMMs."""
    device = x.device
    _, ids = layer.gate(x)
    row = {"tokens": x.shape[0], "experts_touched": int(ids.unique().numel()),
           "floor_ms": floor_bytes(layer, ids) / bandwidth * 1e3}
    stacked, layer.stacked = layer.stacked, None  # the per-expert loop
    row["loop_ms"] = median_ms(lambda: layer(x), device, reps)
    layer.stacked = stacked
    if fused:  # the same layer (router and shared experts included) through the kernels
        row["fused_ms"] = median_ms(lambda: layer(x), device, reps)
        row["fused_graph_ms"] = graph_ms(lambda: layer(x), reps)
    return row


def measure_model(shape: str, args: argparse.Namespace, bandwidth: float) -> dict:
    """The whole random-weight target (`flashtree/bench/random_pair.py`): decode steps at
    BATCHES and 16- and 64-node verifies at batch 1, after `--ctx` tokens, each against its
    floor: every weight but the embedding table, the distinct experts each layer's tokens
    touch, and the KV read. As the engine runs them: graph-replayed where it captures graphs
    (a DFlash engine for decode and the 16-token chain, a DDTree budget-63 one for 64 nodes)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, cfg = random_target(MODEL_SHAPES[shape], dtype, device)
    drafter = random_drafter(cfg, MODEL_SHAPES[shape], dtype, device, layers=1)
    touched = ExpertsTouched(model)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts." not in n and not n.startswith("embed_tokens"))
    per_expert = expert_bytes(next(m for m in model.modules() if isinstance(m, SparseMoE)))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    max_len = args.ctx + 128
    rows = []
    for spec, budget, steps in (("dflash", None, [*BATCHES, 16]), ("ddtree", 63, [64])):
        # Every case's scratch requests hold their pages at once.
        llm = LLM.from_modules(model, cfg, drafter, spec=spec, tree_budget=budget,
                               max_num_seqs=max(BATCHES), max_model_len=max_len,
                               kv_cache_pages=(sum(BATCHES) + 2) * math.ceil(max_len / 16))
        with Scratch(llm) as s, torch.inference_mode():
            cases = [(f"decode x{b}", b, decode_forward(llm, s, b, args.ctx, cfg.vocab_size))
                     for b in steps if b in BATCHES]
            cases += [(f"verify {n} nodes", 1, verify_forward(llm, s, n, args.ctx,
                                                              cfg.vocab_size))
                      for n in steps if n in (16, 64)]
            for name, batch, run in cases:
                with touched, eager(llm):  # the routers' hooks fire outside graphs only
                    run()
                floor = dense + touched.total * per_expert + batch * args.ctx * kv_per_token
                rows.append({"step": name,
                             "experts_touched_per_layer": touched.total / cfg.num_layers,
                             "floor_ms": floor / bandwidth * 1e3,
                             "ms": median_ms(run, device, args.reps)})
                print(shape, rows[-1], flush=True)
        llm.shutdown()
    ar = {r["step"]: r for r in rows}
    return {"rows": rows, "moe_ar_step_over_floor_b1": ar["decode x1"]["ms"] /
            ar["decode x1"]["floor_ms"],
            "moe_verify64_over_ar_step": ar["verify 64 nodes"]["ms"] / ar["decode x1"]["ms"]}


@contextmanager
def eager(llm: LLM):
    """The engine's forwards run eagerly while entered."""
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def decode_forward(llm: LLM, s: Scratch, batch: int, ctx: int, vocab: int):
    """One DECODE forward of `batch` scratch requests after `ctx` tokens of KV, each on its
    own random token (so that the batch routes to as many experts as a real one)."""
    gen = random.Random(batch)
    items = [BatchItem(sid, ctx, [gen.randrange(vocab)]) for sid in s.take(batch, ctx, 1)]
    return lambda: llm.engine.runner.forward(Mode.DECODE, items)


class ExpertsTouched:
    """While entered, counts the distinct experts each MoE layer's router picks (a host read
    per layer: outside timed runs only)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m.gate for m in model.modules() if isinstance(m, SparseMoE)]
        self.total, self._hooks = 0, []

    def __enter__(self) -> ExpertsTouched:
        self.total = 0

        def count(_module, _inputs, output) -> None:
            self.total += int(output[1].unique().numel())
        self._hooks = [r.register_forward_hook(count) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()


TILE_CANDIDATES = {  # fused_moe.Tiles(block_n, block_k, num_warps, num_stages) for --tiles
    "dense": [(n, k, w, 3) for n in (32, 64, 128) for k in (64, 128) for w in (4, 8)],
    "int4": [(n, k, w, 3) for n in (32, 64, 128) for k in (128, 256) for w in (4, 8)],
}


@torch.inference_mode()
def sweep_tiles(shape: str, args: argparse.Namespace) -> list[dict]:
    """The routed experts alone (`fused_experts`, graph-replayed) per tile configuration and
    token count: which launch configuration to make the default for a shape."""
    from flashtree.layers.fused_moe import Tiles, fused_experts  # CUDA: triton is there

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = build_layer(shape, device, dtype)
    assert layer.stacked is not None
    rows = []
    for n in TOKENS:
        x = torch.randn(n, SHAPES[shape][0], device=device).to(dtype)
        weights, ids = layer.gate(x)
        row = {"tokens": n}
        for tiles in TILE_CANDIDATES["int4" if layer.stacked.group else "dense"]:
            run = partial(fused_experts, x, layer.stacked, weights, ids, 0, Tiles(*tiles))
            row[",".join(map(str, tiles))] = graph_ms(run, args.reps)
        rows.append(row)
        print(shape, "tiles", row, flush=True)
    return rows


@torch.inference_mode()
def kernel_profile(shape: str, args: argparse.Namespace, tokens: int = 1) -> list[tuple]:
    """GPU time per kernel of one eager layer forward at `tokens` tokens: where a layer's time
    goes when it is launch-bound. -> [(kernel, calls, total us)], largest first."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = build_layer(shape, device, dtype)
    x = torch.randn(tokens, SHAPES[shape][0], device=device).to(dtype)
    for _ in range(3):
        layer(x)
    sync(device)
    kind = (torch.profiler.ProfilerActivity.CUDA if device.type == "cuda"
            else torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=[kind]) as prof:
        for _ in range(args.reps):
            layer(x)
        sync(device)
    rows = [(e.key[:70], e.count // args.reps,
             (e.device_time_total if device.type == "cuda" else e.self_cpu_time_total)
             / args.reps) for e in prof.key_averages()]
    rows = [r for r in rows if r[2] > 0]
    return sorted(rows, key=lambda r: -r[2])


def graph_ms(fn, reps: int) -> float:
    """Median ms of `fn` captured in a CUDA graph and replayed (no launch overhead)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, torch.device("cuda"), reps)


def summary(res: dict) -> dict:
    """The issue's keys, from the sections present: the bf16 layer's fused speed over the loop,
    the INT4 layer's and the whole target's step over their floors, verify 64 over decode."""
    shapes, out = res["shapes"], {}
    if "fused_over_loop_b1" in shapes.get("qwen3-30b-a3b", {}):
        out["fused_over_loop_b1"] = shapes["qwen3-30b-a3b"]["fused_over_loop_b1"]
    if "layer_over_floor_b1" in shapes.get("kimi-k2.6", {}):
        out["int4_layer_over_floor_b1"] = shapes["kimi-k2.6"]["layer_over_floor_b1"]
    model = res.get("model", {})
    out.update({k: model[k] for k in ("moe_ar_step_over_floor_b1", "moe_verify64_over_ar_step")
                if k in model})
    return out


def report(res: dict) -> str:
    lines = ["# MoE layer: grouped GEMMs against the per-expert loop", "",
             f"Machine: {res['machine']}. Command: `{res['command']}`. Copy bandwidth "
             f"{res['bandwidth'] / 1e12:.2f} TB/s; the floor is the touched experts', router's "
             "and shared experts' weight bytes at that bandwidth.", ""]
    for shape, r in res["shapes"].items():
        lines += [f"## {shape}", "", "| tokens | experts touched | floor ms | loop ms | fused ms "
                  "| fused (graph) ms | graph / floor |", "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            g = row.get("fused_graph_ms")
            graph = "- | -" if g is None else f"{g:.3f} | {g / row['floor_ms']:.2f}"
            lines.append(
                f"| {row['tokens']} | {row['experts_touched']} | {row['floor_ms']:.3f} | "
                f"{row['loop_ms']:.3f} | {row.get('fused_ms', float('nan')):.3f} | {graph} |")
        if "fused_over_loop_b1" in r:
            lines += ["", f"Fused over loop at one token: {r['fused_over_loop_b1']:.2f}x."]
        if r.get("tiles"):
            configs = [k for k in r["tiles"][0] if k != "tokens"]
            lines += ["", "Routed experts alone, graph-replayed, ms per tile configuration "
                      "(block_n, block_k, warps, stages):", "",
                      "| tokens | " + " | ".join(configs) + " |",
                      "|---|" + "---|" * len(configs)]
            lines += [f"| {t['tokens']} | " + " | ".join(f"{t[c]:.3f}" for c in configs) + " |"
                      for t in r["tiles"]]
        if r.get("profile"):
            lines += ["", "One eager forward at one token, GPU time per kernel:", "",
                      "| kernel | calls | us |", "|---|---|---|"]
            lines += [f"| `{k}` | {c} | {us:.1f} |" for k, c, us in r["profile"]]
        lines.append("")
    model = res.get("model")
    if model:
        lines += [f"## Whole {model['shape']}-shaped target (context {res['ctx']})", "",
                  "| step | experts touched per layer | floor ms | ms | / floor |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['experts_touched_per_layer']:.1f} | {r['floor_ms']:.3f} "
                  f"| {r['ms']:.3f} | {r['ms'] / r['floor_ms']:.2f} |" for r in model["rows"]]
        lines += ["", f"`moe_ar_step_over_floor_b1` {model['moe_ar_step_over_floor_b1']:.2f}, "
                  f"`moe_verify64_over_ar_step` {model['moe_verify64_over_ar_step']:.2f}.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,kimi-k2.6", help="MoE layers, or none")
    ap.add_argument("--model", default="qwen3-30b-a3b",
                    help="whole target of this shape (random_pair.SHAPES), or none")
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens of the model steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", action="store_true",
                    help="also sweep the grouped GEMMs' tile configurations per layer shape")
    ap.add_argument("--profile", action="store_true",
                    help="also list each layer's kernels' GPU time at one token")
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()
    res = {"machine": f"{name or 'CPU'}, torch {torch.__version__}",
           "command": "python benchmarks/moe_bench.py " + " ".join(sys.argv[1:]),
           "bandwidth": copy_bandwidth(device, 256 if device.type == "cuda" else 16, 10),
           "ctx": args.ctx, "shapes": {}}
    for shape in [] if args.shapes == "none" else args.shapes.split(","):
        t = time.time()
        res["shapes"][shape] = measure(shape, args, res["bandwidth"])
        if args.tiles:
            res["shapes"][shape]["tiles"] = sweep_tiles(shape, args)
        if args.profile:
            res["shapes"][shape]["profile"] = kernel_profile(shape, args)
        print(f"[{shape}: {time.time() - t:.0f} s]", flush=True)
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.model != "none":
        res["model"] = {"shape": args.model, **measure_model(args.model, args, res["bandwidth"])}
    res.update(summary(res))
    write_results(args.out, report(res), res)


if __name__ == "__main__":
    main()
