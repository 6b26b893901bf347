"""Layouts of one target over several GPUs (NCCL; gloo on a CPU), random weights written as a
checkpoint (`flashtree/bench/random_pair.py`): a MoE target (Qwen3-30B-A3B-shaped by default,
or DeepSeek-V3) split by experts and heads, or a dense one (`--shape qwen3-8b --layouts
tp1,tp2`: TP2 against TP1).

  decode    median engine step per concurrency, plain and DDTree (fixed policy, a random
            drafter: about one token a step), graph-replayed (and eager with --eager); the TP
            group's all-reduce latency, NCCL against one-shot, as the group measured it
  verify    rank 0's VERIFY forward per DDTree tree budget
  equality  on a shallow target (--equality-layers): every layout's tokens (and its eager
            run's) against the first layout's, plain and speculative, greedy and seeded
            sampling; each divergence with the first layout's top-2 logit gap there
  comm      all-reduce and (NCCL) all-to-all latency at the model's message sizes
  oracle    DDTree with the acceptance oracle against plain decoding, end to end

Layout names map to (tensor_parallel_size, expert_parallel_size) by SGLang's `--tp T --ep E`
convention (E divides T; the experts form E groups held by T / E ranks each):
  tpN -> (N, 1); epN -> (N, N); epNtpM -> (N * M, N). A layout needing more ranks than GPUs
(on a CPU: --max-ranks) is skipped with a line in the report.

    python -m benchmarks.multigpu --layouts tp4,tp8,ep8,ep4tp2 --out multigpu.md
    python -m benchmarks.multigpu --shape qwen3-8b --layouts tp1,tp2 --eager --concurrency 1,8,32 \
        --sections decode,equality,comm,oracle --out benchmarks/results/DATE-tp-gpu.md

The JSON has `tp2_over_tp1_b1` and `tp2_over_tp1_b32` when the layouts hold tp1 and tp2."""

from __future__ import annotations

import argparse
import gc
import json
import re
import socket
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtree import LLM, SamplingParams
from flashtree.bench.oracle import AcceptanceOracle, plain_references
from flashtree.bench.random_pair import save_drafter, save_target
from flashtree.bench.results import failure_lines, int_list, write_results
from flashtree.bench.shapes import DRAFTERS, SHAPES, with_layers
from flashtree.bench.timing import engine_step_ms, sync, wall_s
from flashtree.distributed import one_shot_all_reduce
from flashtree.runner.forward_batch import BatchItem, Mode

SECTIONS = ("decode", "verify", "equality", "comm", "oracle")
LAYOUT_FORMS = "tpN (TP N, EP 1), epN (TP N, EP N) or epNtpM (TP N*M, EP N)"


def parse_layout(name: str) -> tuple[int, int]:
    """Layout name -> (tensor_parallel_size, expert_parallel_size); see the module docstring."""
    m = re.fullmatch(r"tp([1-9]\d*)|ep([1-9]\d*)(?:tp([1-9]\d*))?", name)
    if m is None:
        raise ValueError(f"bad layout {name!r}: use {LAYOUT_FORMS}")
    if m[1]:
        return int(m[1]), 1
    ep, group = int(m[2]), int(m[3] or 1)
    return ep * group, ep


