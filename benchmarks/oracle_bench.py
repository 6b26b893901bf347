"""Speed at real acceptance (issue 45): a Qwen3-8B-shaped random-weight target and its 5-layer
block-16 DFlash drafter, built on the GPU (flashtree/bench/random_pair.py), measured with the
acceptance oracle (flashtree/bench/oracle.py) fixing how often drafts hit the target's greedy
tokens while every cost stays real. Context 1k, greedy; tokens/s are decode-phase rates (from
a request's `--skip`-th token to its last: prefill left out, as TPOT speedups are).

Sections (each fills its part of the JSON; ratios are taken within one section's run):
  steps      AR step vs its bandwidth floor and vs a gpt-fast-style compiled peer; draft,
             chain-16 and 64-node verify steps against the AR step (batch 1)
  calibrate  P for paper-DFlash (1 + sum P^i = 6.6 at block 16); Q for paper-DDTree by
             Monte Carlo over the real drafter's logits (the 256-node tree accepts 9.54)
  c1         concurrency 1: none, DFlash, DDTree at budgets 15..511 (and topk_cap), the
             acceptance curve for the plot, equality with plain decoding
  profile    one speculative step at concurrency 1 under the profiler: GPU busy share,
             device-to-host reads, where the time goes
  sweep      concurrency 1..256: none, DFlash and DDTree, fixed and adaptive
  pair       the default pair (SmolLM2-135M GGUF + shipped drafter), none / DFlash / DDTree

    python benchmarks/oracle_bench.py --sections steps,calibrate,c1,profile
    python benchmarks/oracle_bench.py --sections sweep,pair --default-model /path/model.gguf
    python benchmarks/oracle_bench.py --plot benchmarks/results/2026-12-04-oracle-gpu.json
    python benchmarks/oracle_bench.py --shape tiny --device cpu --out /tmp/o.json  # a check

Results merge into `--out` (JSON) and a report beside it (.md, `benchmarks/oracle_report.py`);
`--plot` draws speedup over `none` against acceptance with the papers' points (run where
matplotlib is installed)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gptfast_peer import CompiledPeer  # noqa: E402
from benchmarks.gpu_bench import (  # noqa: E402
    Scratch,
    ar_forward,
    copy_bandwidth,
    draft_setup,
    e2e_flashtree,
    empty_cache,
    median_ms,
    pair_prompts,
    sync,
    verify_forward,
    weight_bytes,
)
from benchmarks.oracle_report import PAPER_DDTREE_TAU, plot, report, summary  # noqa: E402
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.bench.oracle import AcceptanceOracle, expected_tree_acceptance  # noqa: E402
from flashtree.bench.random_pair import SHAPES, random_drafter, random_target, top2_gaps  # noqa
from flashtree.config import DEFAULT_TOPK_CAP  # noqa: E402
from flashtree.models.registry import DEFAULT_DRAFTER_DIR, resolve_model_path  # noqa: E402
from flashtree.runner.forward_batch import BatchItem, Mode  # noqa: E402
from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy  # noqa: E402

SECTIONS = ("steps", "calibrate", "c1", "profile", "sweep", "pair")
BLOCK = 16
PAPER_DFLASH_TAU = 6.6  # DFlash paper, Qwen3-8B, GSM8K
CALIBRATION_BUDGET = 255  # the DDTree paper's best budgets on Qwen3-8B were 256-512 nodes
BUDGETS = (15, 31, 63, 127, 255, 511)
CURVE_TAUS = (2, 3, 4, 5, 6.6, 8, 10, 12)  # chain acceptances of the plot's oracle settings
def chain_rate(tau: float, block: int = BLOCK) -> float:
    """P with 1 + sum_{i=1}^{block-1} P^i = tau (bisection; tau in [1, block])."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(block)) < tau else (lo, mid)
    return (lo + hi) / 2


def speculative_share(eng, budgets_before: dict[int, int]) -> float:
    """Of the request-steps decoded since `budgets_before` (the stats' budgets then), the share
    that speculated (0 for plain decoding)."""
    if eng.speculative is None:
        return 0.0
    new = {k: v - budgets_before.get(k, 0) for k, v in eng.speculative.stats.budgets.items()}
    return sum(v for k, v in new.items() if k > 0) / max(1, sum(new.values()))


