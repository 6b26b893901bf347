"""Kimi K2.6 per rank: the goals' keys from measured one-rank runs (`benchmarks/speculative.py
--layout`, `benchmarks/moe.py --layout`) and a PREDICTION for the whole machine from them."""

from __future__ import annotations

import json
from pathlib import Path

KIMI_GOALS = ("kimi_tp8_rank_decode_b1_ms", "moe_layer_fixed_us", "int4_expert_bw_fraction",
              "kimi_tp8_rank_dflash_over_none_c1", "kimi_tp8_rank_ddtree_over_dflash_c1",
              "kimi_tp8_predicted_ar_tps_c1", "kimi_tp8_predicted_dflash_tps_c1")


def fit_layer(rows: list[dict]) -> tuple[float, float]:
    """Least-squares (a, c) of graph ms = a + c * experts touched."""
    xs = [r["experts_touched"] for r in rows]
    ys = [r["fused_graph_ms"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - c * mx, c


def collectives(layers: int, draft_layers: int, speculative: bool) -> int:
    """Collectives a rank launches per engine step: two all-reduces per decoder layer
    (attention, MLP or MoE), the vocab-parallel embedding's and the LM head's gather; the
    drafter's layers besides on a speculative step."""
    target = 2 * layers + 2
    return target + (2 * draft_layers + 2 if speculative else 0)


def kimi_ranks(ranks: list[str], allreduce_us: float, moe: Path | None) -> dict:
    """The goals' keys from measured rank runs, and the 8-GPU PREDICTION per layout: seconds
    per token = the rank's measured seconds per token + (collectives per step / tokens per
    step) x the assumed all-reduce latency."""
    out: dict = {"allreduce_us": allreduce_us, "prediction": True, "layouts": {}}
    for path in ranks:
        run = json.loads(Path(path).read_text())
        layout = run["layout"]
        steps, c1, layers = run.get("steps", {}), run.get("c1", {}), run["layers"]
        lay = out["layouts"][layout] = {"source": path, "layers": layers,
                                        "ar": steps.get("ar"), "c1": {}}
        methods = {"none": c1.get("none"), "dflash": c1.get("dflash")}
        if c1:
            methods["ddtree"] = c1["ddtree_budgets"][str(c1["best_budget"])]
        for name, m in methods.items():
            if m is None:
                continue
            per_token = 1 / m["tokens_per_s"] + collectives(
                layers, run["draft_layers"], name != "none") / m["tau"] * allreduce_us / 1e6
            lay["c1"][name] = {"rank_tps": m["tokens_per_s"], "tau": m["tau"],
                               "predicted_tps": 1 / per_token}
        if layout == "tp8" and steps:
            out["kimi_tp8_rank_decode_b1_ms"] = steps["ar"]["1"]["ms"]
        if layout == "tp8" and c1:
            rate = {k: v["rank_tps"] for k, v in lay["c1"].items()}
            out.update(kimi_tp8_rank_dflash_over_none_c1=rate["dflash"] / rate["none"],
                       kimi_tp8_rank_ddtree_over_dflash_c1=rate["ddtree"] / rate["dflash"],
                       kimi_tp8_predicted_ar_tps_c1=lay["c1"]["none"]["predicted_tps"],
                       kimi_tp8_predicted_dflash_tps_c1=lay["c1"]["dflash"]["predicted_tps"])
    if moe:
        measured = json.loads(moe.read_text())
        out.update({k: measured[k] for k in ("moe_layer_fixed_us", "int4_expert_bw_fraction")})
    return out


def kimi_report(k: dict) -> list[str]:
    """The markdown of `kimi_ranks`' result."""
    lines = ["## Kimi K2.6 per rank, and a PREDICTION for 8 GPUs", "",
              "Each rank ran alone in a group of one (its kernels and collectives, no wire "
              "time). **Predicted** tokens/s on 8 GPUs = 1 / (the rank's measured seconds "
              "per token + collectives per step / tokens per step x an ASSUMED all-reduce "
              f"latency of {k['allreduce_us']:.0f} us). Not measured.", "",
              "| layout | method | rank tokens/s | tokens/step | predicted tokens/s |",
              "|---|---|---|---|---|"]
    lines += [f"| {lay} | {m} | {v['rank_tps']:.1f} | {v['tau']:.2f} | "
              f"{v['predicted_tps']:.1f} |" for lay, d in k["layouts"].items()
              for m, v in d["c1"].items()]
    for lay, d in k["layouts"].items():
        if d["ar"]:
            lines += ["", f"{lay} rank decode step (graph-replayed) against its floor: " +
                      ", ".join(f"batch {b} {r['ms']:.2f} ms ({r['ms'] / r['floor_ms']:.1f}x)"
                                for b, r in d["ar"].items()) + "."]
    lines.append("")
    return lines
