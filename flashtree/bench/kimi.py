"""Kimi K2.6 per rank: the goals' keys from measured one-rank runs (`benchmarks/speculative.py
--layout`, `benchmarks/moe.py --layout`) and a PREDICTION for the whole machine from them;
beside them MLA at a rank's heads (`benchmarks/kernels.py --mla-heads`) and the Qwen3-30B-A3B
target's steps (`benchmarks/speculative.py --shape qwen3-30b-a3b`)."""

from __future__ import annotations

import json
from pathlib import Path

KIMI_GOALS = ("kimi_tp8_rank_decode_b1_ms", "moe_layer_fixed_us", "int4_expert_bw_fraction",
              "kimi_tp8_rank_dflash_over_none_c1", "kimi_tp8_rank_ddtree_over_dflash_c1",
              "kimi_tp8_predicted_ar_tps_c1", "kimi_tp8_predicted_dflash_tps_c1",
              "mla_rank_decode_bw_fraction_16k_b32", "moe_ar_step_over_floor_b1",
              "moe_chain16_verify_over_floor")
RANK_MLA_HEADS = 16  # at most: DeepSeek-V3's 128 heads at TP8 (Kimi K2.6's 64: 8)


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


def sweep_rows(run: dict) -> list[dict]:
    """Per method and concurrency of a run's sweep: mean tokens/s over its rounds, x `none`
    at that concurrency, tokens per step and whether every round committed plain decoding's
    tokens."""
    rows = []
    for name, levels in run.get("sweep", {}).get("rows", {}).items():
        for level in levels:
            runs = level["runs"]
            rows.append({"method": name, "concurrency": level["concurrency"],
                         "tokens_per_s": sum(r["tokens_per_s"] for r in runs) / len(runs),
                         "tau": sum(r["tau"] for r in runs) / len(runs),
                         "equal_to_plain": all(r.get("equal_to_plain") == 1 for r in runs)})
    plain = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        c = r["concurrency"]
        r["over_none"] = r["tokens_per_s"] / plain[c] if c in plain else None
    return rows


def kimi_ranks(ranks: list[str], allreduce_us: float, moe: Path | None,
               mla: Path | None = None, moe_target: Path | None = None) -> dict:
    """The goals' keys from measured rank runs, and the 8-GPU PREDICTION per layout: seconds
    per token = the rank's measured seconds per token + (collectives per step / tokens per
    step) x the assumed all-reduce latency; with `mla` and `moe_target`, `other_targets`'."""
    out: dict = {"allreduce_us": allreduce_us, "prediction": True, "layouts": {},
                 **other_targets(mla, moe_target)}
    for path in ranks:
        run = json.loads(Path(path).read_text())
        layout = run["layout"]
        steps, c1, layers = run.get("steps", {}), run.get("c1", {}), run["layers"]
        lay = out["layouts"][layout] = {"source": path, "layers": layers,
                                        "ar": steps.get("ar"), "c1": {},
                                        "verify": run.get("verify"), "sweep": sweep_rows(run)}
        if "draft_floor_ms" in steps:
            lay["draft"] = {"ms": steps["draft_ms"], "floor_ms": steps["draft_floor_ms"]}
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


def other_targets(mla: Path | None, moe_target: Path | None) -> dict:
    """The keys of the MLA kernel at a rank's heads (a `kernels.py --sections mla
    --mla-heads 8` JSON) and of the Qwen3-30B-A3B target's steps (a `speculative.py --shape
    qwen3-30b-a3b --sections steps` JSON): its batch-1 AR step and its 16-token chain verify,
    each graph-replayed, over their floors."""
    out: dict = {}
    if mla:
        run = json.loads(mla.read_text())
        heads = run["mla"]["shape"][0]
        if heads > RANK_MLA_HEADS:
            raise ValueError(f"{mla}: MLA at {heads} heads, not a rank's share (at most "
                             f"{RANK_MLA_HEADS}; kernels.py --mla-heads 8 for Kimi at TP8)")
        out["mla_rank_heads"] = heads
        out["mla_rank_decode_bw_fraction_16k_b32"] = run.get("mla_decode_bw_fraction_16k_b32")
    if moe_target:
        run = json.loads(moe_target.read_text())
        steps, chain = run["steps"], run["steps"].get("chain")
        if run.get("shape") != "qwen3-30b-a3b" or chain != 16:
            raise ValueError(f"{moe_target}: the {run.get('shape')} shape with a {chain}-token "
                             "chain; the key is Qwen3-30B-A3B's 16-token chain (--sections "
                             "steps of --shape qwen3-30b-a3b)")
        b1 = steps["ar"]["1"]
        out["moe_ar_step_over_floor_b1"] = b1["ms"] / b1["floor_ms"]
        out["moe_chain16_verify_over_floor"] = steps["verify16_ms"] / steps["verify16_floor_ms"]
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
        lines += _rank_lines(lay, d)
    lines += _other_target_lines(k)
    lines.append("")
    return lines


def _rank_lines(lay: str, d: dict) -> list[str]:
    """A rank's steps against their floors, its verifies and its sweep's rows past c=1."""
    lines = []
    if d["ar"]:
        lines += ["", f"{lay} rank decode step (graph-replayed) against its floor: " + ", ".join(
            f"batch {b} {r['ms']:.2f} ms ({r['ms'] / r['floor_ms']:.1f}x)"
            for b, r in d["ar"].items()) + "."]
    if d.get("draft"):
        lines += ["", f"{lay} draft step {d['draft']['ms']:.2f} ms, "
                  f"{d['draft']['ms'] / d['draft']['floor_ms']:.1f}x its floor."]
    for ctx, ms in (d.get("verify") or {}).get("ms", {}).items():
        floors, over = d["verify"]["floor_ms"][ctx], d["verify"]["over_ar_step"][ctx]
        lines += ["", f"{lay} verify of N nodes at context {ctx}:", "",
                  "| nodes | ms | / AR step | / floor |", "|---:|---:|---:|---:|"]
        lines += [f"| {n} | {m:.2f} | {over[n]:.2f} | {m / floors[n]:.2f} |"
                  for n, m in ms.items()]
    sweep = [r for r in d.get("sweep", []) if r["concurrency"] > 1]
    if sweep:
        lines += ["", f"{lay} end to end past concurrency 1 (the sweep's rounds averaged):", "",
                  "| method | concurrency | tokens/s | x none | tokens/step | plain's tokens |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                  + ("-" if r["over_none"] is None else f"{r['over_none']:.2f}")
                  + f" | {r['tau']:.2f} | {'yes' if r['equal_to_plain'] else 'NO'} |"
                  for r in sweep]
    return lines


def _other_target_lines(k: dict) -> list[str]:
    lines = []
    if k.get("mla_rank_heads"):
        frac = k["mla_rank_decode_bw_fraction_16k_b32"]
        lines += ["", f"MLA decode at {k['mla_rank_heads']} heads (a rank's), 16k keys x 32 "
                  "requests: latent bytes per second over copy bandwidth "
                  + ("not measured" if frac is None else f"{frac:.2f}") + "."]
    if "moe_ar_step_over_floor_b1" in k:
        lines += ["", "Qwen3-30B-A3B shape, graph-replayed: the batch-1 AR step "
                  f"{k['moe_ar_step_over_floor_b1']:.2f}x its floor, the 16-token chain verify "
                  f"{k['moe_chain16_verify_over_floor']:.2f}x its floor."]
    return lines
