"""The oracle benchmark's report: the issue's keys from the measured sections, a markdown report
with goals met or not, and the plot of speedup against acceptance with the papers' and
SGLang's published points (`benchmarks/oracle_bench.py` writes the JSON these read)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sweep_summary import mean_interval  # noqa: E402
from flashtree.bench.random_pair import SHAPES  # noqa: E402

PAPER_DDTREE_TAU = 9.54  # DDTree paper, Qwen3-8B on GSM8K: 6.57 -> 9.54
# (acceptance, speedup over autoregressive, source) published for Qwen3-8B.
PAPER_POINTS = {
    "dflash": [(6.6, 4.8, "DFlash paper, GSM8K"), (7.8, 5.6, "DFlash paper, MATH-500")],
    "ddtree": [(9.54, 6.75, "DDTree paper, GSM8K"), (10.7, 7.5, "DDTree paper, MATH-500")],
}
SGLANG_POINTS = [(6.35, 846, "SGLang DFlash, B200, c=1"),
                 (6.35, 1162, "SGLang DFlash + overlap, B200, c=1")]
GOALS = [  # (JSON key, comparison, threshold)
    ("dflash_over_none_c1", ">=", 4.8), ("ddtree_over_none_c1", ">=", 6.75),
    ("ddtree_over_dflash_c1", ">=", 1.3), ("gpu_busy_spec_step", ">=", 0.95),
    ("device_reads_per_spec_step", "<=", 1), ("draft_over_ar_step", "<=", 0.15),
    ("verify16_over_ar_step", "<=", 1.1), ("verify64_over_ar_step", "<=", 1.2),
    ("ar_step_over_floor", "<=", 1.25), ("ar_speed_over_compiled_peer", ">", 1.0),
    ("min_spec_over_none", ">=", 1.0), ("min_adaptive_over_best_fixed", ">=", 0.95),
]


def summary(res: dict) -> dict:
    """The issue's keys from the sections present."""
    out: dict = {}
    st, c1, prof, sw = (res.get(k) for k in ("steps", "c1", "profile", "sweep"))
    if st:
        out.update(draft_over_ar_step=st["draft_ms"] / st["ar_ms"],
                   verify16_over_ar_step=st["verify16_ms"] / st["ar_ms"],
                   verify64_over_ar_step=st["verify64_ms"] / st["ar_ms"],
                   ar_step_over_floor=st["ar_ms"] / st["floor_ms"],
                   ar_speed_over_compiled_peer=st["peer_ms"] / st["ar_ms"])
    if c1:
        best = c1["ddtree_budgets"][str(c1["best_budget"])]
        none, dflash = c1["none"]["tokens_per_s"], c1["dflash"]["tokens_per_s"]
        out.update(dflash_over_none_c1=dflash / none,
                   ddtree_over_none_c1=best["tokens_per_s"] / none,
                   ddtree_over_dflash_c1=best["tokens_per_s"] / dflash,
                   measured_tau_dflash=c1["dflash"]["tau"], measured_tau_ddtree=best["tau"])
    if prof:
        spec = prof["ddtree"]
        out.update(gpu_busy_spec_step=spec["gpu_busy"],
                   device_reads_per_spec_step=max(p["device_reads_per_step"]
                                                  for p in prof.values()))
    if sw:
        rate = {name: [_mean(row["runs"]) for row in rows] for name, rows in sw["rows"].items()}
        spec_over_none, adaptive_over_fixed = [], []
        for spec in ("dflash", "ddtree"):
            for none, adaptive, fixed in zip(rate.get("none", []), rate.get(spec, []),
                                             rate.get(f"{spec}:fixed", [])):
                spec_over_none.append(adaptive / none)
                adaptive_over_fixed.append(adaptive / max(none, fixed))
        if spec_over_none:
            out.update(min_spec_over_none=min(spec_over_none),
                       min_adaptive_over_best_fixed=min(adaptive_over_fixed))
        lows = [interval[0] for spec in ("dflash", "ddtree") if spec in sw["rows"]
                for i in range(len(sw["levels"]))
                if (interval := mean_interval(_round_ratios(sw, spec, i))) is not None]
        if lows:  # the adaptive methods' lowest 95% lower bound over `none`
            out["min_spec_over_none_low"] = float(min(lows))
    return out


def _mean(runs: list[dict]) -> float:
    return sum(r["tokens_per_s"] for r in runs) / len(runs)


def _describe(shape: dict) -> str:
    text = (f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"vocab {shape['vocab_size']:,}")
    if "num_experts" in shape:
        text += (f", {shape['num_experts']} experts of {shape['moe_intermediate_size']}, "
                 f"top-{shape['num_experts_per_tok']}")
    return text


