"""MoE layers on one GPU, random weights built on the device.

  layers   one routed-expert layer of each --shapes (Qwen3-30B-A3B in bf16, Kimi K2.6 with its
           INT4 experts; with --layout, one rank's share of it) at 1 to 128 tokens and 16- and
           64-node verifies (the last two token counts): the per-expert loop, the grouped-GEMM
           kernels (`flashtree/layers/fused_moe.py`) eager and graph-replayed, against the
           layer's floor: the bytes of the distinct experts the tokens touch, the router and
           the shared experts at the copy bandwidth. `--tiles` times the routed experts alone
           per tile configuration of the kernels (how `fused_moe.default_tiles` was chosen);
           `--profile` lists a layer's kernels at one token
  kimi     Kimi K2.6 per rank from measured runs: `benchmarks/speculative.py --layout` JSONs
           (--ranks) and a layers run of the rank's layer (--moe), with a PREDICTION, labelled
           as one, for 8 GPUs: the rank's measured time plus the collectives it launched, each
           at an ASSUMED all-reduce latency

The whole MoE target's steps against their floor: `benchmarks/speculative.py --shape
qwen3-30b-a3b --sections steps --batches 1,8,32,128`.

    python -m benchmarks.moe --tiles --profile --out benchmarks/results/DATE-moe-gpu.md
    benchmarks/kimi_rank.sh OUT_DIR  # every run the kimi section reads, on one H200, then it

On a CPU only the loop runs (a check of the script). JSON keys: `fused_over_loop_b1` (the
Qwen3 layer's loop over its fused time at one token), `int4_layer_over_floor_b1` (the Kimi
layer, graph-replayed, over its floor), `moe_layer_fixed_us` and `int4_expert_bw_fraction`
(the Kimi layer's fit and its worst bandwidth share at 8-128 tokens) and the kimi section's
goals (`flashtree/bench/kimi.py`)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
from functools import partial
from pathlib import Path

import torch

from flashtree.bench.floors import copy_bandwidth, floor_ms, local_experts_touched, moe_layer_bytes
from flashtree.bench.kimi import KIMI_GOALS, fit_layer, kimi_ranks, kimi_report
from flashtree.bench.profile import profile_calls
from flashtree.bench.random_pair import fill_random, rank_share
from flashtree.bench.results import write_results
from flashtree.bench.shapes import moe_layer
from flashtree.bench.timing import graph_ms, median_ms
from flashtree.layers.moe import SparseMoE

TOKENS = (1, 8, 32, 128, 16, 64)  # the last two: a 16- and a 64-node tree verified at batch 1
TILE_CANDIDATES = {  # fused_moe.Tiles(block_n, block_k, num_warps, num_stages) for --tiles
    "dense": [(n, k, w, 3) for n in (32, 64, 128) for k in (64, 128) for w in (4, 8)],
    "int4": [(n, k, w, 3) for n in (32, 64, 128) for k in (128, 256) for w in (4, 8)],
    # fused_moe.PairTiles(block_n, block_k, down_block_n, down_block_k, num_warps,
    # split_per_sm): INT4 pairs
    "pairs": [(n, k, dn, 256, w, f) for n in (8, 16, 32) for k in (256, 512) for dn in (8, 16)
              for w in (4, 8) for f in (2, 4, 8)],
}

def build_layer(shape: str, device: torch.device, dtype: torch.dtype) -> SparseMoE:
    """The layer with random weights made on the device, its experts stacked as after a load."""
    hidden, cfg = moe_layer(shape)
    with torch.device(device):
        layer = SparseMoE(cfg, hidden)
    layer.to(dtype)
    fill_random(layer, torch.Generator(device).manual_seed(0), int4_group=cfg.int4_group)
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
        row = {"tokens": n, "experts_touched": local_experts_touched(layer, ids),
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
    from flashtree.layers.fused_moe import PER_PAIR_MAX, PairTiles, Tiles, fused_experts

    rows, calls = [], 8  # each replay routes 8 inputs apart, so L2 holds few of their experts
    for n in TOKENS:
        inputs = [torch.randn(n, layer.gate.weight.shape[1], device="cuda").to(dtype)
                  for _ in range(calls)]
        routes = [(x, layer.stacked, *layer.gate(x)) for x in inputs]
        row = {"tokens": n}
        pairs = layer.stacked.group and n * routes[0][3].shape[1] <= PER_PAIR_MAX
        for tiles in TILE_CANDIDATES["pairs" if pairs else "int4" if layer.stacked.group
                                     else "dense"]:
            chosen = {"pair_tiles": PairTiles(*tiles)} if pairs else {"tiles": Tiles(*tiles)}
            runs = [partial(fused_experts, *r, layer.first_expert,
                            routed_experts=layer.gate.cfg.num_experts, **chosen) for r in routes]
            ms = graph_ms(lambda runs=runs: [f() for f in runs], reps)
            row[",".join(map(str, tiles))] = ms / calls
        rows.append(row)
        print("tiles", row, flush=True)
    return rows


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
        for kind, commas in (("per-pair GEMV (block_n, block_k, down_block_n, down_block_k, "
                              "warps, split programs an SM)", 5),
                             ("grouped tile (block_n, block_k, warps, stages)", 3)):
            rows = [t for t in r.get("tiles", []) if max(k.count(",") for k in t) == commas]
            configs = [k for k in rows[0] if k != "tokens"] if rows else []
            lines += ["", f"Routed experts alone, graph-replayed, ms per {kind}:", "",
                      "| config | " + " | ".join(f"{t['tokens']} tokens" for t in rows) + " |",
                      "|---|" + "---|" * len(rows)] if rows else []
            lines += [f"| {c} | " + " | ".join(f"{t[c]:.3f}" for t in rows) + " |"
                      for c in configs]
        if r.get("profile"):
            lines += ["", "One eager forward at one token, per kernel (CPU ops off CUDA):", "",
                      "| kernel | ms | launches |", "|---|---|---|"]
            lines += [f"| `{k}` | {ms:.4f} | {n:.0f} |" for k, ms, n in r["profile"]["top"]]
        lines.append("")
    if res.get("kimi"):
        lines += kimi_report(res["kimi"])
    return lines


def layers(res: dict, args, device: torch.device) -> None:
    res.update(layout=args.layout, shapes={},
               bandwidth=copy_bandwidth(device, 256 if device.type == "cuda" else 16, 10))
    for shape in args.shapes.split(","):
        res["shapes"][shape] = layer_rows(shape, args, res["bandwidth"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    shapes = res["shapes"]
    if "fused_over_loop_b1" in shapes.get("qwen3-30b-a3b", {}):
        res["fused_over_loop_b1"] = shapes["qwen3-30b-a3b"]["fused_over_loop_b1"]
    if "layer_over_floor_b1" in shapes.get("kimi-k2.6", {}):
        kimi_rows = shapes["kimi-k2.6"]
        res["int4_layer_over_floor_b1"] = kimi_rows["layer_over_floor_b1"]
        if "fused_graph_ms" in kimi_rows["rows"][0]:
            res["moe_layer_fixed_us"] = fit_layer(kimi_rows["rows"])[0] * 1e3
            res["int4_expert_bw_fraction"] = min(r["floor_ms"] / r["fused_graph_ms"]
                                                 for r in kimi_rows["rows"]
                                                 if 8 <= r["tokens"] <= 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="layers", help="layers, kimi or both")
    ap.add_argument("--shapes", default="qwen3-30b-a3b,kimi-k2.6", help="MoE layer shapes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", action="store_true", help="also sweep the kernels' tiles")
    ap.add_argument("--profile", action="store_true", help="also profile each layer")
    ap.add_argument("--layout", help="layers: one rank's share (tpN, epN) of each layer")
    ap.add_argument("--ranks", help="kimi: speculative.py --layout JSONs, comma-separated")
    ap.add_argument("--moe", type=Path, help="kimi: a layers run's JSON of the rank's layer")
    ap.add_argument("--mla", type=Path, help="kimi: a kernels.py --mla-heads 8 run's JSON")
    ap.add_argument("--moe-target", type=Path, help="kimi: a qwen3-30b-a3b steps run's JSON")
    ap.add_argument("--allreduce-us", type=float, default=20.0,
                    help="kimi: ASSUMED latency of one small all-reduce on 8 GPUs")
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results") / f"{datetime.date.today()}-moe.md")
    args = ap.parse_args()
    device, sections = torch.device(args.device), args.sections.split(",")
    res: dict = {}
    if "layers" in sections:
        share = rank_share(args.layout, device) if args.layout else contextlib.nullcontext()
        with share:
            layers(res, args, device)
    if "kimi" in sections:
        res["kimi"] = kimi_ranks(args.ranks.split(","), args.allreduce_us, args.moe, args.mla,
                                 args.moe_target)
        res.update({k: v for k, v in res["kimi"].items() if k in KIMI_GOALS})
    title = ("MoE layers: grouped GEMMs against the per-expert loop" if "layers" in sections
             else "Kimi K2.6 per rank, and a prediction for 8 GPUs")
    write_results(args.out, title, report(res), res, KIMI_GOALS if "kimi" in sections else ())


if __name__ == "__main__":
    main()