class Bench:
    def __init__(self, args, layouts: list[str]) -> None:
        self.args, self.layouts, self.res = args, layouts, {}
        self.gen_dev = "cuda" if torch.cuda.is_available() else "cpu"

    def pair(self, layers: int | None) -> tuple[Path, Path]:
        """The target of `layers` layers and its drafter, written once."""
        a = self.args
        shape = with_layers(SHAPES[a.shape], layers, a.first_dense)
        layers = shape["num_hidden_layers"]
        root = Path(a.work) / f"{a.shape}-{layers}"
        target = save_target(root / "target", shape, self.gen_dev)
        return target, save_drafter(root / f"drafter-{a.draft_layers}-{a.block}", layers,
                                    DRAFTERS[a.shape], a.draft_layers, a.block, self.gen_dev)

    def llm(self, layout: str, spec: str, target: Path, drafter: Path, eager: bool = False,
            budget: int | None = None, max_num_seqs: int = 1, max_model_len: int = 1024) -> LLM:
        tp, ep = parse_layout(layout)
        kw = {} if spec == "none" else dict(draft=str(drafter), spec_policy="fixed",
                                            tree_budget=budget)
        return LLM(model=str(target), spec=spec, device=self.args.device, dtype=self.args.dtype,
                   skip_tokenizer_init=True, max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, tensor_parallel_size=tp, expert_parallel_size=ep,
                   enforce_eager=eager, **kw)

    @property
    def variants(self) -> list[tuple[str, bool]]:
        return [(n, e) for n in self.layouts for e in ((False, True) if self.args.eager
                                                        else (False,))]

    def decode(self) -> list[dict]:
        a, (target, drafter) = self.args, self.pair(self.args.layers)
        rows = []
        for layout, eager in self.variants:
            for spec in ("none", "ddtree"):
                llm = self.llm(layout, spec, target, drafter, eager, max_num_seqs=max(
                    a.concurrency), max_model_len=a.ctx + a.steps * 20 + 128)
                try:
                    if spec == "none" and not eager and parse_layout(layout)[0] > 1:
                        self.record_one_shot(layout)
                    for c in a.concurrency:
                        ms, per = engine_step_ms(llm, c, a.ctx, a.steps)
                        rows.append(dict(layout=layout, eager=eager, spec=spec, concurrency=c,
                                         ms=ms, tokens_per_step=per, tokens_per_s=c * per / ms
                                         * 1e3))
                        print(rows[-1], flush=True)
                finally:
                    free(llm)
        return rows

    def record_one_shot(self, layout: str) -> None:
        """The running TP group's calibration: NCCL and one-shot us per message size (slowest
        rank), and the largest message it sends one-shot."""
        one_shot = one_shot_all_reduce()
        self.res.setdefault("one_shot", {})[layout] = None if one_shot is None else {
            "max_bytes": one_shot.max_bytes,
            "us": [dict(bytes=n, nccl=x, one_shot=y) for n, (x, y) in one_shot.latency_us.items()]}

    def verify(self) -> list[dict]:
        a, (target, drafter) = self.args, self.pair(self.args.layers)
        rows = []
        for layout, eager in self.variants:
            for budget in a.tree_sizes:
                llm = self.llm(layout, "ddtree", target, drafter, eager, budget, max(
                    a.verify_concurrency), a.ctx + a.steps * 20 + budget + 128)
                try:
                    for c in a.verify_concurrency:
                        times = time_verify(llm)
                        ms, _ = engine_step_ms(llm, c, a.ctx, a.steps)
                        rows.append(dict(layout=layout, eager=eager, tree_budget=budget,
                                         concurrency=c, verify_ms=sorted(times)[len(times) // 2],
                                         step_ms=ms))
                        print(rows[-1], flush=True)
                finally:
                    free(llm)
        return rows

    def equality(self) -> dict:
        a = self.args
        target, drafter = self.pair(a.equality_layers)
        vocab = SHAPES[a.shape]["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist()
                   for n in (5, 33, 100, 17)]
        cases = [(s, t) for t in a.equality_temps for s in a.equality_specs.split(",")]
        tokens, gap_llm = {}, None
        for layout, eager in self.variants:
            for spec, temp in cases:
                llm = self.llm(layout, spec, target, drafter, eager, max_num_seqs=4)
                params = [SamplingParams(temperature=temp, max_tokens=a.equality_tokens,
                                         ignore_eos=True, seed=100 + i) for i in range(4)]
                tokens[layout, eager, spec, temp] = [o.outputs[0].token_ids
                                                     for o in llm.generate(prompts, params)]
                if gap_llm is None:
                    gap_llm = llm  # the first layout's first engine scores divergences
                else:
                    free(llm)
        first = self.variants[0]
        out: dict = {"rows": [], "divergences": []}
        for (layout, eager) in self.variants[1:]:
            for spec, temp in cases:
                ref, got = tokens[(*first, spec, temp)], tokens[layout, eager, spec, temp]
                for r, (x, y) in enumerate(zip(ref, got)):
                    if x != y:
                        j = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v),
                                 min(len(x), len(y)))
                        out["divergences"].append(dict(
                            layout=layout, eager=eager, spec=spec, temperature=temp, request=r,
                            index=j, top2_gap=top2_gap(gap_llm, prompts[r] + x[:j])))
                out["rows"].append(dict(layout=layout, eager=eager, spec=spec, temperature=temp,
                                        requests=len(ref),
                                        equal=sum(x == y for x, y in zip(ref, got))))
        if gap_llm is not None:
            free(gap_llm)
        out["against"] = f"{first[0]}{' eager' if first[1] else ''}"
        return out

    def comm(self) -> list[dict]:
        a, hidden = self.args, SHAPES[self.args.shape]["hidden_size"]
        rows = []
        for world in sorted({parse_layout(n)[0] for n in self.layouts} - {1}):
            lat = comm_latency(a, world, hidden)
            elem = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
            rows += [dict(ranks=world, tokens=n, bytes=n * hidden * elem,
                          all_reduce_us=lat["all_reduce", n],
                          all_to_all_us=lat.get(("all_to_all", n))) for n in a.comm_tokens]
        return rows

    def oracle(self) -> list[dict]:
        """End to end at real acceptance: tokens/s of whole generate calls (prefill included;
        all prompts of one call arrive together)."""
        a, (target, drafter) = self.args, self.pair(self.args.layers)
        vocab = SHAPES[a.shape]["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab - 1, (a.ctx,), generator=gen).tolist()
                   for _ in range(max(a.oracle_concurrency))]
        params = SamplingParams(temperature=0, max_tokens=a.oracle_tokens, ignore_eos=True)
        rows = []
        for layout in self.layouts:
            for spec in ("none", "ddtree"):
                llm = self.llm(layout, spec, target, drafter, max_num_seqs=len(prompts),
                               max_model_len=a.ctx + a.oracle_tokens + 64)
                try:
                    if spec == "ddtree":
                        AcceptanceOracle(llm, plain_references(llm, prompts, params), *a.oracle)
                    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
                    for c in a.oracle_concurrency:
                        seconds, outs = wall_s(partial(llm.generate, prompts[:c], params))
                        steps = [n for o in outs for n in o.outputs[0].spec_accept_lengths]
                        rows.append(dict(layout=layout, spec=spec, concurrency=c,
                                         tokens_per_s=c * a.oracle_tokens / seconds,
                                         tau=sum(steps) / max(len(steps), 1)))
                        print(rows[-1], flush=True)
                finally:
                    free(llm)
        return rows


