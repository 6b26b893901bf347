"""A PREDICTION, not a measurement: Kimi K2.6's step time per GPU layout, from the one-GPU
measurements of `benchmarks/moe_bench.py` (its Kimi-shaped INT4 layer) and `flashtree plan`'s
per-GPU bytes.

Per rank and step of T tokens, every one of the model's layers costs:
- its MoE layer: the one-GPU layer time fitted as a + c * (experts touched) over the measured
  rows (a: router, grouping, shared expert and launches; c: one touched INT4 expert), with the
  rank's share of the touched experts: 1 / tp of each under TP alone (every expert sliced), or
  the busiest rank's whole experts under EP (uniform routing, Monte Carlo);
- the rest of its weights (attention, dense MLP, LM head) and its latent KV at the measured
  copy bandwidth, times the dense AR step's measured distance from its floor;
- two all-reduces of an ASSUMED latency (multi-GPU machines were not lent: nothing measured).
It assumes MLA replays CUDA graphs like the dense models (it runs eagerly today) and charges
the shared expert unsliced, as the one-GPU layer ran it.

    python benchmarks/moe_predict.py --moe benchmarks/results/2026-12-04-moe-gpu.json \\
        --out benchmarks/results/2026-12-04-kimi-prediction.md
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import write_results  # noqa: E402
from flashtree.config import ModelConfig  # noqa: E402
from flashtree.plan import _loaded_bytes, _read, kv_bytes_per_token, target_parts  # noqa: E402

STEPS = [("decode x1", 1, 1), ("decode x8", 8, 8), ("decode x32", 32, 32),
         ("decode x128", 128, 128), ("verify 16 nodes", 16, 1), ("verify 64 nodes", 64, 1)]
# Counted in the measured MoE layer time, so left out of the other weights.
IN_LAYER = ("routed_experts", "shared_experts", "routers", "embedding")


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
    per_rank = experts // ranks
    total = 0
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


def predict(cfg: ModelConfig, tp: int, ep: int, layer: tuple[float, float], bandwidth: float,
            dense_over_floor: float, allreduce_us: float, ctx: int, trials: int) -> list[dict]:
    a, c = layer
    moe = cfg.moe
    assert moe is not None
    sparse = sum(moe.sparse_layers)
    other_bytes = sum(p.per_gpu * _loaded_bytes(p, cfg, 2)
                      for p in target_parts(cfg, tp, ep) if p.name not in IN_LAYER)
    kv = kv_bytes_per_token(cfg, tp, 2)
    rng = random.Random(0)
    rows = []
    for name, tokens, batch in STEPS:
        if ep > 1:  # whole experts on tp / ep ranks each; the busiest group sets the pace
            share = busiest_rank_experts(tokens, moe.num_experts, moe.top_k, ep, trials, rng)
            share /= tp // ep
        else:
            share = expected_touched(tokens, moe.num_experts, moe.top_k) / tp
        routed_ms = sparse * (a + c * share)
        other_ms = (other_bytes + batch * ctx * kv) / bandwidth * 1e3 * dense_over_floor
        comm_ms = 2 * cfg.num_layers * allreduce_us / 1e3 if tp > 1 else 0.0
        total = routed_ms + other_ms + comm_ms
        rows.append({"step": name, "moe_ms": routed_ms, "other_ms": other_ms,
                     "allreduce_ms": comm_ms, "ms": total,
                     "tokens_per_s": batch / total * 1e3 if name.startswith("decode") else None})
    return rows


def report(res: dict) -> str:
    lines = ["# Kimi K2.6 step time per layout: a PREDICTION", "",
             f"Command: `{res['command']}`. From `{res['moe']}` (Kimi-shaped INT4 layer on one "
             f"{res['machine']}: a = {res['a_ms']:.3f} ms + c = {res['c_ms']:.4f} ms per touched "
             f"expert) and `flashtree plan`'s per-GPU bytes; bandwidth "
             f"{res['bandwidth'] / 1e12:.2f} TB/s x {res['dense_over_floor']:.2f} (the dense AR "
             f"step over its floor); all-reduce latency **assumed** {res['allreduce_us']:.0f} us; "
             f"context {res['ctx']}; MLA assumed graph-replayed (it runs eagerly today). Not "
             "measured: no multi-GPU machine was lent.", ""]
    for layout, rows in res["layouts"].items():
        lines += [f"## {layout}", "", "| step | MoE ms | other weights + KV ms | all-reduce ms "
                  "| step ms | tokens/s |", "|---|---|---|---|---|---|"]
        for r in rows:
            tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            lines.append(f"| {r['step']} | {r['moe_ms']:.2f} | {r['other_ms']:.2f} | "
                         f"{r['allreduce_ms']:.2f} | {r['ms']:.2f} | {tps} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", type=Path, required=True, help="moe_bench.py's JSON")
    ap.add_argument("--config", default="tests/fixtures/kimi_k26/config.json")
    ap.add_argument("--layouts", default="tp8,ep8", help="tpN (TP only) or epN (EP over N=TP)")
    ap.add_argument("--allreduce-us", type=float, default=20.0,
                    help="assumed latency of one small all-reduce")
    ap.add_argument("--dense-over-floor", type=float, default=1.55,
                    help="the dense AR step over its floor (the oracle benchmark's "
                    "ar_step_over_floor on the H200)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    measured = json.loads(args.moe.read_text())
    layer = fit_layer(measured["shapes"]["kimi-k2.6"]["rows"])
    cfg = ModelConfig.from_hf(_read(args.config))
    res = {"command": "python benchmarks/moe_predict.py " + " ".join(sys.argv[1:]),
           "moe": str(args.moe), "machine": measured["machine"].split(",")[0],
           "a_ms": layer[0], "c_ms": layer[1], "bandwidth": measured["bandwidth"],
           "dense_over_floor": args.dense_over_floor, "allreduce_us": args.allreduce_us,
           "ctx": args.ctx, "prediction": True, "layouts": {}}
    for layout in args.layouts.split(","):
        n = int(layout[2:])
        tp, ep = (n, n) if layout.startswith("ep") else (n, 1)
        res["layouts"][layout] = predict(cfg, tp, ep, layer, measured["bandwidth"],
                                         args.dense_over_floor, args.allreduce_us, args.ctx,
                                         args.trials)
    write_results(args.out, report(res), res)


if __name__ == "__main__":
    main()
