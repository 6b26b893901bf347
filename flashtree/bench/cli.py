"""`flashtree bench` (in-process sweep over methods x concurrencies) and `flashtree bench
serving` (the same metrics over HTTP against any OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from flashtree.bench.datasets import NAMED, check_dataset_name, load_dataset
from flashtree.bench.metrics import summarize
from flashtree.bench.report import add_speedups, read_rows, write_report, write_rows


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def _add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="chat",
                   help=f"comma list of {', '.join(NAMED)} or FILE.jsonl")
    p.add_argument("--num-prompts", type=_int_list, default=[64],
                   help="requests per run: one number, or a comma list with one per "
                        "--concurrency (e.g. longer runs where many requests run at once)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64],
                   help="comma list of in-flight request limits")
    p.add_argument("--random-input-len", type=int, default=128,
                   help="prompt tokens of the random dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="where results and the report go")
    p.add_argument("--no-progress", action="store_true")


def _oracle_rates(text: str) -> tuple[float, float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        rates = []
    if len(rates) not in (1, 2) or not all(0 <= r <= 1 for r in rates):
        raise argparse.ArgumentTypeError(f"--oracle takes P or P,Q with each in [0, 1], not "
                                         f"{text!r}")
    return rates[0], rates[1] if len(rates) > 1 else 0.0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark methods x concurrencies (in process), or "
                                         "`bench serving` against an HTTP server")
    bench.add_argument("--model", default="default")
    bench.add_argument("--draft", default=None,
                       help="DFlash drafter (dflash/ddtree; the default model has its own)")
    bench.add_argument("--spec", default="none,dflash,ddtree",
                       help="comma list of methods, each METHOD[:POLICY[:BUDGET]]: none, dflash "
                            "or ddtree; adaptive (default) or fixed; a fixed budget (tree nodes "
                            "or chain drafts), e.g. none,ddtree,ddtree:fixed:7")
    bench.add_argument("--block-size", type=int, default=None)
    bench.add_argument("--tree-budget", type=int, default=None)
    bench.add_argument("--rounds", type=int, default=1,
                       help="timed runs of every method at each concurrency, interleaved: all "
                            "engines stay loaded and each round runs them once, in an order "
                            "rotated by one per round; speedups are taken within a round "
                            "(machine drift cancels) and reported as mean and range")
    bench.add_argument("--device", default=None)
    bench.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch (default: torch's, all cores)")
    bench.add_argument("--oracle", type=_oracle_rates, default=None, metavar="P[,Q]",
                       help="fix the drafter's quality (greedy only): the target's next token "
                            "is the draft's top-1 with probability P per slot, its top-2 with "
                            "Q of the rest (flashtree/bench/oracle.py)")
    _add_load_args(bench)
    modes = bench.add_subparsers(dest="bench_mode")
    serving = modes.add_parser("serving", help="measure an OpenAI-compatible server over HTTP")
    serving.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    serving.add_argument("--model", required=True, dest="served_model",
                         help="model name the server expects")
    serving.add_argument("--label", default="server",
                         help="method name in the results (use 'none' for a plain-decoding "
                              "baseline: later labels in the same --output-dir get speedups)")
    serving.add_argument("--request-rate", type=float, default=float("inf"),
                         help="Poisson arrivals per second (default: all at once)")
    serving.add_argument("--api-key", default=None)
    serving.add_argument("--vocab-size", type=int, default=32000,
                         help="token ids of the random dataset are drawn below this")
    _add_load_args(serving)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="bench", dynamic_ncols=True)


def _header(args: argparse.Namespace, what: str) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [f"- command: `flashtree {shlex.join(sys.argv[1:])}`", f"- date: {now}",
            f"- machine: {platform.machine()}, {platform.system()}; {what}",
            f"- {_runs(args)}, max_tokens {args.max_tokens}, temperature "
            f"{args.temperature}" + (f"; {args.rounds} interleaved rounds"
                                     if args.rounds > 1 else "")]


def _prompt_counts(args: argparse.Namespace) -> list[int]:
    """Requests per run at each of --concurrency (one --num-prompts stands for all)."""
    counts = args.num_prompts
    return counts * len(args.concurrency) if len(counts) == 1 else counts


def _runs(args: argparse.Namespace) -> str:
    counts = _prompt_counts(args)
    if len(set(counts)) == 1:
        return f"{counts[0]} prompts per run"
    return (f"{' / '.join(map(str, counts))} prompts per run at concurrency "
            f"{' / '.join(map(str, args.concurrency))}")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.output_dir is None:
        raise ValueError("--output-dir DIR is required (results.jsonl, report.md, plots)")
    for name in args.dataset.split(","):
        check_dataset_name(name)
    if len(args.num_prompts) not in (1, len(args.concurrency)):
        raise ValueError(f"--num-prompts has {len(args.num_prompts)} values for "
                         f"{len(args.concurrency)} --concurrency values; give one, or one per "
                         "concurrency")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if getattr(args, "oracle", None) is not None and args.temperature != 0:
        raise ValueError("--oracle needs --temperature 0: it knows the target's greedy tokens")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.bench_mode == "serving":
        return _bench_serving(args, out)
    return _bench_offline(args, out)


def _bench_offline(args: argparse.Namespace, out: Path) -> int:
    import torch

    from flashtree.engine.heap import freeze_startup_heap

    specs = [s for s in args.spec.split(",") if s]
    methods = [parse_method(s) for s in specs]
    if any(m.spec != "none" for m in methods) and args.draft is None and args.model != "default":
        raise ValueError("--spec dflash/ddtree need --draft DIR (the default model has its own "
                         "drafter; or use --spec none)")
    datasets = [d for d in args.dataset.split(",") if d]
    bar = _progress(len(specs) * len(datasets) * sum(_prompt_counts(args)) * args.rounds,
                    not args.no_progress)
    rows = []
    if args.rounds == 1:  # one engine at a time
        for spec, method in zip(specs, methods):
            llm = _engine(args, method)
            freeze_startup_heap()  # as `flashtree serve` does
            device = llm.device
            oracle = None
            for name in datasets:
                prompts = _prompts(args, llm, name)
                oracle = _install_oracle(args, llm, prompts, oracle)
                for c, n in zip(args.concurrency, _prompt_counts(args)):
                    _warm_up(args, llm, prompts[:n], c)
                    rows.append(_timed_run(args, llm, spec, name, prompts[:n], c, 1, bar,
                                           oracle))
            del llm
            gc.unfreeze()  # the engine's own reference cycles can go now
    else:  # every engine loaded, the methods interleaved round by round
        engines = [_engine(args, method) for method in methods]
        oracles = [None] * len(engines)
        freeze_startup_heap()
        device = engines[0].device
        for name in datasets:
            prompts = _prompts(args, engines[0], name)
            oracles = [_install_oracle(args, llm, prompts, oracle)
                       for llm, oracle in zip(engines, oracles)]
            for c, n in zip(args.concurrency, _prompt_counts(args)):
                for llm in engines:
                    _warm_up(args, llm, prompts[:n], c)
                for k in range(args.rounds):
                    for i in (j % len(specs) for j in range(k, k + len(specs))):
                        rows.append(_timed_run(args, engines[i], specs[i], name, prompts[:n],
                                               c, k + 1, bar, oracles[i]))
    bar.close()
    what = f"device {device}, {torch.get_num_threads()} threads; model {args.model}" + (
        f", draft {args.draft}" if args.draft else "") + (
        f"; acceptance oracle p={args.oracle[0]}, q={args.oracle[1]}" if args.oracle else "")
    return _write_outputs(out, rows, _header(args, what))


def _engine(args: argparse.Namespace, method: Method):
    from flashtree import LLM

    return LLM(model=args.model, draft=None if method.spec == "none" else args.draft,
               block_size=args.block_size, device=args.device, dtype=args.dtype,
               max_num_seqs=max(args.concurrency), seed=args.seed, threads=args.threads,
               **method.llm_kwargs(args))


def _install_oracle(args: argparse.Namespace, llm, prompts: list, oracle):
    """With --oracle, a speculative engine's drafts hit the target's plain greedy tokens at
    the asked rates (references decoded now, by the same engine with speculation off): the
    engine's oracle, made or given `prompts`' references; None without --oracle."""
    if args.oracle is None or llm.engine.proposer is None:
        return None
    from flashtree.bench.offline import encode
    from flashtree.bench.oracle import AcceptanceOracle, plain_references
    from flashtree.sampling import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                             ignore_eos=p.ignore_eos) for p in prompts]
    references = plain_references(llm, [encode(llm, p) for p in prompts], params)
    if oracle is None:
        return AcceptanceOracle(llm, references, *args.oracle, seed=args.seed)
    oracle.references.update(references)
    return oracle


def _prompts(args: argparse.Namespace, llm, name: str) -> list:
    """The most prompts any run takes (runs with fewer take the first ones)."""
    return load_dataset(name, max(args.num_prompts), args.seed, llm.model_config.vocab_size,
                        args.random_input_len)


def _warm_up(args: argparse.Namespace, llm, prompts: list, concurrency: int) -> None:
    """A run at this concurrency that is not timed, so that one-time costs stay out of the
    timing: on CUDA the whole workload (Triton compiles the attention kernel for each new
    prefill shape on first use), elsewhere every prompt's prefill and a few steps (the
    adaptive policy's first speculative steps, which measure what speculation costs here, are
    as many)."""
    from flashtree.bench.offline import run_offline

    tokens = args.max_tokens if llm.device.type == "cuda" else 16
    run_offline(llm, prompts, concurrency, tokens, args.temperature, args.seed)


def _timed_run(args: argparse.Namespace, llm, spec: str, dataset: str, prompts: list,
               concurrency: int, round_: int, bar, oracle=None) -> dict:
    """One timed run: its metric row (with the draft budgets the run chose and the batch sizes
    it speculated at)."""
    from flashtree.bench.offline import run_offline

    before = {name: dict(counts) for name, counts in _spec_counts(llm).items()}
    records, duration = run_offline(llm, prompts, concurrency, args.max_tokens,
                                    args.temperature, args.seed, bar.update)
    checked = {}
    if oracle is not None:  # the oracle's rates, and the requests whose tokens equal plain's
        from flashtree.bench.offline import encode

        encoded = [encode(llm, p) for p in prompts]
        same = [oracle.references.get(tuple(ids)) == ids + r.token_ids
                for ids, r in zip(encoded, records)]
        checked = {"oracle_p": oracle.p, "oracle_q": oracle.q,
                   "equal_to_plain": sum(same) / len(same)}
    return {"dataset": dataset, "spec": spec, "concurrency": concurrency, "round": round_,
            **summarize(records, duration), **checked,
            **{name: _counts_since(before[name], counts)
               for name, counts in _spec_counts(llm).items()}}


@dataclass(frozen=True)
class Method:
    spec: str  # none | dflash | ddtree
    policy: str | None  # adaptive | fixed; None: the LLM's default
    budget: int | None  # fixed tree budget (ddtree) or block size - 1 (dflash)

    def llm_kwargs(self, args: argparse.Namespace) -> dict:
        kw: dict = {"spec": self.spec}
        if self.spec == "none":
            return kw
        if self.policy is not None:
            kw["spec_policy"] = self.policy
        if self.spec == "ddtree":
            kw["tree_budget"] = self.budget or args.tree_budget
        elif self.budget is not None:
            kw["block_size"] = self.budget + 1
        return kw


def parse_method(item: str) -> Method:
    """METHOD[:POLICY[:BUDGET]] -> Method; a bad item raises ValueError saying what is allowed."""
    from flashtree.config import SPEC_POLICIES

    parts = item.split(":")
    allowed = ("the allowed form is METHOD[:POLICY[:BUDGET]] with METHOD none, dflash or ddtree, "
               f"POLICY one of {list(SPEC_POLICIES)}, BUDGET a positive integer")
    spec, policy = parts[0], parts[1] if len(parts) > 1 else None
    budget = parts[2] if len(parts) > 2 else None
    bad_policy = policy is not None and policy not in SPEC_POLICIES
    bad_budget = budget is not None and not (budget.isdigit() and int(budget) > 0)
    if (len(parts) > 3 or spec not in ("none", "dflash", "ddtree") or bad_policy or bad_budget
            or (spec == "none" and len(parts) > 1)):
        raise ValueError(f"--spec item {item!r} is not understood; {allowed}")
    return Method(spec, policy, int(budget) if budget is not None else None)


def _spec_counts(llm) -> dict[str, dict[int, int]]:
    """The engine's speculation counts so far, by their row names: request-steps by chosen
    draft budget, and speculative decode steps by batch size (empty without speculation)."""
    stats = llm.engine.spec_stats
    if stats is None:
        return {"budget_histogram": {}, "speculative_steps_by_batch": {}}
    return {"budget_histogram": stats.budgets,
            "speculative_steps_by_batch": stats.speculative_steps}


def _counts_since(before: dict[int, int], now: dict[int, int]) -> dict[str, int]:
    return {str(b): n - before.get(b, 0) for b, n in sorted(now.items()) if n > before.get(b, 0)}


def _bench_serving(args: argparse.Namespace, out: Path) -> int:
    from flashtree.bench.serving import run_serving

    datasets = [d for d in args.dataset.split(",") if d]
    bar = _progress(len(datasets) * sum(_prompt_counts(args)), not args.no_progress)
    rows = [r for r in read_rows(out / "results.jsonl") if r["spec"] != args.label]
    for name in datasets:
        prompts = load_dataset(name, max(args.num_prompts), args.seed, args.vocab_size,
                               args.random_input_len)
        for c, n in zip(args.concurrency, _prompt_counts(args)):
            records, duration, accept = asyncio.run(run_serving(
                args.base_url, args.served_model, prompts[:n], c, args.max_tokens,
                args.temperature, args.request_rate, args.seed, args.api_key, bar.update))
            failed = [r.error for r in records if r.error]
            if failed:
                print(f"{len(failed)} requests failed, first: {failed[0]}", file=sys.stderr)
            rows.append({"dataset": name, "spec": args.label, "concurrency": c,
                         "request_rate": args.request_rate, **summarize(records, duration, accept)})
    bar.close()
    return _write_outputs(out, rows,
                          _header(args, f"server {args.base_url} ({args.served_model})"))


def _write_outputs(out: Path, rows: list[dict], header: list[str]) -> int:
    """Speedups over `none`, results.jsonl, report.md and plots; names the files written."""
    add_speedups(rows)
    write_rows(out / "results.jsonl", rows)
    files = write_report(out, rows, header)
    print("\n".join(str(f) for f in [out / "results.jsonl", *files]), file=sys.stderr)
    return 0
