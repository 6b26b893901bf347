"""Mean acceptance length (tokens committed per target forward after the prefill) of each
speculative mode on the held-out prompt sets, per category and temperature.

    python benchmarks/acceptance.py --draft DIR [--model default] --out FILE.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

from flashtree import LLM, SamplingParams
from flashtree.bench.prompt_sets import eval_sets


def mean_accept(outs) -> tuple[float, int]:
    lengths = [x for o in outs for x in o.outputs[0].spec_accept_lengths]
    return (sum(lengths) / len(lengths) if lengths else float("nan")), len(lengths)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--modes", default="dflash:match,ddtree:match,dflash:rrs,ddtree:rrs",
                    help="comma list of spec:tree_sampling")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--per-category", type=int, default=16, help="prompts per category")
    ap.add_argument("--tree-budget", type=int, default=None)
    ap.add_argument("--spec-policy", default="fixed", choices=["fixed", "adaptive"],
                    help="fixed (default) measures the drafter at the full block or tree")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    sets = {k: v[: args.per_category] for k, v in eval_sets(args.per_category).items()}
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = []
    start = time.time()
    for mode in args.modes.split(","):
        spec, sampling = mode.split(":")
        llm = LLM(model=args.model, draft=args.draft, spec=spec, tree_sampling=sampling,
                  tree_budget=args.tree_budget if spec == "ddtree" else None,
                  spec_policy=args.spec_policy, device=args.device)
        for t in temps:
            if t == 0 and sampling == "rrs":
                continue  # greedy requests always use deterministic candidates
            row = {"spec": spec, "sampling": sampling if t > 0 else "greedy", "T": t}
            all_outs = []
            for name, prompts in sets.items():
                convs = [[{"role": "user", "content": p}] for p in prompts]
                params = [SamplingParams(temperature=t, max_tokens=args.max_tokens, seed=i)
                          for i in range(len(prompts))]
                outs = llm.chat(convs, params)
                row[name], _ = mean_accept(outs)
                all_outs += outs
            row["all"], row["steps"] = mean_accept(all_outs)
            rows.append(row)
            print(row, flush=True)
    cats = list(sets) + ["all"]
    lines = [
        "# Mean acceptance length per target forward (held-out prompts)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {platform.machine()}, {platform.processor() or 'cpu'}; "
        f"{time.time() - start:.0f}s",
        f"- prompts: {', '.join(f'{k} {len(v)}' for k, v in sets.items())}; chat template; "
        f"{args.max_tokens} new tokens at most; seeds 0..n-1",
        "",
        "| spec | sampling | T | " + " | ".join(cats) + " | verify steps |",
        "|---|---|---:|" + "---:|" * len(cats) + "---:|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[c]:.2f}" for c in cats)
        lines.append(f"| {r['spec']} | {r['sampling']} | {r['T']} | {cells} | {r['steps']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
