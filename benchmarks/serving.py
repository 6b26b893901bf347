"""Serving-side studies on the default model, in process:

  prefix      a multi-turn chat with prefix caching and without: a shared system prompt,
              conversations whose every turn resends the whole conversation plus a new user
              message, one request at a time; time to first token and decode tokens/s per
              request, and whether the answers are the same (greedy; where one is not, the
              first differing token and the uncached run's top-2 log-prob gap there). The first
              request computes the shared prefix either way; the ratio is over the others
  structured  JSON requests to the default pair, free and under a JSON schema, in every spec
              mode with the fixed policy, one at a time, greedy: tokens per step, tokens/s over
              plain decoding, and whether every answer equals plain decoding's
  summary     a `benchmarks/concurrency_sweep.sh` output folder: per concurrency and spec,
              each run's (or round's) output throughput over `none` in the same run, their
              mean, minimum and the mean's 95% interval (Student's t: where it holds 1.0 the
              runs do not tell the spec from `none`), the adaptive policy's mean budget, each
              adaptive spec over each of its fixed budgets, and a plot (OUT_DIR/summary.*)
  threads     `flashtree serve default` at each --threads (default: torch's and 1), idle and
              beside a busy process, in interleaved rounds: output tokens/s and TTFT

    python -m benchmarks.serving prefix --out benchmarks/results/DATE-prefix-cpu.md
    python -m benchmarks.serving prefix --device cuda --out benchmarks/results/DATE-prefix-gpu.md
    python -m benchmarks.serving structured --out benchmarks/results/DATE-structured-cpu.md
    python -m benchmarks.serving summary OUT_DIR
    python -m benchmarks.serving threads --out benchmarks/results/DATE-serve-threads-cpu.md"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.datasets import load_dataset
from flashtree.bench.metrics import summarize as summarize_records
from flashtree.bench.report import mean_budget, read_rows
from flashtree.bench.results import mean_interval, write_results
from flashtree.bench.server_process import launch, stop_servers
from flashtree.bench.serving import run_serving
from flashtree.bench.timing import wall_s

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "product": {"type": "string", "maxLength": 40}, "price": {"type": "number"},
    "in_stock": {"type": "boolean"},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "black", "white"]},
               "maxItems": 3}},
    "required": ["product", "price", "in_stock", "colors"], "additionalProperties": False}
REQUESTS = [  # the two schemas in turn
    ("Describe a fictional person as JSON with name, age, city and hobbies.", PERSON),
    ("Describe a pair of running shoes for sale, as JSON.", PRODUCT),
    ("Give me a JSON object for a friend of mine who lives in Lisbon.", PERSON),
    ("Return a JSON object describing a laptop in a shop.", PRODUCT),
    ("Invent a chess player and describe them in JSON.", PERSON),
    ("Make up a kitchen product and give its JSON listing.", PRODUCT),
    ("Write a JSON record of a retired teacher.", PERSON),
    ("Describe a bicycle for sale as a JSON object.", PRODUCT),
]


def chat(llm: LLM, args) -> list[dict]:
    """Every conversation's turns in order, one request at a time -> per request: TTFT, decode
    tokens/s, the answer, and the prompt tokens the cache held."""
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size
    system = [rng.randrange(200, vocab) for _ in range(args.prefix_tokens)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for conv in range(args.conversations):
        prompt = list(system)
        for turn in range(args.turns):
            prompt += [rng.randrange(200, vocab) for _ in range(args.user_tokens)]
            start = time.perf_counter()
            seq = llm.engine.add_request(prompt, params)
            while not seq.output_ids:
                llm.engine.step()
            first = time.perf_counter()
            while not seq.is_finished:
                llm.engine.step()
            rest = time.perf_counter() - first
            rows.append({"conversation": conv, "turn": turn, "prompt": list(prompt),
                         "prompt_tokens": len(prompt), "cached_tokens": seq.num_cached_tokens,
                         "ttft_s": first - start,
                         "decode_tokens_per_s": (len(seq.output_ids) - 1) / rest,
                         "tokens": list(seq.output_ids)})
            prompt += seq.output_ids
    return rows


def first_divergences(args, runs: dict[str, list[dict]]) -> list[dict]:
    """Per conversation, the first answer token where caching on and off differ (later turns
    then see different prompts), with the uncached run's top-2 log-prob gap there, scored
    again by a plain engine: a gap near zero is a near-tie that rounding may flip."""
    found = []
    for off, on in zip(runs["off"], runs["on"]):
        at = next((i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"])) if a != b),
                  None)
        if at is not None and all(d["conversation"] != off["conversation"] for d in found):
            found.append({"conversation": off["conversation"], "turn": off["turn"], "token": at,
                          "sequence": off["prompt"] + off["tokens"][: at + 1]})
    if not found:
        return []
    llm = LLM(model=args.model, spec="none", device=args.device, dtype=args.dtype,
              max_model_len=max(len(d["sequence"]) for d in found) + 8, max_num_seqs=1,
              skip_tokenizer_init=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for d in found:
        scored = llm.generate([d.pop("sequence")], params)[0].prompt_logprobs[-1]
        top = sorted(scored.values(), key=lambda lp: lp.rank)
        d["top2_gap"] = top[0].logprob - top[1].logprob
    llm.shutdown()
    return found


def prefix(args) -> None:
    longest = args.prefix_tokens + args.turns * (args.user_tokens + args.max_tokens) + 64
    runs = {}
    for caching in (False, True):
        llm = LLM(model=args.model, spec=args.spec, device=args.device, dtype=args.dtype,
                  max_model_len=longest, max_num_seqs=1, skip_tokenizer_init=True,
                  enable_prefix_caching=caching)
        runs["on" if caching else "off"] = chat(llm, args)
        llm.shutdown()
    off, on = runs["off"][1:], runs["on"][1:]
    res = {"runs": runs, "ttft_off_over_on": statistics.mean(r["ttft_s"] for r in off)
           / statistics.mean(r["ttft_s"] for r in on),
           "decode_on_over_off": statistics.mean(r["decode_tokens_per_s"] for r in on)
           / statistics.mean(r["decode_tokens_per_s"] for r in off),
           "same_answers": [r["tokens"] for r in runs["on"]] == [r["tokens"] for r in
                                                                  runs["off"]]}
    res["divergences"] = first_divergences(args, runs)
    lines = [f"A shared {args.prefix_tokens}-token system prompt, {args.conversations} "
             f"conversations of {args.turns} turns ({args.user_tokens} new user tokens, "
             f"{args.max_tokens} answer tokens each), one request at a time, greedy.", "",
             "| conversation | turn | prompt tokens | cached | TTFT off s | TTFT on s | "
             "decode tok/s off | on |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {a['conversation']} | {a['turn']} | {a['prompt_tokens']} | "
              f"{b['cached_tokens']} | {a['ttft_s']:.3f} | {b['ttft_s']:.3f} | "
              f"{a['decode_tokens_per_s']:.1f} | {b['decode_tokens_per_s']:.1f} |"
              for a, b in zip(runs["off"], runs["on"])]
    lines += ["", f"TTFT without caching over with it (all but the first request): "
              f"**{res['ttft_off_over_on']:.1f}x**. Decode tokens/s with over without: "
              f"{res['decode_on_over_off']:.2f}. Same answers: {res['same_answers']}.", ""]
    lines += [f"Conversation {d['conversation']} first differs at turn {d['turn']}, answer "
              f"token {d['token']}, where the uncached run's top two log-probs were "
              f"{d['top2_gap']:.3f} apart." for d in res["divergences"]]
    for rows in runs.values():
        for row in rows:
            row.pop("tokens"), row.pop("prompt")
    write_results(args.out, "Prefix caching in a multi-turn chat", lines, res,
                  ("ttft_off_over_on",))


def answers(llm: LLM, constrained: bool, args) -> list:
    """The first --requests requests once, one at a time, free or under their schema."""
    return [llm.chat([{"role": "user", "content": ask}], SamplingParams(
        temperature=0, max_tokens=args.max_tokens, guided_json=schema if constrained else None)
    )[0].outputs[0] for ask, schema in REQUESTS[: args.requests]]


def structured(args) -> None:
    runs: dict[str, dict] = {}
    for spec in ("none", "dflash", "ddtree"):
        llm = LLM(model="default", spec=spec, spec_policy="fixed", device=args.device,
                  max_model_len=1024, max_num_seqs=1)
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))  # warm-up
        for constrained in (False, True):
            seconds, outs = wall_s(partial(answers, llm, constrained, args))
            tokens = sum(len(o.token_ids) for o in outs)
            steps = sum(len(o.spec_accept_lengths) for o in outs)
            runs[f"{spec}/{'schema' if constrained else 'free'}"] = {
                "tokens": tokens, "decode_steps": steps, "seconds": seconds,
                "tokens_per_step": tokens / steps, "tokens_per_s": tokens / seconds,
                "answers": [o.token_ids for o in outs]}
        llm.shutdown()
    for key, r in runs.items():
        plain = runs[f"none/{key.split('/')[1]}"]
        r["over_none"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["equals_none"] = r["answers"] == plain["answers"]
    res: dict = {"runs": runs}
    for spec in ("dflash", "ddtree"):
        res[f"{spec}_acceptance_schema_over_free"] = (
            runs[f"{spec}/schema"]["tokens_per_step"] / runs[f"{spec}/free"]["tokens_per_step"])
    lines = [f"{args.requests} chat requests for JSON (two schemas), greedy, at most "
             f"{args.max_tokens} tokens, one at a time, fixed policy.", "",
             "| spec | output | tokens | tokens per step | tok/s over none | equals none |",
             "|---|---|---|---|---|---|"]
    for key, r in runs.items():
        spec, output = key.split("/")
        lines.append(f"| {spec} | {output} | {r['tokens']} | {r['tokens_per_step']:.2f} | "
                     f"{r['over_none']:.2f} | {r['equals_none']} |")
        r.pop("answers")
    lines += ["", "Acceptance (tokens per step) under the schema over free output: DFlash "
              f"{res['dflash_acceptance_schema_over_free']:.2f}, DDTree "
              f"{res['ddtree_acceptance_schema_over_free']:.2f}.", ""]
    write_results(args.out, "Structured output under speculation", lines, res)


def collect(out_dir: Path) -> tuple[list[str], dict[tuple[str, int], dict[str, dict]]]:
    """Run names (`runK`, or `runK.R` for round R of a run with several) and, per (spec,
    concurrency), the row of each."""
    runs = sorted((p for p in out_dir.glob("run*") if p.is_dir()), key=lambda p: int(p.name[3:]))
    rows: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
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


def _ratio_cells(by_run: dict[str, float], runs: list[str], digits: int) -> str:
    """Each run's ratio (`-` where it has none), their mean (bold), minimum and the mean's 95%
    interval (`-` from one run)."""
    ratios = list(by_run.values())
    interval = mean_interval(ratios)
    shown = "-" if interval is None else f"{interval[0]:.{digits}f} to {interval[1]:.{digits}f}"
    cells = [f"{by_run[n]:.{digits}f}" if n in by_run else "-" for n in runs]
    return " | ".join([*cells, f"**{statistics.mean(ratios):.{digits}f}**",
                       f"{min(ratios):.{digits}f}", shown])


def summarize(out_dir: Path) -> list[Path]:
    runs, rows = collect(out_dir)
    specs = sorted({s for s, _ in rows}, key=lambda s: (s != "none", s != "ddtree", s))
    levels = sorted({c for _, c in rows})
    head = " | ".join(runs) + " | mean | min | mean's 95% interval |"
    lines = ["# Concurrency sweep summary", "", f"Runs: {', '.join(runs)}. Output tokens/s "
             "relative to `none` in the same run (`flashtree bench` reports in each run's "
             "folders).", "", f"| concurrency | spec | {head} mean budget |",
             "|---:|---|" + "---:|" * (len(runs) + 4)]
    for c in levels:
        for spec in specs:
            by_run = rows.get((spec, c), {})
            if by_run and spec != "none":
                budgets = [b for r in by_run.values()
                           if (b := mean_budget(r.get("budget_histogram"))) is not None]
                budget = f"{statistics.mean(budgets):.1f}" if budgets else "-"
                speedups = {n: r["speedup_vs_none"] for n, r in by_run.items()}
                lines.append(f"| {c} | {spec} | {_ratio_cells(speedups, runs, 2)} | {budget} |")
    pairs = [(s.split(":")[0], s) for s in specs if ":fixed" in s and s.split(":")[0] in specs]
    table = []
    for c in levels:
        for adaptive, fixed in pairs:
            a, f = rows.get((adaptive, c), {}), rows.get((fixed, c), {})
            by_run = {n: a[n]["output_throughput"] / f[n]["output_throughput"]
                      for n in runs if n in a and n in f}
            if by_run:
                table.append(f"| {c} | {adaptive} / {fixed} | {_ratio_cells(by_run, runs, 3)} |")
    if table:
        lines += ["", "Adaptive over fixed: output tokens/s of the adaptive spec over the fixed "
                  "budget's in the same run.", "", f"| concurrency | adaptive / fixed | {head}",
                  "|---:|---|" + "---:|" * (len(runs) + 3), *table]
    plot = _plot(out_dir, specs, levels, rows)
    lines += ["", f"![throughput vs concurrency]({plot.name})", ""]
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(lines))
    return [summary, plot]


def _plot(out_dir: Path, specs: list[str], levels: list[int],
          rows: dict[tuple[str, int], dict[str, dict]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec in specs:
        pts = [(c, [r["output_throughput"] for r in rows[(spec, c)].values()],
                [r["speedup_vs_none"] for r in rows[(spec, c)].values()])
               for c in levels if rows.get((spec, c))]
        means = [statistics.mean(t) for _, t, _ in pts]
        spread = [[m - min(t) for m, (_, t, _) in zip(means, pts)],
                  [max(t) - m for m, (_, t, _) in zip(means, pts)]]
        left.errorbar([c for c, _, _ in pts], means, yerr=spread, marker="o", capsize=3,
                      label=spec)
        right.plot([c for c, _, _ in pts], [statistics.mean(r) for _, _, r in pts], marker="o",
                   label=spec)
        for c, _, r in pts:
            right.scatter([c] * len(r), r, s=8, alpha=0.4, color=right.lines[-1].get_color())
    for ax, ylabel in ((left, "output tokens/s (mean; bars: range of runs)"),
                       (right, "throughput / none's, same run (dots: runs)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set(xlabel="concurrency", ylabel=ylabel)
        ax.legend()
    left.set_yscale("log")
    right.axhline(1.0, color="gray", linewidth=0.8)
    fig.suptitle("none / fixed / adaptive speculation vs concurrency")
    fig.tight_layout()
    path = out_dir / "summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rounds(servers: dict[int, str], prompts: list, args) -> list[dict]:
    """Every server idle and beside a busy Python loop (as a load generator is), in rounds."""
    for base in servers.values():  # warm-up: the first request of each server
        asyncio.run(run_serving(base, "default", prompts[:1], 1, 4))
    runs, busy = [], [sys.executable, "-c", "while True: pass"]
    for round_, load, (n, base) in itertools.product(range(args.rounds), ("idle", "busy"),
                                                     servers.items()):
        loop = subprocess.Popen(busy) if load == "busy" else None
        try:
            records, duration, _ = asyncio.run(run_serving(base, "default", prompts,
                                                           args.concurrency, args.max_tokens))
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        runs.append({"round": round_, "load": load, "threads": n,
                     **summarize_records(records, duration)})
    return runs


def threads(args) -> None:
    load_before = os.getloadavg()
    prompts = load_dataset("chat", args.requests)
    with tempfile.TemporaryDirectory(prefix="serve-threads-") as tmp:
        logs, procs, servers = Path(tmp), [], {}
        try:
            for n in args.threads:
                base, proc = launch("default", logs / f"{n}.log", "--threads", str(n), timeout=600)
                procs.append(proc)
                servers[n] = f"{base}/v1"
            runs = _rounds(servers, prompts, args)
        finally:
            stop_servers(procs, timeout=120)
        kv_lines = sorted({line for log in logs.glob("*.log")
                           for line in log.read_text().splitlines() if "KV cache:" in line})
    lines = [f"`flashtree serve default` with each `--threads` (torch's default: "
             f"{torch.get_num_threads()}); {args.requests} streamed `chat` requests of at most "
             f"{args.max_tokens} tokens at concurrency {args.concurrency}, idle and beside a "
             f"busy Python loop, {args.rounds} rounds interleaved. Load average before: "
             f"{', '.join(f'{x:.2f}' for x in load_before)}. Start-up: {'; '.join(kv_lines)}.",
             "", "| --threads | load | output tokens/s (rounds) | median | median TTFT ms "
             "(rounds) | median | failed |", "|---:|---|---|---:|---|---:|---:|"]
    for n, load in itertools.product(args.threads, ("idle", "busy")):
        mine = [r for r in runs if r["threads"] == n and r["load"] == load]
        rate, ttft = ([r[k] for r in mine] for k in ("output_throughput", "median_ttft_ms"))
        lines.append(f"| {n} | {load} | {', '.join(f'{x:.1f}' for x in rate)} | "
                     f"**{statistics.median(rate):.1f}** | {', '.join(f'{x:.0f}' for x in ttft)}"
                     f" | **{statistics.median(ttft):.0f}** | {sum(r['failed'] for r in mine)} |")
    res = {"load_average_before": load_before, "runs": runs, "kv_cache": kv_lines}
    write_results(args.out, "Serving threads beside a busy process (CPU)", lines + [""], res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="study", required=True)
    p = sub.add_parser("prefix", help="multi-turn chat with prefix caching and without")
    p.add_argument("--model", default="default")
    p.add_argument("--spec", default=None, help="none, dflash or ddtree (default: LLM's)")
    p.add_argument("--dtype", default=None)
    for name, default in (("prefix-tokens", 4096), ("conversations", 3), ("turns", 3),
                          ("user-tokens", 32), ("max-tokens", 32), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    s = sub.add_parser("structured", help="JSON output under speculation")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--requests", type=int, default=len(REQUESTS), help="the first N requests")
    for parser in (p, s):
        parser.add_argument("--device", default=None)
        parser.add_argument("--out", type=Path, required=True, help="markdown (JSON beside it)")
    sub.add_parser("summary", help="a concurrency sweep's folder").add_argument(
        "out_dir", type=Path, help="the sweep's OUT_DIR (holding run1, run2, ...)")
    t = sub.add_parser("threads", help="serve's --threads, idle and beside a busy process")
    t.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads(), 1])
    for name, default in ("requests", 4), ("concurrency", 4), ("max-tokens", 48), ("rounds", 3):
        t.add_argument(f"--{name}", type=int, default=default)
    t.add_argument("--out", type=Path, required=True, help="markdown (JSON beside it)")
    args = ap.parse_args()
    if args.study == "summary":
        print("\n".join(map(str, summarize(args.out_dir))))
    else:
        {"prefix": prefix, "structured": structured, "threads": threads}[args.study](args)


if __name__ == "__main__":
    main()
