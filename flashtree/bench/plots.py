"""The speculative benchmark's plot (`benchmarks/speculative.py --plot`): speedup over plain
decoding and tokens/s against acceptance at concurrency 1, beside published points."""

from __future__ import annotations

from pathlib import Path

# (acceptance, speedup over autoregressive, source) published for Qwen3-8B.
PAPER_POINTS = {
    "dflash": [(6.6, 4.8, "DFlash paper, GSM8K"), (7.8, 5.6, "DFlash paper, MATH-500")],
    "ddtree": [(9.54, 6.75, "DDTree paper, GSM8K"), (10.7, 7.5, "DDTree paper, MATH-500")],
}
SGLANG_POINTS = [(6.35, 846, "SGLang DFlash, B200, c=1"),
                 (6.35, 1162, "SGLang DFlash + overlap, B200, c=1")]


def speedup_plot(res: dict, path: Path) -> None:
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
           xlim=(0, 14), ylim=(0, None), title=f"Concurrency 1, {res.get('shape')}-shaped target")
    bx.set(xlabel="tokens per step (acceptance)", ylabel="tokens/s", xlim=(0, 14),
           ylim=(0, None), title="Tokens/s (SGLang points: B200, real Qwen3-8B)")
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
