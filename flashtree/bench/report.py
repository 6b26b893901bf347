"""results.jsonl, report.md and PNG plots of a benchmark sweep."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path


def _run_key(r: dict) -> tuple:
    return r["dataset"], r["concurrency"], r.get("round", 1)


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_none: output throughput over that of `none` on the same dataset and
    concurrency, in the same round (None when no such baseline row exists)."""
    base = {_run_key(r): r["output_throughput"] for r in rows if r["spec"] == "none"}
    for r in rows:
        b = base.get(_run_key(r))
        r["speedup_vs_none"] = r["output_throughput"] / b if b else None


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per dataset, spec and concurrency from the rows of its rounds: their metrics'
    mean, histograms summed, the speedup the mean of each round's with its range
    (speedup_min, speedup_max), and the number of rounds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["spec"], r["concurrency"])].append(r)
    merged = []
    for group in groups.values():
        row: dict = {"rounds": len(group)}
        for key, value in group[0].items():
            values = [r.get(key) for r in group]
            if isinstance(value, dict):
                total: Counter = Counter()
                for v in values:
                    total.update(v or {})
                row[key] = dict(sorted(total.items(), key=lambda kv: int(kv[0])))
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                    isinstance(v, (int, float)) for v in values):
                row[key] = statistics.mean(values)
            else:
                row[key] = value
        speedups = [r["speedup_vs_none"] for r in group if r.get("speedup_vs_none") is not None]
        if speedups:
            row["speedup_min"], row["speedup_max"] = min(speedups), max(speedups)
        row.pop("round", None)
        merged.append(row)
    return merged


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def mean_budget(histogram: dict[str, int] | None) -> float | None:
    """Mean draft budget per request-step (0 for plain steps) of a row; None without one."""
    if not histogram:
        return None
    return sum(int(b) * n for b, n in histogram.items()) / sum(histogram.values())


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def never_drafted(row: dict) -> bool:
    """A speculative row whose engine decoded plainly all along (its speed is plain decoding's,
    whatever the speedup column says)."""
    histogram = row.get("budget_histogram") or {}
    return row["spec"] != "none" and bool(histogram) and not any(
        int(b) > 0 and n > 0 for b, n in histogram.items())


def _noise_note(rounds: int) -> list[str]:
    if rounds > 1:
        return [f"Speedups: mean over {rounds} rounds, with their range; a range that holds 1 "
                "is within this run's noise.", ""]
    return ["Speedups come from one round each: differences of several percent can be the "
            "machine's noise (another process on the cores, clock changes). Rerun with "
            "`--rounds 3` or more to see each speedup's range.", ""]


def write_report(out_dir: Path, rows: list[dict], header: list[str]) -> list[Path]:
    """report.md (one table per dataset, rounds merged; rows slower than `none` beyond the
    noise, rows that never drafted and speedups within the noise flagged) and the plots;
    returns the files written."""
    rows = merge_rounds(rows)
    rounds = min((r["rounds"] for r in rows), default=1)
    lines = ["# flashtree bench", "", *header, "", *_noise_note(rounds)]
    slower, plain = [], []
    written = [out_dir / "report.md"]
    by_dataset: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_dataset[r["dataset"]].append(r)
    for dataset, drows in by_dataset.items():
        lines += [f"## {dataset}", "",
                  "| spec | concurrency | output tok/s | req/s | TTFT mean / p99 ms | "
                  "TPOT mean / p99 ms | E2E mean ms | accept length | mean budget | "
                  "speedup vs none (rounds: mean, range) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(drows, key=lambda r: (r["spec"] != "none", r["spec"], r["concurrency"])):
            speed = r.get("speedup_vs_none")
            spread = (f" ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
                      if r["rounds"] > 1 and speed is not None else "")
            flag = ""
            within_noise = r["rounds"] > 1 and speed is not None and r["spec"] != "none" and (
                r["speedup_min"] <= 1 <= r["speedup_max"])
            if never_drafted(r):
                flag = " **never drafted**"
                plain.append(f"{dataset}: {r['spec']} at concurrency {r['concurrency']}")
            elif within_noise:
                flag = " (within noise)"
            elif speed is not None and speed < 1 and r["spec"] != "none":
                flag = " **slower than none**"
                slower.append(f"{dataset}: {r['spec']} at concurrency {r['concurrency']} "
                              f"({speed:.2f}x)")
            lines.append(
                f"| {r['spec']} | {r['concurrency']} | {_fmt(r['output_throughput'])} | "
                f"{_fmt(r['request_throughput'], 2)} | {_fmt(r['mean_ttft_ms'])} / "
                f"{_fmt(r['p99_ttft_ms'])} | {_fmt(r['mean_tpot_ms'])} / {_fmt(r['p99_tpot_ms'])}"
                f" | {_fmt(r['mean_e2e_ms'])} | {_fmt(r['accept_length'], 2)} | "
                f"{_fmt(mean_budget(r.get('budget_histogram')), 1)} | {_fmt(speed, 2)}{spread}"
                f"{flag} |")
        lines.append("")
        plots = _plots(out_dir, dataset, drows)
        written += plots
        lines += [f"![{p.stem.rsplit('_', 1)[0].replace('_', ' ')}]({p.name})" for p in plots]
        lines.append("")
    lines += ["## Where speculation is slower than `none`", ""]
    lines += [f"- {s}" for s in slower] or ["- nowhere in this sweep (outside the noise)"]
    if plain:
        lines += ["", "## Speculative rows that never drafted (plain decoding's speed)", ""]
        lines += [f"- {s}" for s in plain]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return written


def _plots(out_dir: Path, dataset: str, rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = dataset.replace("/", "_").replace(".", "_")
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in sorted({r["spec"] for r in rows}):
        pts = sorted((r["concurrency"], r["output_throughput"]) for r in rows
                     if r["spec"] == spec)
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=spec)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_ylim(bottom=0)
    throughput = _finish_plot(fig, ax, "concurrency", "output tokens/s",
                              f"throughput vs concurrency ({dataset})",
                              out_dir / f"throughput_{stem}.png")

    specs = sorted({r["spec"] for r in rows if r["spec"] != "none"})
    if not specs:
        return [throughput]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(specs))
    for j, spec in enumerate(specs):
        hist: Counter = Counter()
        for r in rows:
            if r["spec"] == spec:
                hist.update({int(k): v for k, v in r["accept_length_histogram"].items()})
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        ax.bar([k + j * width for k in ks], [hist[k] / total for k in ks], width=width,
               label=spec)
    ax.set_xlim(left=0)
    accept = _finish_plot(fig, ax, "tokens committed per target forward", "share of forwards",
                          f"acceptance length ({dataset}, all concurrencies)",
                          out_dir / f"accept_hist_{stem}.png")
    return [throughput, accept]


def _finish_plot(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