def report(res: dict) -> str:
    keys = res.get("summary", {})
    name = res.get("shape", "qwen3-8b")
    lines = [f"# Speed at real acceptance: the acceptance oracle on a {name}-shaped target", "",
             f"Machine: {res.get('machine')}. Commands: " + "; ".join(
                 f"`{c}`" for c in res.get("commands", [])), "",
             f"Random-weight target ({_describe(SHAPES[name])}, bf16) and 5-layer "
             "block-16 DFlash drafter built on the GPU; context 1k; greedy; tokens/s are "
             "decode-phase rates; ratios are from one run each.", ""]
    cal = res.get("calibrate")
    if cal:
        lines += [f"Oracle settings: **paper-DFlash** P = {cal['p']:.4f} (chain acceptance "
                  f"6.6 at block 16); **paper-DDTree** the same P with Q = {cal['q']:.3f} "
                  f"(Monte Carlo over the drafter's own logits: the {cal['calibration_budget']}"
                  f"-node tree accepts {PAPER_DDTREE_TAU}). The drafter's top token holds "
                  f"{cal['drafter_top1_mass']:.0%} of its mass on average.", ""]
    lines += res.get("notes", [])
    lines += ["| key | value | goal | met |", "|---|---|---|---|"]
    for key, op, goal in GOALS:
        if key in keys and keys[key] is not None:
            v = keys[key]
            met = v >= goal if op == ">=" else v <= goal if op == "<=" else v > goal
            lines.append(f"| `{key}` | {v:.3f} | {op} {goal} | {'yes' if met else '**no**'} |")
    for key in ("measured_tau_dflash", "measured_tau_ddtree"):
        if key in keys:
            lines.append(f"| `{key}` | {keys[key]:.2f} | | |")
    lines.append("")
    lines += _c1_lines(res.get("c1")) + _profile_lines(res.get("profile"))
    for key in sorted(k for k in res if k.startswith("sweep")):
        lines += _sweep_lines(res[key])
    lines += _pair_lines(res.get("pair"))
    for section, error in res.get("errors", {}).items():
        lines += [f"## {section}: failed", "", "```", error[-3000:], "```", ""]
    return "\n".join(lines) + "\n"


def _c1_lines(c1: dict | None) -> list[str]:
    if not c1:
        return []
    none = c1["none"]["tokens_per_s"]
    rows = [("none", c1["none"]), ("DFlash (fixed)", c1["dflash"]),
            ("DFlash (adaptive)", c1["dflash_adaptive"])]
    rows += [(f"DDTree budget {b}", v) for b, v in c1["ddtree_budgets"].items()]
    rows.append((f"DDTree budget {c1['best_budget']}, topk_cap "
                 f"{c1['ddtree_topk_cap']['topk_cap']}", c1["ddtree_topk_cap"]))
    if "ddtree_adaptive" in c1:
        rows.append((f"DDTree budget {c1['best_budget']} (adaptive)", c1["ddtree_adaptive"]))
    lines = [f"## Concurrency 1 ({c1['prompts']} prompts one after another)", "",
             "| method | tokens/s | x none | tokens/step | equal to plain |",
             "|---|---|---|---|---|"]
    for name, v in rows:
        eq = "-" if v.get("equal_to_plain") is None else f"{v['equal_to_plain']:.0%}"
        lines.append(f"| {name} | {v['tokens_per_s']:.1f} | {v['tokens_per_s'] / none:.2f} | "
                     f"{v['tau']:.2f} | {eq} |")
    return lines + ["", f"Best DDTree budget: {c1['best_budget']}.", ""]


def _profile_lines(prof: dict | None) -> list[str]:
    if not prof:
        return []
    lines = ["## One speculative step at concurrency 1 (profiler)", ""]
    for name, p in prof.items():
        busy = "-" if p["gpu_busy"] is None else f"{p['gpu_busy']:.0%}"
        lines += [f"**{name}**: {p['wall_ms_per_step']:.2f} ms wall per step, GPU busy "
                  f"{p['gpu_busy_ms_per_step']:.2f} ms ({busy}), {p['device_reads_per_step']:.1f}"
                  f" device-to-host reads per step, {p['tokens_per_step']:.2f} tokens per step.",
                  "", "| kernel | ms per step | calls per step |", "|---|---|---|"]
        lines += [f"| `{k}` | {ms:.3f} | {n:.1f} |" for k, ms, n in p["top_kernels"]]
        lines += ["", "Device reads by line (per step): " + (", ".join(
            f"`{k}` {v:.1f}" for k, v in p.get("sync_sites", {}).items()) or "none"), "",
            "| host function (cProfile) | own ms per step | with callees |", "|---|---|---|"]
        lines += [f"| `{k}` | {own:.3f} | {cum:.3f} |" for k, own, cum in p.get("host_functions",
                                                                                  [])]
        lines.append("")
    return lines