def policy_view(policy) -> dict | None:
    """What an adaptive policy has measured per batch bucket (its verdict's inputs): median
    plain and speculative step ms, tokens committed per request per speculative step, back-off."""
    if not isinstance(policy, AdaptivePolicy):
        return None
    return {key: {"plain_ms": _median_ms(b.plain_s), "spec_ms": _median_ms(b.spec_s),
                  "accepted": b.accepted, "backoff": b.backoff}
            for key, b in sorted(policy.buckets.items())}


def _median_ms(times) -> float | None:
    return 1e3 * sorted(times)[len(times) // 2] if times else None


class Bench:
    def __init__(self, args: argparse.Namespace, res: dict, save: Callable[[], None]) -> None:
        self.args, self.res, self.save = args, res, save
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.shape = SHAPES[args.shape]
        self.ctx = args.ctx
        self._pair: tuple | None = None
        self._llm: LLM | None = None
        gen = random.Random(0)
        vocab = self.shape["vocab_size"]
        self.prompts = [[gen.randrange(vocab - 1) for _ in range(self.ctx)]
                        for _ in range(max(args.prompts, 256))]
        self.references: dict[tuple[int, ...], list[int]] = {}

    # --- engines ---------------------------------------------------------------------------
    def pair_modules(self) -> tuple:
        """(target, its config, drafter) with random weights, built on the device once."""
        if self._pair is None:
            t = time.time()
            target, cfg = random_target(self.shape, self.dtype, self.device)
            drafter = random_drafter(cfg, self.shape, self.dtype, self.device, block_size=BLOCK)
            self._pair = target, cfg, drafter
            self.res.setdefault("build_s", time.time() - t)
        return self._pair

    def llm(self, spec: str, budget: int | None = None, max_num_seqs: int = 1,
            topk_cap: int | None = None, policy: str = "fixed") -> LLM:
        """A fresh engine over the shared weights (the previous one released first)."""
        self.release()
        kw = dict(spec=spec) if spec == "none" else dict(spec=spec, spec_policy=policy)
        if spec == "ddtree":
            kw.update(tree_budget=budget, topk_cap=topk_cap)
        # Room for the longest run plus the largest tree's speculative lookahead.
        longest = self.ctx + self.args.skip + max(self.args.tokens, self.args.sweep_tokens)
        longest += max(BUDGETS) + 64
        self._llm = LLM.from_modules(*self.pair_modules(), max_num_seqs=max_num_seqs,
                                     max_model_len=longest, max_num_batched_tokens=8192,
                                     enforce_eager=self.args.enforce_eager, **kw)
        return self._llm

    def release(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
            empty_cache(self.device)

    def oracle(self, llm: LLM, p: float, q: float = 0.0) -> AcceptanceOracle:
        return AcceptanceOracle(llm, self.references, p, q, seed=self.args.seed)

    def decode(self, llm: LLM, prompts: list[list[int]], tokens: int | None = None) -> dict:
        """All `prompts` at once, greedy: decode-phase tokens/s (from every request's
        `--skip`-th token on), mean tokens per speculative step, and whether every output
        equals the plain reference (where one is known)."""
        eng, skip = llm.engine, self.args.skip
        params = SamplingParams(temperature=0, max_tokens=skip + (tokens or self.args.tokens),
                                ignore_eos=True)
        seqs = [eng.add_request(p, params) for p in prompts]
        while any(len(s.output_ids) < skip and not s.is_finished for s in seqs):
            eng.step()
        sync(self.device)
        start, before = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
        steps = [len(s.spec_accept_lengths) for s in seqs]
        budgets = dict(eng.speculative.stats.budgets) if eng.speculative else {}
        while any(not s.is_finished for s in seqs):
            eng.step()
        sync(self.device)
        seconds = time.perf_counter() - start
        accepted = [n for s, k in zip(seqs, steps) for n in s.spec_accept_lengths[k:]]
        known = [tuple(p) in self.references for p in prompts]
        equal = [self.references.get(tuple(p), [])[: len(p) + len(s.output_ids)]
                 == list(p) + list(s.output_ids) for p, s in zip(prompts, seqs)]
        tokens = sum(len(s.output_ids) for s in seqs) - before
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "speculative_share": speculative_share(eng, budgets),
                "policy": policy_view(eng.policy),
                "tau": sum(accepted) / len(accepted) if accepted else 1.0,
                "equal_to_plain": sum(equal) / len(equal) if all(known) else None,
                "requests": len(prompts)}

    def c1_rate(self, llm: LLM, prompts: list[list[int]]) -> dict:
        """Concurrency 1: the prompts one after another (tokens/s over all of them)."""
        runs = [self.decode(llm, [p]) for p in prompts]
        eq = [r["equal_to_plain"] for r in runs]
        return {"tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
                "tau": sum(r["tau"] for r in runs) / len(runs),
                "speculative_share": sum(r["speculative_share"] for r in runs) / len(runs),
                "equal_to_plain": None if None in eq else sum(eq) / len(eq)}

    def plain_references(self, prompts: list[list[int]]) -> None:
        """Greedy plain outputs of `prompts` (a `none` engine, all at once), kept."""
        todo = [p for p in prompts if tuple(p) not in self.references]
        if not todo:
            return
        llm = self.llm("none", max_num_seqs=len(todo))
        longest = self.args.skip + max(self.args.tokens, self.args.sweep_tokens)
        params = SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True)
        for p, out in zip(todo, llm.generate(todo, params)):
            self.references[tuple(p)] = list(p) + list(out.outputs[0].token_ids)

    # --- sections --------------------------------------------------------------------------
    def steps(self) -> dict:
        ctx, reps, dev = self.ctx, self.args.reps, self.device
        r: dict = {"ctx": ctx, "bytes_per_s": copy_bandwidth(dev, self.args.copy_mib, reps)}
        llm = self.llm("none", max_num_seqs=2)
        total, read = weight_bytes(llm)
        kv = llm.engine.cache.bytes_per_token
        with Scratch(llm) as s:
            r["ar_ms"] = median_ms(ar_forward(llm, s, 1, ctx), dev, reps)
            # Decisiveness: every position of a prompt, its top-2 gap against the top logit.
            item = BatchItem(s.take(1, 0, ctx)[0], 0, self.prompts[0], all_logits=True)
            logits, _ = llm.engine.runner.forward(Mode.PREFILL, [item])
            r["min_top2_gap"] = top2_gaps(logits).min().item()
            r["max_logit"] = logits.max().item()
            del logits
        r["floor_ms"] = (read + ctx * kv) / r["bytes_per_s"] * 1e3
        r.update(weight_bytes=total, weight_bytes_read=read, kv_bytes_per_token=kv)
        self.release()
        target, cfg, _ = self.pair_modules()
        peer = CompiledPeer(target, cfg, 1, ctx, ctx + 64)
        t = time.time()
        peer.decode()
        r["peer_compile_s"] = time.time() - t
        r["peer_ms"] = median_ms(peer.decode, dev, reps, warmup=5)
        del peer
        empty_cache(dev)
        llm = self.llm("dflash", max_num_seqs=2)
        gen = random.Random(1)
        with Scratch(llm) as s:
            sid = s.take(1, ctx, BLOCK)[0]
            tokens = [gen.randrange(self.shape["vocab_size"] - 1) for _ in range(BLOCK)]
            item = BatchItem(sid, ctx, tokens, all_logits=True)
            verify = lambda: llm.engine.runner.forward(Mode.VERIFY, [item], gather_logits=False)  # noqa: E731
            r["verify16_ms"] = median_ms(verify, dev, reps)
            blocks, _, _ = draft_setup(llm, s, ctx)
            prop = llm.engine.proposer
            r["draft_ms"] = median_ms(lambda: prop.draft_logits(blocks, False), dev, reps)
        llm = self.llm("ddtree", budget=63)
        with Scratch(llm) as s:
            r["verify64_ms"] = median_ms(verify_forward(llm, s, 64, ctx, self.shape["vocab_size"]),
                                         dev, reps)
        self.release()
        return r

    def calibrate(self) -> dict:
        p = chain_rate(PAPER_DFLASH_TAU)
        llm = self.llm("dflash")
        with Scratch(llm) as s:  # the real drafter's logits for one block at context ctx
            blocks, _, _ = draft_setup(llm, s, self.ctx)
            logits = llm.engine.proposer.draft_logits(blocks, False).float().clone()
        self.release()
        gen = torch.Generator(self.device).manual_seed(self.args.seed)
        trials = self.args.trials
        qs = [i / 20 for i in range(21)]
        grid = {b: [expected_tree_acceptance(logits, p, q, b, trials, gen, DEFAULT_TOPK_CAP)
                    for q in qs] for b in BUDGETS}
        curve = grid[CALIBRATION_BUDGET]
        q = _interpolate(qs, curve, PAPER_DDTREE_TAU)
        return {"p": p, "q": q, "qs": qs, "mc_tau": {str(b): v for b, v in grid.items()},
                "calibration_budget": CALIBRATION_BUDGET, "trials": trials,
                "drafter_top1_mass": logits.softmax(-1).max(-1).values.mean().item()}

    def rates(self) -> tuple[float, float]:
        cal = self.res.get("calibrate") or self.calibrate()
        self.res["calibrate"] = cal
        return cal["p"], cal["q"]

    def c1(self) -> dict:
        p, q = self.rates()
        prompts = self.prompts[: self.args.prompts]
        self.plain_references(prompts)
        r: dict = {"p": p, "q": q, "prompts": len(prompts)}
        r["none"] = self.c1_rate(self.llm("none"), prompts)
        llm = self.llm("dflash")
        oracle = self.oracle(llm, p)
        r["dflash"] = self.c1_rate(llm, prompts)
        llm.engine.policy = AdaptivePolicy(BLOCK - 1)
        r["dflash_adaptive"] = self.c1_rate(llm, prompts)
        llm.engine.policy = FixedPolicy(BLOCK - 1)
        r["curve_dflash"] = self.curve(llm, oracle, 0.0)
        r["ddtree_budgets"] = {}
        for b in BUDGETS:
            llm = self.llm("ddtree", budget=b)
            self.oracle(llm, p, q)
            r["ddtree_budgets"][str(b)] = self.c1_rate(llm, prompts)
            print(f"c1 ddtree {b}: {r['ddtree_budgets'][str(b)]}", flush=True)
        best = max(BUDGETS, key=lambda b: r["ddtree_budgets"][str(b)]["tokens_per_s"])
        r["best_budget"] = best
        cap = self.args.topk_cap or best
        llm = self.llm("ddtree", budget=best, topk_cap=cap)
        self.oracle(llm, p, q)
        r["ddtree_topk_cap"] = {"topk_cap": cap, **self.c1_rate(llm, prompts)}
        llm = self.llm("ddtree", budget=best)
        oracle = self.oracle(llm, p, q)
        r["curve_ddtree"] = self.curve(llm, oracle, q)
        llm.engine.policy = AdaptivePolicy(best)
        r["ddtree_adaptive"] = self.c1_rate(llm, prompts)
        self.release()
        return r

    def curve(self, llm: LLM, oracle: AcceptanceOracle, q: float) -> list[dict]:
        """Tokens/s at concurrency 1 for the oracle settings of CURVE_TAUS (same q)."""
        points, rates = [], (oracle.p, oracle.q)
        for tau in CURVE_TAUS:
            oracle.p, oracle.q = chain_rate(tau), q
            points.append({"p": oracle.p, **self.c1_rate(llm, self.prompts[:2])})
        oracle.p, oracle.q = rates
        return points

    def profile(self) -> dict:
        p, q = self.rates()
        best = self.res.get("c1", {}).get("best_budget", CALIBRATION_BUDGET)
        self.plain_references(self.prompts[:1])
        out = {}
        for name, kw in (("dflash", {}), ("ddtree", {"budget": best})):
            llm = self.llm(name, **kw)
            self.oracle(llm, p, q if name == "ddtree" else 0.0)
            out[name] = profile_steps(llm, self.prompts[0], self.args.skip,
                                      self.args.skip + self.args.tokens, self.device)
        self.release()
        return out

    def sweep(self) -> dict:
        p, q = self.rates()
        best = self.args.sweep_budget or min(
            self.res.get("c1", {}).get("best_budget", CALIBRATION_BUDGET), 63)
        levels = [int(c) for c in self.args.levels.split(",")]
        self.plain_references(self.prompts[: max(levels)])
        r: dict = {"p": p, "q": q, "ddtree_budget": best, "levels": levels,
                   "tokens": self.args.sweep_tokens, "rounds": self.args.rounds, "rows": {}}
        self.res["sweep"] = r  # saved after every row: a run cut short keeps what it measured
        configs = [("none", None, None), ("dflash", BLOCK - 1, 0.0), ("ddtree", best, q)]
        for spec, budget, rate_q in configs:
            if spec not in self.args.sweep_methods.split(","):
                continue
            llm = self.llm(spec, budget=budget, max_num_seqs=max(levels))
            policies = {"none": None} if spec == "none" else {
                f"{spec}:fixed": FixedPolicy(budget), f"{spec}": AdaptivePolicy(budget)}
            if spec != "none":
                self.oracle(llm, p, rate_q)
            for name, policy in policies.items():
                if policy is not None:
                    llm.engine.policy = policy
                rows = r["rows"][name] = []
                for c in levels:
                    runs = [self.decode(llm, self.prompts[:c], self.args.sweep_tokens)
                            for _ in range(self.args.rounds)]
                    rows.append({"concurrency": c, "runs": runs})
                    self.save()
                    print(f"sweep {name} c={c}: "
                          f"{[round(x['tokens_per_s']) for x in runs]} tok/s", flush=True)
            del llm  # before the next engine sizes its KV pool from the free memory
            self.release()
        return r

    def pair(self) -> dict:
        self.release()
        target = resolve_model_path(self.args.default_model)
        prompts, source = pair_prompts(target, self.args.pair_prompts)
        r: dict = {"prompts": source, "num_prompts": len(prompts), "tokens": 128}
        for spec in ("none", "dflash", "ddtree"):
            kw = dict(spec=spec) if spec == "none" else dict(
                draft=str(DEFAULT_DRAFTER_DIR), spec=spec, spec_policy="fixed")
            llm = LLM(model=str(target), device=self.args.device, skip_tokenizer_init=True,
                      max_num_seqs=1, max_model_len=max(map(len, prompts)) + 200,
                      enforce_eager=self.args.enforce_eager, **kw)
            try:
                run = e2e_flashtree(llm, prompts, 128)
                r[spec] = {k: run[k] for k in ("tokens_per_s", "mean_accept")}
            finally:
                llm.shutdown()
                del llm
                empty_cache(self.device)
        return r


