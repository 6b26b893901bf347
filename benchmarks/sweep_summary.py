"""Summary of a `benchmarks/concurrency_sweep.sh` output: per concurrency and spec, each run's
(or each round's, for runs of several interleaved rounds) output throughput relative to `none`
in the same run, their mean, minimum and the mean's 95% confidence interval (Student's t over
the runs' ratios: where it holds 1.0, the runs do not tell the spec from `none`), the adaptive
policy's mean budget, each adaptive spec's throughput over each of its fixed budgets' in the
same run (`ddtree` over `ddtree:fixed`, `ddtree:fixed:7`, ...), and one plot of throughput vs
concurrency (mean, with the runs' range) beside the ratios to `none`.

    python benchmarks/sweep_summary.py OUT_DIR   # writes OUT_DIR/summary.md and summary.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashtree.bench.report import mean_budget, read_rows  # noqa: E402

Key = tuple[str, int]  # (spec, concurrency)


def mean_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The `level` confidence interval of the ratios' mean (Student's t; None for one ratio)."""
    if len(ratios) < 2:
        return None
    mean = statistics.mean(ratios)
    half = (stats.t.ppf((1 + level) / 2, len(ratios) - 1) * statistics.stdev(ratios)
            / len(ratios) ** 0.5)
    return mean - half, mean + half


def collect(out_dir: Path) -> tuple[list[str], dict[Key, dict[str, dict]]]:
    """Run names (`runK`, or `runK.R` for round R of a run with several) and, per (spec,
    concurrency), the row of each."""
    runs = sorted((p for p in out_dir.glob("run*") if p.is_dir()), key=lambda p: int(p.name[3:]))
    rows: dict[Key, dict[str, dict]] = defaultdict(dict)
    names: list[str] = []
    for run in runs:
        run_rows = [r for path in sorted(run.glob("*/results.jsonl")) for r in read_rows(path)]
        several = any(r.get("round", 1) > 1 for r in run_rows)
        for r in run_rows:
            name = f"{run.name}.{r.get('round', 1)}" if several else run.name
            rows[(r["spec"], r["concurrency"])][name] = r
            if name not in names:
                names.append(name)
    if not rows:
        raise SystemExit(f"no run*/*/results.jsonl under {out_dir}")
    return names, rows


def summarize(out_dir: Path) -> list[Path]:
    runs, rows = collect(out_dir)
    specs = sorted({s for s, _ in rows}, key=lambda s: (s != "none", s != "ddtree", s))
    levels = sorted({c for _, c in rows})
    lines = ["# Concurrency sweep summary", "",
             f"Runs: {', '.join(runs)}. Output tokens/s relative to `none` in the same run "
             "(`flashtree bench` reports in each run's folders).", "",
             "| concurrency | spec | " + " | ".join(runs)
             + " | mean | min | mean's 95% interval | mean budget |",
             "|---:|---|" + "---:|" * (len(runs) + 4)]
    for c in levels:
        for spec in specs:
            by_run = rows.get((spec, c), {})
            if not by_run or spec == "none":
                continue
            budgets = [b for r in by_run.values()
                       if (b := mean_budget(r.get("budget_histogram"))) is not None]
            budget = f"{statistics.mean(budgets):.1f}" if budgets else "-"
            speedups = {n: r["speedup_vs_none"] for n, r in by_run.items()}
            lines.append(f"| {c} | {spec} | {_ratio_cells(speedups, runs, 2)} | {budget} |")
    lines += _over_fixed(runs, specs, levels, rows)
    plot = _plot(out_dir, specs, levels, rows)
    lines += ["", f"![throughput vs concurrency]({plot.name})", ""]
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(lines))
    return [summary, plot]


def _ratio_cells(by_run: dict[str, float], runs: list[str], digits: int) -> str:
    """A table row's ratio cells: each run's (`-` where it has none), then their mean (bold),
    minimum and the mean's 95% interval (`-` from one run), at `digits` decimals."""
    ratios = list(by_run.values())
    interval = mean_interval(ratios)
    shown = "-" if interval is None else f"{interval[0]:.{digits}f} to {interval[1]:.{digits}f}"
    cells = [f"{by_run[n]:.{digits}f}" if n in by_run else "-" for n in runs]
    return " | ".join([*cells, f"**{statistics.mean(ratios):.{digits}f}**",
                       f"{min(ratios):.{digits}f}", shown])


def _over_fixed(runs: list[str], specs: list[str], levels: list[int],
                rows: dict[Key, dict[str, dict]]) -> list[str]:
    """The table of adaptive over fixed: per concurrency, an adaptive spec's output throughput
    over one of its fixed budgets' in each run that has both (empty without such pairs)."""
    pairs = [(s.split(":")[0], s) for s in specs
             if ":fixed" in s and s.split(":")[0] in specs]
    table = []
    for c in levels:
        for adaptive, fixed in pairs:
            a, f = rows.get((adaptive, c), {}), rows.get((fixed, c), {})
            by_run = {n: a[n]["output_throughput"] / f[n]["output_throughput"]
                      for n in runs if n in a and n in f}
            if by_run:
                table.append(f"| {c} | {adaptive} / {fixed} | {_ratio_cells(by_run, runs, 3)} |")
    if not table:
        return []
    return ["", "Adaptive over fixed: output tokens/s of the adaptive spec over the fixed "
            "budget's in the same run.", "",
            "| concurrency | adaptive / fixed | " + " | ".join(runs)
            + " | mean | min | mean's 95% interval |", "|---:|---|" + "---:|" * (len(runs) + 3),
            *table]


def _plot(out_dir: Path, specs: list[str], levels: list[int],
          rows: dict[Key, dict[str, dict]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec in specs:
        pts = [(c, [r["output_throughput"] for r in rows[(spec, c)].values()],
                [r["speedup_vs_none"] for r in rows[(spec, c)].values()])
               for c in levels if rows.get((spec, c))]
        cs = [c for c, _, _ in pts]
        means = [statistics.mean(t) for _, t, _ in pts]
        spread = [[m - min(t) for m, (_, t, _) in zip(means, pts)],
                  [max(t) - m for m, (_, t, _) in zip(means, pts)]]
        left.errorbar(cs, means, yerr=spread, marker="o", capsize=3, label=spec)
        right.plot(cs, [statistics.mean(r) for _, _, r in pts], marker="o", label=spec)
        for c, _, r in pts:
            right.scatter([c] * len(r), r, s=8, alpha=0.4, color=right.lines[-1].get_color())
    for ax, ylabel in ((left, "output tokens/s (mean; bars: range of runs)"),
                       (right, "throughput / none's, same run (dots: runs)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend()
    left.set_yscale("log")
    right.axhline(1.0, color="gray", linewidth=0.8)
    fig.suptitle("none / fixed / adaptive speculation vs concurrency")
    fig.tight_layout()
    path = out_dir / "summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="the sweep's OUT_DIR (holding run1, run2, ...)")
    for path in summarize(ap.parse_args().out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