def free(llm: LLM) -> None:
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def top2_gap(llm: LLM, tokens: list[int]) -> float:
    """The logit gap between `llm`'s two best next tokens after `tokens` (a near-tie is small)."""
    eng, sid = llm.engine, -1
    eng.pages.reserve(sid, len(tokens))
    try:
        logits, _ = eng.runner.forward(Mode.PREFILL, [BatchItem(sid, 0, tokens)])
    finally:
        eng.pages.free(sid)
    top = logits[0].float().topk(2).values
    return float(top[0] - top[1])


def time_verify(llm: LLM) -> list[float]:
    """Wrap rank 0's model runner so each VERIFY forward's wall ms lands in the returned list
    (the other ranks run theirs in lockstep: the forward's collectives join them)."""
    runner, times = llm.engine.runner, []
    forward = runner.forward

    def timed(mode, items, *args, **kwargs):
        if mode is not Mode.VERIFY:
            return forward(mode, items, *args, **kwargs)
        seconds, out = wall_s(lambda: forward(mode, items, *args, **kwargs), llm.device)
        times.append(seconds * 1e3)
        return out

    runner.forward = timed
    return times


def _timed_us(op, iters: int, device: torch.device) -> float:
    """Mean microseconds of `op` over `iters` calls after 5 warm-up calls."""
    for _ in range(5):
        op()
    sync(device)
    seconds, _ = wall_s(lambda: [op() for _ in range(iters)], device)
    return seconds / iters * 1e6


