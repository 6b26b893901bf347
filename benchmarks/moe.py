"""MoE layers on one GPU, random weights built on the device.

  layers   one routed-expert layer of each --shapes (Qwen3-30B-A3B in bf16, Kimi K2.6 with its
           INT4 experts) at 1 to 128 tokens and 16- and 64-node verifies (the last two token
           counts): the per-expert loop, the grouped-GEMM kernels (`flashtree/layers/
           fused_moe.py`) eager and graph-replayed, against the layer's floor: the bytes of the
           distinct experts the tokens touch, the router and the shared experts at the copy
           bandwidth. `--tiles` times the routed experts alone per tile configuration of the
           kernels (how `fused_moe.default_tiles` was chosen); `--profile` lists a layer's
           kernels at one token
  predict  a PREDICTION, labelled as one, of Kimi K2.6's step time per layout (TPn, EPn) from
           a layers run's Kimi INT4 layer (--moe JSON, or this run's) and `flashtree plan`'s
           per-GPU bytes, with an assumed all-reduce latency

The whole MoE target's steps against their floor: `benchmarks/speculative.py --shape
qwen3-30b-a3b --sections steps --batches 1,8,32,128`.

    python -m benchmarks.moe --tiles --profile --out benchmarks/results/DATE-moe-gpu.md
    python -m benchmarks.moe --sections predict --moe benchmarks/results/DATE-moe-gpu.json \
        --out benchmarks/results/DATE-kimi-prediction.md
    python -m benchmarks.moe --shapes tiny-moe --device cpu --out /tmp/moe.md   # a check

On a CPU only the loop runs (a check of the script). JSON keys: `fused_over_loop_b1` (the
Qwen3 layer's loop over its fused time at one token), `int4_layer_over_floor_b1` (the Kimi
layer, graph-replayed, over its floor)."""

from __future__ import annotations

import argparse
import datetime
import json
import random
from functools import partial
from pathlib import Path

import torch

from flashtree.bench.floors import copy_bandwidth, floor_ms, moe_layer_bytes
from flashtree.bench.profile import profile_calls
from flashtree.bench.results import write_results
from flashtree.bench.shapes import moe_layer
from flashtree.bench.timing import graph_ms, median_ms
from flashtree.layers.moe import SparseMoE
from flashtree.models.config import ModelConfig
from flashtree.plan import _loaded_bytes, _read, kv_bytes_per_token, target_parts

TOKENS = (1, 8, 32, 128, 16, 64)  # the last two: a 16- and a 64-node tree verified at batch 1
TILE_CANDIDATES = {  # fused_moe.Tiles(block_n, block_k, num_warps, num_stages) for --tiles
    "dense": [(n, k, w, 3) for n in (32, 64, 128) for k in (64, 128) for w in (4, 8)],
    "int4": [(n, k, w, 3) for n in (32, 64, 128) for k in (128, 256) for w in (4, 8)],
}
STEPS = [("decode x1", 1, 1), ("decode x8", 8, 8), ("decode x32", 32, 32),
         ("decode x128", 128, 128), ("verify 16 nodes", 16, 1), ("verify 64 nodes", 64, 1)]
# Counted in the measured MoE layer time, so left out of the other weights.
IN_LAYER = ("routed_experts", "shared_experts", "routers", "embedding")


def build_layer(shape: str, device: torch.device, dtype: torch.dtype) -> SparseMoE:
    """The layer with random weights made on the device, its experts stacked as after a load."""
    hidden, cfg = moe_layer(shape)
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