def profile_steps(llm: LLM, prompt: list[int], skip: int, max_tokens: int,
                  device: torch.device, steps: int = 8) -> dict:
    """Engine steps of one request: wall time (unprofiled), the share of it the GPU is busy
    (union of kernel and copy intervals of as many profiled steps, against the unprofiled
    wall: the profiler slows the host), device-to-host copies, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    seq = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True))
    while len(seq.output_ids) < skip:
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start, timed = time.perf_counter(), 0
    while timed < steps and not seq.is_finished:
        eng.step()
        timed += 1
    sync(device)
    wall = time.perf_counter() - start
    before = len(seq.output_ids)
    with profile(activities=acts) as prof:
        done = 0
        while done < steps and not seq.is_finished:
            eng.step()
            done += 1
        sync(device)
    committed = len(seq.output_ids) - before
    sites, host = _sync_sites(eng, seq, device), _host_functions(eng, seq)
    eng.abort(seq)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in gpu)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of intervals, microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    reads = sum(1 for e in gpu if "DtoH" in e.name or "Device -> Pageable" in e.name
                or "Device -> Pinned" in e.name)
    table: dict[str, list] = {}
    for e in gpu:
        row = table.setdefault(e.name[:60], [0.0, 0])
        row[0] += (e.time_range.end - e.time_range.start) / 1e3 / done
        row[1] += 1
    top = sorted(table.items(), key=lambda kv: -kv[1][0])[:12]
    wall_ms = wall * 1e3 / max(timed, 1)
    return {"steps": done, "wall_ms_per_step": wall_ms, "gpu_busy_ms_per_step": busy / 1e3 / done,
            "gpu_busy": busy / 1e3 / done / wall_ms if device.type == "cuda" else None,
            "device_reads_per_step": reads / done, "tokens_per_step": committed / done,
            "top_kernels": [(name, ms, n / done) for name, (ms, n) in top],
            "sync_sites": sites, "host_functions": host}


def _sync_sites(eng, seq, device: torch.device, steps: int = 3) -> dict[str, float]:
    """Lines that wait for the device, with how often per step (CUDA's sync debug mode)."""
    if device.type != "cuda":
        return {}
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            done = 0
            while done < steps and not seq.is_finished:
                eng.step()
                done += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites: dict[str, float] = {}
    for w in caught:
        key = f"{_short(w.filename)}:{w.lineno}"
        sites[key] = sites.get(key, 0) + 1 / max(done, 1)
    return sites


def _short(path: str) -> str:
    """A source path without the machine's folders."""
    return path.rpartition("flashtree/")[2] if "flashtree/" in path else Path(path).name


def _host_functions(eng, seq, steps: int = 8) -> list[tuple[str, float, float]]:
    """cProfile of engine steps: the functions holding the host longest, as (function, own
    ms per step, ms per step with callees); waits for the device show as `tolist`."""
    import cProfile
    import pstats

    prof, done = cProfile.Profile(), 0
    prof.enable()
    while done < steps and not seq.is_finished:
        eng.step()
        done += 1
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tt, ct, callers)
    rows = [(f"{_short(f)}:{line}({name})", tt * 1e3 / max(done, 1),
             ct * 1e3 / max(done, 1)) for (f, line, name), (_, _, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:12]


def _interpolate(xs: list[float], ys: list[float], y: float) -> float:
    """x where the increasing-ish curve ys(xs) reaches y (clamped to the ends)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 <= y <= y1 and y1 > y0:
            return x0 + (x1 - x0) * (y - y0) / (y1 - y0)
    return xs[-1] if y > max(ys) else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens (the context)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts at concurrency 1")
    ap.add_argument("--skip", type=int, default=48, help="tokens per request before timing")
    ap.add_argument("--tokens", type=int, default=256, help="timed tokens per request (c1)")
    ap.add_argument("--sweep-tokens", type=int, default=128)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128,256",
                    help="the sweep's concurrencies")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sweep-methods", default="none,dflash,ddtree")
    ap.add_argument("--sweep-budget", type=int, help="DDTree budget of the sweep (default: "
                    "the best at concurrency 1, at most 63: a 256-request batch of bigger "
                    "trees verifies more tokens than a prefill chunk)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=256, help="Monte Carlo trials per setting")
    ap.add_argument("--topk-cap", type=int, help="topk_cap compared with the default at the "
                    "best budget (default: none, i.e. the budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--default-model", default="default", help="the pair section's target")
    ap.add_argument("--pair-prompts", type=int, default=8)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" /
                    f"{datetime.date.today()}-oracle-gpu.json")
    ap.add_argument("--plot", type=Path, help="draw the plot of this JSON and exit")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    res = json.loads(args.out.read_text()) if args.out.exists() else {}
    name = (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
            else platform.processor() or "CPU")
    res["machine"] = f"{name}, torch {torch.__version__}, Python {platform.python_version()}"
    res.update(machine_kind=name, shape=args.shape)
    res.setdefault("commands", []).append("python benchmarks/oracle_bench.py "
                                          + " ".join(sys.argv[1:]))

    def save() -> None:
        res["summary"] = summary(res)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**res, **res["summary"]}, indent=1, default=str))
        args.out.with_suffix(".md").write_text(report(res))

    bench = Bench(args, res, save)
    for section in args.sections.split(","):
        t = time.time()
        try:
            res[section] = getattr(bench, section)()
            res.get("errors", {}).pop(section, None)
        except Exception:  # noqa: BLE001 - the report names the failure; the rest still run
            bench.release()
            res.setdefault("errors", {})[section] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        print(f"[{section}: {time.time() - t:.0f} s]", flush=True)
        save()
    print(report(res))


if __name__ == "__main__":
    main()