def _sweep_lines(sw: dict | None) -> list[str]:
    if not sw:
        return []
    names = list(sw["rows"])
    lines = [f"## Concurrency sweep{sw.get('label', '')} (DFlash at paper-DFlash, DDTree budget "
             f"{sw['ddtree_budget']} at paper-DDTree; {sw['tokens']} timed tokens per request, "
             f"{sw['rounds']} rounds: mean [min-max] tokens/s)", "",
             "| concurrency | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, c in enumerate(sw["levels"]):
        cells = []
        for name in names:
            if i >= len(sw["rows"][name]):
                cells.append("-")
                continue
            runs = [r["tokens_per_s"] for r in sw["rows"][name][i]["runs"]]
            cells.append(f"{sum(runs) / len(runs):.0f} [{min(runs):.0f}-{max(runs):.0f}]")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    specs = [n for n in names if n != "none"]
    if "none" not in names or not specs:
        return lines + [""]
    lines += ["", "Over `none`, round by round: mean (95% interval of the mean; where it holds 1.0 "
              "the rounds do not tell the method from `none`)", "",
              "| concurrency | " + " | ".join(specs) + " |", "|---" * (len(specs) + 1) + "|"]
    for i, c in enumerate(sw["levels"]):
        cells = []
        for name in specs:
            ratios = _round_ratios(sw, name, i)
            interval = mean_interval(ratios) if ratios else None
            cells.append("-" if not ratios else f"{sum(ratios) / len(ratios):.2f}" + (
                "" if interval is None else f" ({interval[0]:.2f}-{interval[1]:.2f})"))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + [""]


def _round_ratios(sw: dict, name: str, level: int) -> list[float]:
    """Tokens/s of `name` over `none` at the level-th concurrency, round j over round j."""
    rows, plain = sw["rows"][name], sw["rows"]["none"]
    if level >= len(rows) or level >= len(plain):
        return []
    return [a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(rows[level]["runs"], plain[level]["runs"])]


def _pair_lines(pair: dict | None) -> list[str]:
    if not pair:
        return []
    lines = [f"## Default pair, concurrency 1 ({pair['num_prompts']} {pair['prompts']}, "
             f"{pair['tokens']} tokens, fixed budgets)", "", "| method | tokens/s | tokens/step |",
             "|---|---|---|"]
    for spec in ("none", "dflash", "ddtree"):
        v = pair[spec]
        lines.append(f"| {spec} | {v['tokens_per_s']:.1f} | {v['mean_accept']:.2f} |")
    return lines + [""]


def plot(res: dict, path: Path) -> None:
    """Speedup over none against acceptance (chain and tree curves, papers' points) and
    tokens/s against acceptance (SGLang's published B200 points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c1 = res["c1"]
    none = c1["none"]["tokens_per_s"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, marker in (("curve_dflash", "flashtree DFlash chain", "o"),
                               ("curve_ddtree", f"flashtree DDTree ({c1['best_budget']} nodes)",
                                "s")):
        pts = sorted((p["tau"], p["tokens_per_s"]) for p in c1[key])
        ax.plot([t for t, _ in pts], [v / none for _, v in pts], marker=marker, label=label)
        bx.plot([t for t, _ in pts], [v for _, v in pts], marker=marker, label=label)
    for method, marker in (("dflash", "^"), ("ddtree", "v")):
        for tau, speedup, source in PAPER_POINTS[method]:
            ax.scatter([tau], [speedup], marker=marker, s=60, color="black")
            ax.annotate(source, (tau, speedup), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    for tau, rate, source in SGLANG_POINTS:
        bx.scatter([tau], [rate], marker="*", s=90, color="black")
        bx.annotate(source, (tau, rate), fontsize=7, xytext=(4, 4), textcoords="offset points")
    bx.axhline(none, color="gray", linestyle=":", label="flashtree none")
    ax.set(xlabel="tokens per step (acceptance)", ylabel="speedup over none (tokens/s)",
           xlim=(0, 14), ylim=(0, None),
           title=f"Concurrency 1, {res.get('shape')}-shaped target, {res.get('machine_kind')}")
    bx.set(xlabel="tokens per step (acceptance)", ylabel="tokens/s", xlim=(0, 14),
           ylim=(0, None), title="Tokens/s (SGLang points: B200, real Qwen3-8B)")
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