@torch.inference_mode()
def layer_rows(shape: str, args, bandwidth: float) -> dict:
    """Per token count: the whole layer through the per-expert loop, and (CUDA) through the
    grouped GEMMs, eager and graph-replayed, against its floor."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer, fused = build_layer(shape, device, dtype), device.type == "cuda"
    rows = []
    for n in TOKENS:
        x = torch.randn(n, layer.gate.weight.shape[1], device=device).to(dtype)
        _, ids = layer.gate(x)
        row = {"tokens": n, "experts_touched": int(ids.unique().numel()),
               "floor_ms": floor_ms(moe_layer_bytes(layer, ids), bandwidth)}
        stacked, layer.stacked = layer.stacked, None  # the per-expert loop
        row["loop_ms"] = median_ms(lambda x=x: layer(x), device, args.reps)
        layer.stacked = stacked
        if fused:  # the same layer (router and shared experts included) through the kernels
            row["fused_ms"] = median_ms(lambda x=x: layer(x), device, args.reps)
            row["fused_graph_ms"] = graph_ms(lambda x=x: layer(x), args.reps)
        rows.append(row)
        print(shape, row, flush=True)
    out: dict = {"rows": rows}
    if fused:
        out.update(fused_over_loop_b1=rows[0]["loop_ms"] / rows[0]["fused_ms"],
                   layer_over_floor_b1=rows[0]["fused_graph_ms"] / rows[0]["floor_ms"])
    if args.tiles and fused:
        out["tiles"] = sweep_tiles(layer, dtype, args.reps)
    if args.profile:
        x = torch.randn(1, layer.gate.weight.shape[1], device=device).to(dtype)
        prof = profile_calls(lambda: layer(x), device, args.reps)
        out["profile"] = {k: prof[k] for k in ("wall_ms", "top", "launches")}
    return out


def sweep_tiles(layer: SparseMoE, dtype: torch.dtype, reps: int) -> list[dict]:
    """The routed experts alone (`fused_experts`, graph-replayed) per tile configuration and
    token count: which launch configuration to make the default for a shape."""
    from flashtree.layers.fused_moe import Tiles, fused_experts  # CUDA: triton is there

    rows = []
    for n in TOKENS:
        x = torch.randn(n, layer.gate.weight.shape[1], device="cuda").to(dtype)
        weights, ids = layer.gate(x)
        row = {"tokens": n}
        for tiles in TILE_CANDIDATES["int4" if layer.stacked.group else "dense"]:
            run = partial(fused_experts, x, layer.stacked, weights, ids, 0, Tiles(*tiles))
            row[",".join(map(str, tiles))] = graph_ms(run, reps)
        rows.append(row)
        print("tiles", row, flush=True)
    return rows


def fit_layer(rows: list[dict]) -> tuple[float, float]:
    """Least-squares (a, c) of graph ms = a + c * experts touched."""
    xs = [r["experts_touched"] for r in rows]
    ys = [r["fused_graph_ms"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - c * mx, c


def busiest_rank_experts(tokens: int, experts: int, top_k: int, ranks: int, trials: int,
                         rng: random.Random) -> float:
    """Mean over trials of the most distinct experts one of `ranks` equal expert groups
    serves, when `tokens` tokens each route to top_k distinct experts uniformly."""
    per_rank, total = experts // ranks, 0
    for _ in range(trials):
        touched = set()
        for _ in range(tokens):
            touched.update(rng.sample(range(experts), top_k))
        counts = [0] * ranks
        for e in touched:
            counts[e // per_rank] += 1
        total += max(counts)
    return total / trials


def expected_touched(tokens: int, experts: int, top_k: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** tokens)


def predict(measured: dict, args) -> dict:
    """Per layout and step, every layer's cost on one rank: its MoE layer (the one-GPU layer
    time fitted as a + c * experts touched, with the rank's share of the touched experts: 1 /
    tp of each under TP alone, or the busiest rank's whole experts under EP, uniform routing,
    Monte Carlo); the rest of its weights and its latent KV at the copy bandwidth, times the
    dense AR step's measured distance from its floor; two all-reduces of an ASSUMED latency.
    MLA is assumed graph-replayed and the shared expert charged unsliced, as the layer ran."""
    a, c = fit_layer(measured["shapes"]["kimi-k2.6"]["rows"])
    cfg = ModelConfig.from_hf(_read(args.config))
    moe, bandwidth = cfg.moe, measured["bandwidth"]
    assert moe is not None
    machine = measured["machine"]
    out = {"moe": str(args.moe or "this run"), "a_ms": a, "c_ms": c, "bandwidth": bandwidth,
           "machine_measured": machine.get("gpu") if isinstance(machine, dict)
           else machine.split(",")[0], "dense_over_floor": args.dense_over_floor,
           "allreduce_us": args.allreduce_us, "ctx": args.ctx, "prediction": True,
           "layouts": {}}
    for layout in args.layouts.split(","):
        n = int(layout[2:])
        tp, ep = (n, n) if layout.startswith("ep") else (n, 1)
        other = sum(p.per_gpu * _loaded_bytes(p, cfg, 2) for p in target_parts(cfg, tp, ep)
                    if p.name not in IN_LAYER)
        kv, rng, rows = kv_bytes_per_token(cfg, tp, 2), random.Random(0), []
        for name, tokens, batch in STEPS:
            if ep > 1:  # whole experts on tp / ep ranks each; the busiest group sets the pace
                share = busiest_rank_experts(tokens, moe.num_experts, moe.top_k, ep,
                                             args.trials, rng) / (tp // ep)
            else:
                share = expected_touched(tokens, moe.num_experts, moe.top_k) / tp
            routed = sum(moe.sparse_layers) * (a + c * share)
            rest = floor_ms(other + batch * args.ctx * kv, bandwidth) * args.dense_over_floor
            comm = 2 * cfg.num_layers * args.allreduce_us / 1e3 if tp > 1 else 0.0
            total = routed + rest + comm
            rows.append({"step": name, "moe_ms": routed, "other_ms": rest, "allreduce_ms": comm,
                         "ms": total, "tokens_per_s": batch / total * 1e3
                         if name.startswith("decode") else None})
        out["layouts"][layout] = rows
    return out


def report(res: dict) -> list[str]:
    lines = []
    if "bandwidth" in res:
        lines += [f"Copy bandwidth {res['bandwidth'] / 1e12:.3f} TB/s; a layer's floor is the "
                  "touched experts', router's and shared experts' weight bytes at it.", ""]
    for shape, r in res.get("shapes", {}).items():
        lines += [f"## {shape}", "", "| tokens | experts touched | floor ms | loop ms | fused ms "
                  "| fused (graph) ms | graph / floor |", "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            g = row.get("fused_graph_ms")
            lines.append(f"| {row['tokens']} | {row['experts_touched']} | {row['floor_ms']:.3f}"
                         f" | {row['loop_ms']:.3f} | {row.get('fused_ms', float('nan')):.3f} | "
                         + ("- | -" if g is None else f"{g:.3f} | {g / row['floor_ms']:.2f}")
                         + " |")
        if "fused_over_loop_b1" in r:
            lines += ["", f"Fused over loop at one token: {r['fused_over_loop_b1']:.2f}x."]
        if r.get("tiles"):
            configs = [k for k in r["tiles"][0] if k != "tokens"]
            lines += ["", "Routed experts alone, graph-replayed, ms per tile configuration "
                      "(block_n, block_k, warps, stages):", "",
                      "| tokens | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
            lines += [f"| {t['tokens']} | " + " | ".join(f"{t[c]:.3f}" for c in configs) + " |"
                      for t in r["tiles"]]
        if r.get("profile"):
            lines += ["", "One eager forward at one token, per kernel (CPU ops off CUDA):", "",
                      "| kernel | ms | launches |", "|---|---|---|"]
            lines += [f"| `{k}` | {ms:.4f} | {n:.0f} |" for k, ms, n in r["profile"]["top"]]
        lines.append("")
    p = res.get("predict")
    if p:
        lines += ["## Kimi K2.6 step time per layout: a PREDICTION", "",
                  f"From `{p['moe']}` (Kimi-shaped INT4 layer on one {p['machine_measured']}: a = "
                  f"{p['a_ms']:.3f} ms + c = {p['c_ms']:.4f} ms per touched expert) and "
                  f"`flashtree plan`'s per-GPU bytes; bandwidth {p['bandwidth'] / 1e12:.2f} "
                  f"TB/s x {p['dense_over_floor']:.2f} (the dense AR step over its floor); "
                  f"all-reduce latency **assumed** {p['allreduce_us']:.0f} us; context "
                  f"{p['ctx']}; MLA assumed graph-replayed. Not measured.", ""]
        for layout, rows in p["layouts"].items():
            lines += [f"### {layout}", "", "| step | MoE ms | other weights + KV ms | "
                      "all-reduce ms | step ms | tokens/s |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['step']} | {r['moe_ms']:.2f} | {r['other_ms']:.2f} | "
                      f"{r['allreduce_ms']:.2f} | {r['ms']:.2f} | " + (
                          "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}")
                      + " |" for r in rows] + [""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="layers", help="layers, predict or both")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,kimi-k2.6", help="MoE layer shapes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", action="store_true", help="also sweep the kernels' tiles")
    ap.add_argument("--profile", action="store_true", help="also profile each layer")
    ap.add_argument("--moe", type=Path, help="predict: a layers run's JSON (default: this run)")
    ap.add_argument("--config", default=Path(__file__).resolve().parents[1] / "tests" /
                    "fixtures" / "kimi_k26" / "config.json", help="predict: the model's config")
    ap.add_argument("--layouts", default="tp8,ep8", help="predict: tpN or epN (EP over N=TP)")
    ap.add_argument("--allreduce-us", type=float, default=20.0,
                    help="predict: assumed latency of one small all-reduce")
    ap.add_argument("--dense-over-floor", type=float, default=1.55,
                    help="predict: the dense AR step over its floor (the speculative "
                         "benchmark's ar_step_over_floor on the H200)")
    ap.add_argument("--ctx", type=int, default=1024, help="predict: context tokens")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results") / f"{datetime.date.today()}-moe.md")
    args = ap.parse_args()
    device, sections = torch.device(args.device), args.sections.split(",")
    res: dict = {}
    if "layers" in sections:
        res["bandwidth"] = copy_bandwidth(device, 256 if device.type == "cuda" else 16, 10)
        res["shapes"] = {}
        for shape in args.shapes.split(","):
            res["shapes"][shape] = layer_rows(shape, args, res["bandwidth"])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        shapes = res["shapes"]
        if "fused_over_loop_b1" in shapes.get("qwen3-30b-a3b", {}):
            res["fused_over_loop_b1"] = shapes["qwen3-30b-a3b"]["fused_over_loop_b1"]
        if "layer_over_floor_b1" in shapes.get("kimi-k2.6", {}):
            res["int4_layer_over_floor_b1"] = shapes["kimi-k2.6"]["layer_over_floor_b1"]
    if "predict" in sections:
        measured = (json.loads(args.moe.read_text()) if args.moe
                    else {**res, "machine": {"gpu": torch.cuda.get_device_name(0)
                                             if device.type == "cuda" else "CPU"}})
        res["predict"] = predict(measured, args)
    title = ("MoE layers: grouped GEMMs against the per-expert loop" if "layers" in sections
             else "Kimi K2.6's step time per layout: a prediction")
    write_results(args.out, title, report(res), res)


if __name__ == "__main__":
    main()