def comm_worker(rank: int, world: int, port: int, backend: str, dtype: torch.dtype, hidden: int,
                tokens: list[int], iters: int, queue) -> None:
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out = {}
    for n in tokens:
        x = torch.randn(n, hidden, device=device).to(dtype)  # [tokens, hidden]
        out["all_reduce", n] = _timed_us(lambda x=x: dist.all_reduce(x), iters, device)
        if cuda:  # gloo has no all_to_all_single; pad so every rank gets an equal part
            flat = torch.zeros(-(-x.numel() // world) * world, dtype=dtype, device=device)
            recv = torch.empty_like(flat)
            out["all_to_all", n] = _timed_us(lambda f=flat, r=recv: dist.all_to_all_single(r, f),
                                             iters, device)
        dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def comm_latency(args, world: int, hidden: int) -> dict:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.SimpleQueue()
    backend = "nccl" if args.device == "cuda" else "gloo"
    mp.spawn(comm_worker, nprocs=world, join=True, args=(
        world, port, backend, getattr(torch, args.dtype), hidden, args.comm_tokens,
        args.comm_iters, queue))
    return queue.get()


def summary(res: dict) -> dict:
    steps = {(r["layout"], r["concurrency"]): r["ms"] for r in res.get("decode", [])
             if r["spec"] == "none" and not r["eager"]}
    return {f"tp2_over_tp1_b{b}": steps["tp2", b] / steps["tp1", b] for b in (1, 32)
            if ("tp1", b) in steps and ("tp2", b) in steps}


def report(res: dict, args) -> list[str]:
    lines = [f"- {s}" for s in res["skipped"]] + [""]

    def name(r: dict) -> str:
        return r["layout"] + (" eager" if r.get("eager") else "")
    if "decode" in res:
        lines += [f"## Decode, context {args.ctx}, median of {args.steps} engine steps (DDTree: "
                  f"fixed, {args.draft_layers}-layer random drafter, block {args.block})", "",
                  "| layout | TP, EP | spec | concurrency | ms/step | tokens/step/request | "
                  "tokens/s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {name(r)} | {parse_layout(r['layout'])} | {r['spec']} | "
                  f"{r['concurrency']} | {r['ms']:.2f} | {r['tokens_per_step']:.2f} | "
                  f"{r['tokens_per_s']:.1f} |" for r in res["decode"]]
        for layout, o in res.get("one_shot", {}).items():
            lines += ["", f"{layout}'s all-reduce, as the group calibrated it: " + (
                "no one-shot all-reduce (see the log)" if o is None else
                f"up to {o['max_bytes']} bytes one-shot; " + ", ".join(
                    f"{u['bytes']} B NCCL {u['nccl']:.1f} / one-shot {u['one_shot']:.1f} us"
                    for u in o["us"]))]
        lines.append("")
    if "verify" in res:
        lines += ["## Verify forward per DDTree tree_budget (median ms of rank 0's VERIFY "
                  "forward, and of the whole engine step)", "",
                  "| layout | tree_budget | concurrency | verify ms | step ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name(r)} | {r['tree_budget']} | {r['concurrency']} | "
                  f"{r['verify_ms']:.2f} | {r['step_ms']:.2f} |" for r in res["verify"]] + [""]
    eq = res.get("equality")
    if eq:
        lines += [f"## Tokens against {eq['against']} ({args.equality_layers} target layers, "
                  f"{args.equality_tokens} tokens per request, seeded sampling at T > 0)", "",
                  "| layout | spec | T | requests equal | first divergences: request @ index "
                  "(top-2 logit gap there) |", "|---|---|---|---|---|"]
        for r in eq["rows"]:
            notes = [f"{d['request']} @ {d['index']} ({d['top2_gap']:.3f})"
                     for d in eq["divergences"] if all(d[k] == r[k] for k in (
                         "layout", "eager", "spec", "temperature"))]
            lines.append(f"| {name(r)} | {r['spec']} | {r['temperature']} | {r['equal']}/"
                         f"{r['requests']} | {', '.join(notes) or '-'} |")
        lines.append("")
    if "comm" in res:
        lines += [f"## Collectives, mean us over {args.comm_iters} calls on rank 0", "",
                  "| ranks | tokens | bytes | all_reduce us | all_to_all_single us |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['ranks']} | {r['tokens']} | {r['bytes']} | {r['all_reduce_us']:.1f} | "
                  + ("n/a on gloo" if r["all_to_all_us"] is None else f"{r['all_to_all_us']:.1f}")
                  + " |" for r in res["comm"]] + [""]
    if "oracle" in res:
        p, q = args.oracle
        lines += [f"## DDTree with the acceptance oracle (P {p}, Q {q}), end to end, context "
                  f"{args.ctx}, {args.oracle_tokens} new tokens per request", "",
                  "| layout | spec | concurrency | tokens/s | tokens per step |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['layout']} | {r['spec']} | {r['concurrency']} | "
                  f"{r['tokens_per_s']:.1f} | {r['tau']:.2f} |" for r in res["oracle"]] + [""]
    return lines + failure_lines(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    ap.add_argument("--sections", default="decode,verify,equality,comm")
    ap.add_argument("--work", default="/tmp/flashtree_multigpu", help="random checkpoints go here")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="target depth (default: the shape's)")
    ap.add_argument("--first-dense", type=int, help="DeepSeek shapes: dense layers first")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--block", type=int, default=16, help="the drafter's block size")
    ap.add_argument("--layouts", default="tp4,tp8,ep8,ep4tp2")
    ap.add_argument("--eager", action="store_true", help="also run every layout eagerly")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-ranks", type=int, default=2, help="ranks allowed on CPU")
    ap.add_argument("--concurrency", type=int_list, default=[1, 16, 128])
    ap.add_argument("--tree-sizes", type=int_list, default=[1, 16, 64, 256], help="tree_budget")
    ap.add_argument("--verify-concurrency", type=int_list, default=[1])
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="timed engine steps (median)")
    ap.add_argument("--equality-layers", type=int, default=4)
    ap.add_argument("--equality-tokens", type=int, default=48)
    ap.add_argument("--equality-specs", default="none,dflash,ddtree")
    ap.add_argument("--equality-temps", type=lambda t: [float(v) for v in t.split(",")],
                    default=[0.0, 0.8])
    ap.add_argument("--comm-tokens", type=int_list, default=[1, 16, 128, 128 * 65])
    ap.add_argument("--comm-iters", type=int, default=50)
    ap.add_argument("--oracle", type=lambda t: tuple(float(v) for v in t.split(",")),
                    default=(0.863, 0.5), metavar="P,Q",
                    help="oracle rates: the drafter's top-1 is right with P (0.863: tau 6.6 "
                         "for a block-16 chain, the DFlash paper's), its top-2 with Q of the rest")
    ap.add_argument("--oracle-concurrency", type=int_list, default=[1, 32])
    ap.add_argument("--oracle-tokens", type=int, default=256)
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    for name in layouts:
        parse_layout(name)  # fail on a bad name before any work
    ranks = torch.cuda.device_count() if args.device == "cuda" else args.max_ranks
    runnable = [n for n in layouts if parse_layout(n)[0] <= ranks]
    bench = Bench(args, runnable)
    res = bench.res
    res["skipped"] = [f"skipped {n} (TP, EP {parse_layout(n)}): needs {parse_layout(n)[0]} "
                      f"ranks, {ranks} available" for n in layouts if n not in runnable]
    for section in args.sections.split(","):
        t = time.time()
        try:
            res[section] = getattr(bench, section)()
        except Exception:  # noqa: BLE001 - the report says what failed; the rest still run
            res.setdefault("errors", {})[section] = traceback.format_exc()
            print(res["errors"][section], flush=True)
        print(f"[{section}: {time.time() - t:.0f} s]", flush=True)
    keys = summary(res)
    layers = with_layers(SHAPES[args.shape], args.layers)["num_hidden_layers"]
    write_results(args.out, f"Layouts over several GPUs: {args.shape}-shaped, {layers} layers, "
                  f"random weights, {args.dtype}", report(res, args),
                  {**res, **keys, "layouts": layouts, "ranks": ranks},
                  ("tp2_over_tp1_b1", "tp2_over_tp1_b32"))
    print(json.dumps(keys))


if __name__ == "__main__":
    main()
