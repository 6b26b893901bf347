"""The speculative step and end to end, on a random-weight target of any shape (dense, MoE,
MLA: `flashtree/bench/shapes.py`) and its 5-layer block-16 DFlash drafter built on the device
(`flashtree/bench/random_pair.py`), with the acceptance oracle (`flashtree/bench/oracle.py`)
fixing how often drafts hit the target's greedy tokens while every cost stays real. Greedy;
tokens/s are decode-phase rates (from a request's `--skip`-th token on).

  steps      copy bandwidth; the AR step at --batches against its floor (weights, experts its
             tokens touch, KV), graph-replayed and eager; a whole engine step; a gpt-fast-style
             compiled peer (dense Qwen3, CUDA); on a DFlash engine its decode step, the 16-token
             chain verify, the draft step and a block's context injection; on a DDTree engine
             the 64-node verify; every step through the engine's graph runner as serving runs it
  verify     a tree verify of each of --trees nodes at each of --verify-ctxs over the AR step
  calibrate  P for paper-DFlash (1 + sum P^i = 6.6 at block 16); Q for paper-DDTree by Monte
             Carlo over the real drafter's logits (the 256-node tree accepts 9.54)
  c1         concurrency 1: none, DFlash, DDTree at budgets 15..511 (and topk_cap), the
             acceptance curve for the plot, equality with plain decoding
  profile    engine steps of none, DFlash and DDTree (--profile-batch requests) profiled
  sweep      concurrency 1..256: none, DFlash, DDTree fixed at each budget of its ladder, and
             both adaptive (picking plain steps or a budget per batch size), in rounds
  generate   plain decoding against transformers `generate` on a checkpoint of the shape
  pair       the default pair: none, DFlash, DDTree against the reference `dflash` package
  acceptance tokens per target forward of the default pair's spec modes on held-out prompts

    python -m benchmarks.speculative --sections steps,calibrate,c1,profile

More commands (MoE and Kimi ranks, the sweep, plots): docs/benchmarks.md. Results merge into
`--out` (markdown) and the JSON beside it, section by section."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import random
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams
from flashtree.bench.floors import copy_bandwidth, floor_ms, step_floor_bytes, weight_bytes
from flashtree.bench.guard import compare, last_results, step_times
from flashtree.bench.metrics import tau_mean, tau_ratio
from flashtree.bench.oracle import AcceptanceOracle, expected_tree_acceptance
from flashtree.bench.peer import CompiledPeer
from flashtree.bench.plots import speedup_plot
from flashtree.bench.profile import calls_made_at_most, profile_calls, profile_lines
from flashtree.bench.random_pair import (
    DRAFTER_LAYOUT,
    parse_layout,
    random_drafter,
    random_rank,
    random_target,
    rank_llm,
    rank_share,
    save_target,
    top2_gaps,
)
from flashtree.bench.results import command, failure_lines, int_list, mean_interval, write_results
from flashtree.bench.shapes import DRAFTERS, SHAPES, with_layers
from flashtree.bench.timing import (
    Scratch,
    captures_graphs,
    engine_step_ms,
    median_ms,
    replay_ms,
    step_ms,
    sync,
    wall_s,
)
from flashtree.config import DEFAULT_TOPK_CAP
from flashtree.kv.cache import OutOfPages
from flashtree.models.registry import DEFAULT_DRAFTER_DIR, resolve_model_path
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.speculative.policy import AdaptivePolicy, FixedPolicy

SECTIONS = ("steps", "verify", "calibrate", "c1", "profile", "sweep", "generate", "pair",
            "acceptance")
BLOCK = 16
PAPER_DFLASH_TAU = 6.6  # DFlash paper, Qwen3-8B, GSM8K
PAPER_DDTREE_TAU = 9.54  # DDTree paper, Qwen3-8B on GSM8K: 6.57 -> 9.54
CALIBRATION_BUDGET = 255  # the DDTree paper's best budgets on Qwen3-8B were 256-512 nodes
CURVE_TAUS = (2, 3, 4, 5, 6.6, 8, 10, 12)  # chain acceptances of the plot's oracle settings
GOAL_KEYS = ("ar_step_over_floor", "ar_speed_over_compiled_peer", "draft_over_ar_step",
             "verify16_over_ar_step", "verify64_over_ar_step", "verify256_over_ar_step",
             "dflash_over_none_c1", "ddtree_over_none_c1", "ddtree_over_dflash_c1",
             "ddtree_best_budget_c1", "gpu_busy_ddtree_step", "host_ms_between_steps",
             "device_reads_per_spec_step", "adaptive_tau_bias_in_se", "ddtree_over_dflash_e2e",
             "min_spec_over_none", "min_adaptive_over_best_fixed", "speedup_vs_reference_dflash")


def chain_rate(tau: float, block: int = BLOCK) -> float:
    """P with 1 + sum_{i=1}^{block-1} P^i = tau (bisection; tau in [1, block])."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(block)) < tau else (lo, mid)
    return (lo + hi) / 2


def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Bench:
    def __init__(self, args: argparse.Namespace, res: dict, save) -> None:
        self.args, self.res, self.save = args, res, save
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.shape = with_layers(SHAPES[args.shape], args.layers, args.first_dense)
        self.ctx = args.ctx
        self._pair: tuple | None = None
        self._llm: LLM | None = None
        self.block = BLOCK  # the drafter's, once built
        tp = parse_layout(args.layout)[0] if args.layout else 1
        gen, vocab = random.Random(0), self.shape["vocab_size"] // tp  # a rank's vocab slice
        count = max(args.prompts, 256, args.profile_batch)
        self.prompts = [[gen.randrange(vocab - 1) for _ in range(self.ctx)] for _ in range(count)]
        self.references: dict[tuple[int, ...], list[int]] = {}

    # --- engines ---------------------------------------------------------------------------
    def pair_modules(self) -> tuple:
        """(target, its config, drafter) with random weights, built on the device once."""
        if self._pair is None:
            t, a = time.time(), self.args
            if a.layout:  # this process's rank share (main entered it), the seeds' drafter
                self._pair = random_rank(a.shape, self.dtype, self.device, a.layers,
                                         built_layers=a.built_layers, **self.shape_overrides())
            else:
                target, cfg = random_target(self.shape, self.dtype, self.device)
                self._pair = target, cfg, random_drafter(
                    cfg, DRAFTERS[a.shape], self.dtype, self.device, layers=a.draft_layers,
                    block_size=BLOCK)
            self.block = self._pair[2].cfg.block_size
            self.res.setdefault("build_s", time.time() - t)
        return self._pair

    def llm(self, spec: str, budget: int | None = None, max_num_seqs: int = 1,
            topk_cap: int | None = None, policy: str = "fixed", eager: bool = False) -> LLM:
        """A fresh engine over the shared weights (the previous one released first)."""
        self.release()
        a = self.args
        kw = dict(spec=spec) if spec == "none" else dict(spec=spec, spec_policy=policy)
        if spec == "ddtree":
            kw.update(tree_budget=budget, topk_cap=topk_cap)
        # Room for the longest run (or verify) plus the largest tree.
        longest = self.ctx + a.skip + max(a.tokens, a.sweep_tokens, self._profile_tokens()
                                          ) + 64 + max(*a.budgets, CALIBRATION_BUDGET)
        if {"steps", "verify"} & set(a.sections.split(",")):
            longest = max(longest, max(a.verify_ctxs) + max(a.trees) + 64)
        build = rank_llm if a.layout else LLM.from_modules
        self._llm = build(*self.pair_modules(), max_num_seqs=max_num_seqs,
                          max_model_len=longest, max_num_batched_tokens=8192,
                          enforce_eager=a.enforce_eager or eager, **kw)
        return self._llm

    def _profile_tokens(self) -> int:
        """Tokens a profiled request may commit: every step of every profiling pass a block."""
        return self.block * calls_made_at_most(self.args.profile_steps, window=True)

    def shape_overrides(self) -> dict:
        return ({} if self.args.first_dense is None
                else {"first_k_dense_replace": self.args.first_dense})

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
        budgets = dict(eng.spec_stats.budgets) if eng.spec_stats else {}
        accepted, drafts = [], eng.spec_stats.num_drafts if eng.spec_stats else 0
        while any(not s.is_finished for s in seqs):  # tokens per speculative step, not plain
            marks = [len(s.spec_accept_lengths) for s in seqs]
            eng.step()
            if eng.spec_stats and eng.spec_stats.num_drafts > drafts:
                accepted += [s.spec_accept_lengths[-1] for s, m in zip(seqs, marks)
                             if len(s.spec_accept_lengths) > m]
            drafts = eng.spec_stats.num_drafts if eng.spec_stats else 0
        sync(self.device)
        seconds = time.perf_counter() - start
        known = [tuple(p) in self.references for p in prompts]
        equal = [self.references.get(tuple(p), [])[: len(p) + len(s.output_ids)]
                 == list(p) + list(s.output_ids) for p, s in zip(prompts, seqs)]
        tokens = sum(len(s.output_ids) for s in seqs) - before
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "speculative_share": speculative_share(eng, budgets),
                "policy": policy_view(eng.policy), **tau_mean(accepted), "accepted": accepted,
                "equal_to_plain": sum(equal) / len(equal) if all(known) else None,
                "requests": len(prompts)}

    def c1_rate(self, llm: LLM, prompts: list[list[int]]) -> dict:
        """Concurrency 1: the prompts one after another (tokens/s over all of them)."""
        runs = [self.decode(llm, [p]) for p in prompts]
        eq = [r["equal_to_plain"] for r in runs]
        return {"tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
                **tau_mean([n for r in runs for n in r.pop("accepted")]),
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

    def rates(self) -> tuple[float, float]:
        cal = self.res.get("calibrate") or self.calibrate()
        self.res["calibrate"] = cal
        return cal["p"], cal["q"]

    def ar_by_ctx(self, llm: LLM | None = None) -> dict[str, float]:
        """AR step ms at batch 1 for each verify context on `llm` (a plain engine): the steps
        section's when it has them, else measured now."""
        known = self.res.get("steps", {}).get("ar_b1_ms_by_ctx", {})
        if llm is None and all(str(c) in known for c in self.args.verify_ctxs):
            return known
        llm = llm or self.llm("none")
        out = {}
        for c in self.args.verify_ctxs:
            with Scratch(llm) as s:
                out[str(c)] = step_ms(llm, s.decode(1, c), self.args.reps)
        return out

    # --- sections --------------------------------------------------------------------------
    def steps(self) -> dict:
        a, ctx, reps, dev = self.args, self.ctx, self.args.reps, self.device
        bw = copy_bandwidth(dev, a.copy_mib, reps)
        r: dict = {"ctx": ctx, "bytes_per_s": bw, "ar": {}}
        llm = self.llm("none", max_num_seqs=max(a.batches))
        r["graphs"] = captures_graphs(llm)
        for b in a.batches:
            with Scratch(llm) as s:
                try:
                    run = s.decode(b, ctx)
                except OutOfPages as e:  # the KV pool holds fewer: keep the batches measured
                    r.setdefault("skipped", {})[str(b)] = str(e)
                    continue
                r["ar"][str(b)] = dict(ms=step_ms(llm, run, reps), floor_ms=floor_ms(
                    step_floor_bytes(llm, run, b * ctx), bw), replay_ms=replay_ms(llm, run, reps))
        total, read = weight_bytes(llm.model)
        r.update(weight_bytes=total, weight_bytes_read=read,
                 kv_bytes_per_token=llm.engine.cache.bytes_per_token,
                 ar_b1_ms_by_ctx=self.ar_by_ctx(llm))
        with Scratch(llm) as s:  # decisiveness: every position's top-2 gap
            item = BatchItem(s.take(1, 0, ctx)[0], 0, self.prompts[0], all_logits=True)
            logits, _ = llm.engine.runner.forward(Mode.PREFILL, [item])
            r["min_top2_gap"], r["max_logit"] = (top2_gaps(logits).min().item(),
                                                 logits.max().item())
            del logits
        r["engine_step_ms"] = engine_step_ms(llm, 1, ctx, reps)[0]
        llm = self.llm("none", max_num_seqs=max(a.batches), eager=True)
        for b in map(int, r["ar"]):
            with Scratch(llm) as s:
                r["ar"][str(b)]["eager_ms"] = median_ms(s.decode(b, ctx), dev, reps)
        r.update(self.peer(ctx, reps))
        llm = self.llm("dflash", max_num_seqs=2)
        with Scratch(llm) as s:
            r["decode_with_context_ms"] = step_ms(llm, s.decode(1, ctx), reps)
        with Scratch(llm) as s:
            r["chain"] = b = self.block
            verify = s.verify(b, ctx, tree=False)
            r[f"verify{b}_ms"] = step_ms(llm, verify, reps)
            r[f"verify{b}_replay_ms"] = replay_ms(llm, verify, reps)
            r[f"verify{b}_floor_ms"] = floor_ms(step_floor_bytes(llm, verify, ctx + b), bw)
        with Scratch(llm) as s:
            draft, inject = s.draft(ctx)
            r["draft_ms"] = step_ms(llm, draft, reps, drafter=True)
            r["draft_replay_ms"] = replay_ms(llm, draft, reps, drafter=True)
            r["inject_ms"] = median_ms(inject, dev, reps)
            r["draft_floor_ms"] = floor_ms(step_floor_bytes(llm, draft, ctx + b, drafter=True), bw)
        llm = self.llm("ddtree", budget=63)
        with Scratch(llm) as s:
            verify = s.verify(64, ctx, tree=True)
            r["verify64_ms"] = step_ms(llm, verify, reps)
            r["verify64_replay_ms"] = replay_ms(llm, verify, reps)
        self.release()
        return r

    def peer(self, ctx: int, reps: int) -> dict:
        """The compiled peer's decode step (dense Qwen3 on CUDA only: torch.compile's CUDA
        graphs are what it is about)."""
        self.release()
        target, cfg, _ = self.pair_modules()
        if cfg.architecture != "Qwen3ForCausalLM" or self.device.type != "cuda":
            return {"peer": f"not run ({cfg.architecture} on {self.device.type})"}
        peer = CompiledPeer(target, cfg, 1, ctx, ctx + 64)
        compile_s, _ = wall_s(peer.decode, self.device)
        out = {"peer_compile_s": compile_s,
               "peer_ms": median_ms(peer.decode, self.device, reps, warmup=5)}
        del peer
        empty_cache(self.device)
        return out

    def verify(self) -> dict:
        a, ar = self.args, self.ar_by_ctx()
        bw = self.res.get("steps", {}).get("bytes_per_s") or copy_bandwidth(
            self.device, a.copy_mib, a.reps)
        r: dict = {"ar_step_ms": ar, "ms": {}, "over_ar_step": {}, "floor_ms": {}}
        for n in a.trees:
            llm = self.llm("ddtree", budget=max(1, n - 1))  # a 1-node tree pads to 2
            for c in a.verify_ctxs:
                with Scratch(llm) as s:
                    run = s.verify(n, c, tree=True)
                    ms = step_ms(llm, run, a.reps)
                    r["floor_ms"].setdefault(str(c), {})[str(n)] = floor_ms(
                        step_floor_bytes(llm, run, c + n), bw)
                r["ms"].setdefault(str(c), {})[str(n)] = ms
                r["over_ar_step"].setdefault(str(c), {})[str(n)] = ms / ar[str(c)]
            print(f"verify {n} nodes: {[r['ms'][str(c)][str(n)] for c in a.verify_ctxs]}",
                  flush=True)
        self.release()
        return r

    def calibrate(self) -> dict:
        a = self.args
        llm = self.llm("dflash")  # builds the pair: self.block is the drafter's from here
        p = chain_rate(a.dflash_tau, self.block)
        with Scratch(llm) as s:  # the real drafter's logits for one block at context ctx
            logits = s.draft(self.ctx)[0]().float().clone()
        self.release()
        gen = torch.Generator(self.device).manual_seed(self.args.seed)
        qs = [i / 20 for i in range(21)]
        grid = {b: [expected_tree_acceptance(logits, p, q, b, self.args.trials, gen,
                                             DEFAULT_TOPK_CAP) for q in qs]
                for b in sorted({*self.args.budgets, CALIBRATION_BUDGET})}
        q = _interpolate(qs, grid[CALIBRATION_BUDGET], a.ddtree_tau)
        return {"p": p, "q": q, "qs": qs, "block": self.block, "dflash_tau": a.dflash_tau,
                "ddtree_tau": a.ddtree_tau, "mc_tau": {str(b): v for b, v in grid.items()},
                "calibration_budget": CALIBRATION_BUDGET, "trials": self.args.trials,
                "drafter_top1_mass": logits.softmax(-1).max(-1).values.mean().item()}

    def c1(self) -> dict:
        p, q = self.rates()
        prompts = self.prompts[: self.args.prompts]
        self.plain_references(prompts)
        r: dict = {"p": p, "q": q, "prompts": len(prompts)}
        r["none"] = self.c1_rate(self.llm("none"), prompts)
        llm = self.llm("dflash")
        oracle = self.oracle(llm, p)
        r["dflash"] = self.c1_rate(llm, prompts)
        llm.engine.policy = AdaptivePolicy(self.block - 1)
        r["dflash_adaptive"] = self.c1_rate(llm, prompts)
        llm.engine.policy = FixedPolicy(self.block - 1)
        r["curve_dflash"] = self.curve(llm, oracle, 0.0)
        r["ddtree_budgets"] = {}
        for b in self.args.budgets:
            llm = self.llm("ddtree", budget=b)
            self.oracle(llm, p, q)
            r["ddtree_budgets"][str(b)] = self.c1_rate(llm, prompts)
            print(f"c1 ddtree {b}: {r['ddtree_budgets'][str(b)]}", flush=True)
        best = max(self.args.budgets, key=lambda b: r["ddtree_budgets"][str(b)]["tokens_per_s"])
        r["best_budget"] = best
        cap = self.args.topk_cap or best
        llm = self.llm("ddtree", budget=best, topk_cap=cap)
        self.oracle(llm, p, q)
        r["ddtree_topk_cap"] = {"topk_cap": cap, **self.c1_rate(llm, prompts)}
        llm = self.llm("ddtree", budget=best)
        oracle = self.oracle(llm, p, q)
        r["curve_ddtree"] = self.curve(llm, oracle, q)
        llm.engine.policy = AdaptivePolicy(best)  # its budget alone: the sweep picks per batch
        r["ddtree_adaptive"] = self.c1_rate(llm, prompts)
        r["adaptive_tau_over_fixed_tau"] = {
            "dflash": tau_ratio(r["dflash_adaptive"], r["dflash"]),
            "ddtree": tau_ratio(r["ddtree_adaptive"], r["ddtree_budgets"][str(best)])}
        self.release()
        return r

    def curve(self, llm: LLM, oracle: AcceptanceOracle, q: float) -> list[dict]:
        """Tokens/s at concurrency 1 for the oracle settings of CURVE_TAUS (same q)."""
        points, rates = [], (oracle.p, oracle.q)
        for tau in self.args.curve_taus:
            oracle.p, oracle.q = chain_rate(tau, self.block), q
            points.append({"p": oracle.p, **self.c1_rate(llm, self.prompts[:2])})
        oracle.p, oracle.q = rates
        return points

    def profile(self) -> dict:
        a = self.args
        p, q = self.rates()
        best = (a.profile_budget if a.profile_budget is not None
                else self.res.get("c1", {}).get("best_budget", CALIBRATION_BUDGET))
        prompts = self.prompts[: a.profile_batch]
        sampled = int(a.sampled_fraction * len(prompts))
        self.plain_references(prompts[sampled:])
        out = {}
        for name, kw in (("none", {}), ("dflash", {}), ("ddtree", {"budget": best})):
            llm = self.llm(name, max_num_seqs=len(prompts), **kw)
            if name != "none":
                self.oracle(llm, p, q if name == "ddtree" else 0.0)
            eng = llm.engine
            seqs = [eng.add_request(pr, SamplingParams(
                temperature=1.0 if i < sampled else 0.0, seed=i, ignore_eos=True,
                max_tokens=a.skip + self._profile_tokens()))
                for i, pr in enumerate(prompts)]
            while any(len(s.output_ids) < a.skip and not s.is_finished for s in seqs):
                eng.step()
            before = sum(len(s.output_ids) for s in seqs)
            prof = profile_calls(eng.step, self.device, a.profile_steps,
                                 done=lambda seqs=seqs: any(s.is_finished for s in seqs),
                                 window=name != "none")
            prof["tokens_per_step"] = ((sum(len(s.output_ids) for s in seqs) - before)
                                       / max(prof["calls_made"], 1) / len(seqs))
            for s in seqs:
                eng.abort(s)
            out[name] = prof
        self.release()
        return {"batch": len(prompts), "sampled": sampled, "ddtree_budget": best, **out}

    def sweep(self) -> dict:
        a = self.args
        p, q = self.rates()
        best = a.sweep_budget or min(
            self.res.get("c1", {}).get("best_budget", CALIBRATION_BUDGET), 63)
        levels = [int(c) for c in a.levels.split(",")]
        self.plain_references(self.prompts[: max(levels)])
        r: dict = {"p": p, "q": q, "ddtree_budget": best, "levels": levels,
                   "tokens": a.sweep_tokens, "rounds": a.rounds, "rows": {}}
        self.res["sweep"] = r  # saved after every row: a run cut short keeps what it measured
        for spec, budget, rate_q in (("none", None, None), ("dflash", self.block - 1, 0.0),
                                     ("ddtree", best, q)):
            if spec not in a.sweep_methods.split(","):
                continue
            llm = self.llm(spec, budget=budget, max_num_seqs=max(levels))
            ladder = () if spec == "none" else llm.engine.speculative.cfg.budgets
            # DDTree: fixed at every budget of the ladder the adaptive policy picks from.
            policies = {"none": None} if spec == "none" else {
                **{f"{spec}:fixed" + (f":{b}" if b != budget else ""): FixedPolicy(b)
                   for b in ladder}, f"{spec}": AdaptivePolicy(ladder)}
            if spec != "none":
                self.oracle(llm, p, rate_q)
            for name, policy in policies.items():
                if policy is not None:
                    llm.engine.policy = policy
                rows = r["rows"][name] = []
                for c in levels:
                    runs = [self.decode(llm, self.prompts[:c], a.sweep_tokens)
                            for _ in range(a.rounds)]
                    for run in runs:  # the step list serves c1's standard errors only
                        run.pop("accepted")
                    rows.append({"concurrency": c, "runs": runs})
                    self.save()
                    print(f"sweep {name} c={c}: "
                          f"{[round(x['tokens_per_s']) for x in runs]} tok/s", flush=True)
            del llm  # before the next engine sizes its KV pool from the free memory
            self.release()
        return r

    def generate(self) -> dict:
        """flashtree plain against transformers `generate` on a checkpoint of the shape, batch
        1, greedy, a random prompt, exactly --gen-tokens new tokens each."""
        a = self.args
        self.release()
        work = Path(a.work) / f"{a.shape}-{self.shape['num_hidden_layers']}"
        target = save_target(work, self.shape, "cuda" if torch.cuda.is_available() else "cpu")
        prompt = torch.randint(0, self.shape["vocab_size"] - 1, (a.gen_prompt,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        llm = LLM(model=str(target), device=a.device, dtype=a.dtype, skip_tokenizer_init=True,
                  max_num_seqs=1, max_model_len=a.gen_prompt + a.gen_tokens + 64,
                  enforce_eager=a.enforce_eager)
        r: dict = {"prompt_tokens": a.gen_prompt, "new_tokens": a.gen_tokens,
                   "flashtree": e2e_numbers(partial(flashtree_s, llm, prompt), a.gen_tokens)}
        llm.shutdown()
        empty_cache(self.device)
        model = load_hf(target, self.dtype, self.device)
        r["transformers"] = e2e_numbers(partial(hf_generate_s, model, prompt), a.gen_tokens)
        model = None
        empty_cache(self.device)
        return r

    def pair(self) -> dict:
        a = self.args
        self.release()
        target = resolve_model_path(a.default_model)
        prompts, source = pair_prompts(target, a.pair_prompts)
        r: dict = {"target": str(target), "drafter": a.default_draft, "prompts": source,
                   "num_prompts": len(prompts), "tokens": a.pair_tokens}
        for spec in ("none", "dflash", "ddtree"):
            # The methods as configured (the full block, the full tree every step).
            kw = {} if spec == "none" else dict(draft=a.default_draft, spec_policy="fixed")
            llm = LLM(model=str(target), device=a.device, dtype=a.dtype, spec=spec,
                      skip_tokenizer_init=True, max_num_seqs=1,
                      max_model_len=max(map(len, prompts)) + a.pair_tokens + 64,
                      enforce_eager=a.enforce_eager, **kw)
            try:
                r[spec] = e2e_flashtree(llm, prompts, a.pair_tokens)
            finally:
                llm.shutdown()
                del llm
                empty_cache(self.device)
            print(f"pair {spec}: {r[spec]['tokens_per_s']:.1f} tok/s", flush=True)
        r.update(reference_dflash(target, Path(a.default_draft), prompts, a.pair_tokens,
                                  self.dtype, self.device))
        empty_cache(self.device)
        for key, spec, ref in (("dflash_equal_to_reference", "dflash", "reference_chain"),
                               ("dflash_equal_to_none", "dflash", "none"),
                               ("ddtree_equal_to_none", "ddtree", "none")):
            r[key] = sum(x == y for x, y in zip(r[spec]["outputs"], r[ref]["outputs"]))
        for x in r.values():
            if isinstance(x, dict):
                x.pop("outputs", None)
        return r

    def acceptance(self) -> dict:
        """Mean tokens committed per target forward of each `--acceptance-modes` item
        (spec:tree_sampling) at each of --temperatures, per held-out prompt category."""
        from flashtree.bench.prompt_sets import eval_sets

        a = self.args
        self.release()
        sets = {k: v[: a.per_category] for k, v in eval_sets(a.per_category).items()}
        rows = []
        for mode in a.acceptance_modes.split(","):
            spec, sampling = mode.split(":")
            llm = LLM(model=a.default_model, draft=a.default_draft, spec=spec,
                      tree_sampling=sampling, spec_policy="fixed", device=a.device)
            for t in (float(v) for v in a.temperatures.split(",")):
                if t == 0 and sampling == "rrs":
                    continue  # greedy requests always use deterministic candidates
                row: dict = {"spec": spec, "sampling": sampling if t > 0 else "greedy", "T": t}
                lengths: dict[str, list[int]] = {}
                for name, texts in sets.items():
                    params = [SamplingParams(temperature=t, max_tokens=a.acceptance_tokens,
                                             seed=i) for i in range(len(texts))]
                    outs = llm.chat([[{"role": "user", "content": x}] for x in texts], params)
                    lengths[name] = [n for o in outs for n in o.outputs[0].spec_accept_lengths]
                    row[name] = _mean(lengths[name])
                every = [n for v in lengths.values() for n in v]
                row.update(all=_mean(every), steps=len(every))
                rows.append(row)
                print(row, flush=True)
            llm.shutdown()
        return {"categories": {k: len(v) for k, v in sets.items()}, "rows": rows,
                "max_tokens": a.acceptance_tokens}


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


def speculative_share(eng, budgets_before: dict[int, int]) -> float:
    """Of the request-steps decoded since `budgets_before` (the stats' budgets then), the share
    that speculated (0 for plain decoding)."""
    if eng.spec_stats is None:
        return 0.0
    new = {k: v - budgets_before.get(k, 0) for k, v in eng.spec_stats.budgets.items()}
    return sum(v for k, v in new.items() if k > 0) / max(1, sum(new.values()))


def policy_view(policy) -> dict | None:
    """An adaptive policy's measurements per size class: median step ms (plain; per budget,
    with tokens committed per request), the budget it runs, back-off."""
    if not isinstance(policy, AdaptivePolicy):
        return None

    def ms(times) -> float | None:
        return 1e3 * sorted(times)[len(times) // 2] if times else None
    return {key: {"plain_ms": ms(c.plain_s), "best": c.best(), "backoff": c.backoff,
                  "budgets": {b: {"ms": ms(m.seconds), "accepted": m.accepted}
                              for b, m in c.budgets.items()}}
            for key, c in sorted(policy.size_classes.items())}


def _interpolate(xs: list[float], ys: list[float], y: float) -> float:
    """x where the increasing-ish curve ys(xs) reaches y (clamped to the ends)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 <= y <= y1 and y1 > y0:
            return x0 + (x1 - x0) * (y - y0) / (y1 - y0)
    return xs[-1] if y > max(ys) else xs[0]


# --------------------------------------------------------------------------- end to end
def e2e_flashtree(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """Greedy generation, one request at a time: tokens/s over all, mean acceptance, outputs."""
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs, seconds = [], 0.0
    for p in prompts:
        s, out = wall_s(lambda p=p: llm.generate([p], sp)[0].outputs[0], llm.device)
        outs.append(out)
        seconds += s
    accepts = [a for o in outs for a in o.spec_accept_lengths]
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds,
            "mean_accept": _mean(accepts), "outputs": [list(o.token_ids) for o in outs]}


def e2e_numbers(run_s, tokens: int) -> dict:
    """tokens/s of one run of `tokens` new tokens, and decode ms/token net of the first."""
    run_s(4)  # warm-up
    full, one = run_s(tokens), run_s(1)
    return {"tokens_per_s": tokens / full, "seconds": full, "first_token_s": one,
            "decode_ms_per_token": (full - one) / (tokens - 1) * 1e3}


def flashtree_s(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Seconds of one greedy generate of exactly `tokens` new tokens (prefill included)."""
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    seconds, out = wall_s(lambda: llm.generate([prompt], sp), llm.device)
    assert len(out[0].outputs[0].token_ids) == tokens
    return seconds


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model of a checkpoint directory or a GGUF file."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=dtype, device_map=str(device))  # = .to(device), without a CPU copy first
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    **kw).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def hf_generate_s(model, prompt: list[int], tokens: int) -> float:
    """Seconds of one greedy `generate` of exactly `tokens` new tokens (prefill included)."""
    device = model.device
    ids = torch.tensor([prompt], device=device)  # [1, L]
    with torch.inference_mode():
        seconds, out = wall_s(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
            min_new_tokens=tokens, pad_token_id=0), device)
    assert out.shape[1] == len(prompt) + tokens, out.shape
    return seconds


def pair_prompts(target: Path, n: int) -> tuple[list[list[int]], str]:
    """`n` held-out prompts (round robin over chat/code/math) through the target's chat
    template; random token ids when it has no tokenizer."""
    from flashtree.bench.prompt_sets import BUILT_IN
    from flashtree.tokenizer import Tokenizer

    texts = [t for group in zip(*BUILT_IN.values()) for t in group][:n]
    try:
        tok = Tokenizer.load(target)
        return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts], \
            "held-out chat/code/math prompts, chat template"
    except Exception as e:  # noqa: BLE001 - a tokenizer-less target still gets measured
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(4)
        ids = [torch.randint(0, vocab - 1, (48,), generator=gen).tolist() for _ in range(n)]
        return ids, f"random 48-token prompts (no chat template: {type(e).__name__})"


def reference_dflash(target: Path, drafter: Path, prompts: list[list[int]], tokens: int,
                     dtype: torch.dtype, device: torch.device) -> dict:
    """z-lab's `dflash_generate` on transformers' model of the same checkpoint, greedy, batch
    1, no stop tokens: block 1 (its AR) and the drafter's block (the DFlash chain)."""
    import dflash.model as ref

    if device.type != "cuda":
        ref._cuda_time = time.perf_counter  # its timer synchronizes CUDA unconditionally
    model = load_hf(target, dtype, device)
    draft = ref.DFlashDraftModel.from_pretrained(str(drafter), dtype=dtype).to(device).eval()
    out = {}
    for name, block in (("reference_ar", 1), ("reference_chain", None)):
        def one(p: list[int], n: int = tokens, b: int | None = block):
            return ref.dflash_generate(draft, model, torch.tensor([p], device=device), n, None,
                                       temperature=0.0, block_size=b, return_stats=True)

        one(prompts[0], 8)  # warm-up
        timed = [wall_s(lambda p=p: one(p), device) for p in prompts]
        stats = [s for _, s in timed]
        accepts = [a for s in stats for a in s.acceptance_lengths]
        seconds = sum(t for t, _ in timed)
        out[name] = {
            "tokens_per_s": sum(s.num_output_tokens for s in stats) / seconds,
            "seconds": seconds, "mean_accept": _mean(accepts),
            "outputs": [s.output_ids[0, s.num_input_tokens:].tolist() for s in stats]}
        print(f"reference {name}: {out[name]['tokens_per_s']:.1f} tok/s", flush=True)
    return out


# --------------------------------------------------------------------------- report
def summary(res: dict) -> dict:
    """The headline keys (the goals' and others) from the sections present."""
    out: dict = {}
    st, ver, c1, prof, sw, pair, gen = (res.get(k) for k in (
        "steps", "verify", "c1", "profile", "sweep", "pair", "generate"))
    if st:
        ar = st["ar"].get("1") or next(iter(st["ar"].values()))
        out.update(ar_step_over_floor=ar["ms"] / ar["floor_ms"],
                   draft_over_ar_step=st["draft_ms"] / ar["ms"],
                   **{f"{k[:-3]}_over_ar_step": v / ar["ms"] for k, v in st.items()
                      if k.startswith("verify") and k.endswith("_ms") and "replay" not in k})
        if "peer_ms" in st:
            out["ar_speed_over_compiled_peer"] = st["peer_ms"] / ar["ms"]
        if st["graphs"]:
            out["ar_graph_speedup_b1"] = ar["eager_ms"] / ar["ms"]
    if ver and "256" in (first_ctx := next(iter(ver["over_ar_step"].values()))):
        out["verify256_over_ar_step"] = first_ctx["256"]
    if c1:
        best = c1["ddtree_budgets"][str(c1["best_budget"])]
        none, dflash = c1["none"]["tokens_per_s"], c1["dflash"]["tokens_per_s"]
        out.update(dflash_over_none_c1=dflash / none,
                   ddtree_over_none_c1=best["tokens_per_s"] / none,
                   ddtree_over_dflash_c1=best["tokens_per_s"] / dflash,
                   ddtree_best_budget_c1=c1["best_budget"],
                   measured_tau_dflash=c1["dflash"]["tau"], measured_tau_ddtree=best["tau"],
                   adaptive_tau_over_fixed_tau=(taus := c1.get("adaptive_tau_over_fixed_tau")))
        out["adaptive_tau_bias_in_se"] = max(  # the largest |ratio - 1| in standard errors
            (abs(t["ratio"] - 1) / t["se"] for t in (taus or {}).values() if t["se"]), default=None)
    if prof:
        reads = [prof[m]["device_reads"] for m in ("dflash", "ddtree")]
        dd = prof["ddtree"]
        out.update(gpu_busy_ddtree_step=dd["gpu_busy"], host_ms_between_steps=None if
                   dd["gpu_busy_ms"] is None else dd["wall_ms"] - dd["gpu_busy_ms"],
                   device_reads_per_spec_step=None if None in reads else max(reads))
    if sw:
        out.update(_sweep_keys(sw))
    if pair:
        ref = pair["reference_chain"]["tokens_per_s"]
        out.update(speedup_vs_reference_dflash=pair["dflash"]["tokens_per_s"] / ref,
                   ddtree_speedup_vs_reference_dflash=pair["ddtree"]["tokens_per_s"] / ref,
                   ddtree_over_dflash_e2e=pair["ddtree"]["tokens_per_s"]
                   / pair["dflash"]["tokens_per_s"])
    if gen:
        out["flashtree_over_transformers"] = (gen["flashtree"]["tokens_per_s"]
                                              / gen["transformers"]["tokens_per_s"])
    return out


def _sweep_keys(sw: dict) -> dict:
    """The lowest adaptive speedup over `none`; the lowest of adaptive DDTree over the best
    fixed policy per concurrency (issue 65's goal), DFlash's beside it; and the lowest 95%
    lower bound of the adaptive methods' round-by-round ratios."""
    rate = {name: [sum(r["tokens_per_s"] for r in row["runs"]) / len(row["runs"])
                   for row in rows] for name, rows in sw["rows"].items()}
    over_none, over_fixed, lows = [], {}, []
    for spec in ("dflash", "ddtree"):
        fixed = [rows for name, rows in rate.items() if name.startswith(f"{spec}:fixed")]
        for none, adaptive, *fixed_at in zip(rate.get("none", []), rate.get(spec, []), *fixed):
            over_none.append(adaptive / none)
            over_fixed.setdefault(spec, []).append(adaptive / max(none, *fixed_at))
        if spec in sw["rows"] and "none" in sw["rows"]:
            lows += [i[0] for level in range(len(sw["levels"]))
                     if (i := mean_interval(_round_ratios(sw, spec, level))) is not None]
    out = {}
    if over_none:
        out["min_spec_over_none"] = min(over_none)
    if "ddtree" in over_fixed:
        out["min_adaptive_over_best_fixed"] = min(over_fixed["ddtree"])
    if "dflash" in over_fixed:
        out["min_adaptive_dflash_over_best_fixed"] = min(over_fixed["dflash"])
    if lows:
        out["min_spec_over_none_low"] = float(min(lows))
    return out


def _round_ratios(sw: dict, name: str, level: int) -> list[float]:
    """Tokens/s of `name` over `none` at the level-th concurrency, round j over round j."""
    rows, plain = sw["rows"][name], sw["rows"]["none"]
    if level >= len(rows) or level >= len(plain):
        return []
    return [a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(rows[level]["runs"], plain[level]["runs"])]


def report(res: dict, keys: dict) -> list[str]:
    lines = []
    cal = res.get("calibrate")
    if cal:
        lines += [f"Oracle settings: **paper-DFlash** P = {cal['p']:.4f} (chain acceptance "
                  f"{cal.get('dflash_tau', PAPER_DFLASH_TAU)} at block {cal.get('block', BLOCK)}); "
                  f"**paper-DDTree** the same P with Q = {cal['q']:.3f} (Monte Carlo over the "
                  f"drafter's own logits: the {cal['calibration_budget']}-node tree accepts "
                  f"{cal.get('ddtree_tau', PAPER_DDTREE_TAU)}). The "
                  f"drafter's top token holds {cal['drafter_top1_mass']:.0%} of its mass.", ""]
    lines += [f"`{k}` {v:.3f}  " for k, v in keys.items() if isinstance(v, float)] + [""]
    for name, lines_of in SECTION_LINES.items():
        if name in res:
            lines += lines_of(res[name])
    return lines + failure_lines(res)


def _steps_lines(st: dict) -> list[str]:
    chain = st.get("chain", BLOCK)
    lines = [f"## Steps at context {st['ctx']} (copy bandwidth {st['bytes_per_s'] / 1e9:.0f} "
             "GB/s)", "", f"Weights {st['weight_bytes'] / 1e9:.2f} GB, a decode step reads "
             f"{st['weight_bytes_read'] / 1e9:.2f} GB of them besides routed experts; KV "
             f"{st['kv_bytes_per_token'] / 1e3:.1f} kB per token. Floor: those bytes, the "
             "experts the step's tokens touch and its KV at the copy bandwidth. Smallest top-2 "
             f"logit gap over a prompt {st['min_top2_gap']:.1f} (largest logit "
             f"{st['max_logit']:.1f}).", "",
             "| batch | step ms | eager ms | floor ms | step / floor |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {r['ms']:.3f} | {r['eager_ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{r['ms'] / r['floor_ms']:.2f} |" for b, r in st["ar"].items()]
    lines += [f"| {b} | not run: {why} | | | |" for b, why in st.get("skipped", {}).items()]
    device = step_times(st, device=True)
    peer = (f"compiled peer {st['peer_ms']:.3f} ms (compiled in {st['peer_compile_s']:.0f} s)"
            if "peer_ms" in st else f"compiled peer {st['peer']}")
    return lines + ["", f"Whole engine step at batch 1: {st['engine_step_ms']:.3f} ms; {peer}. "
                    f"DFlash engine: decode {st['decode_with_context_ms']:.3f} ms (context "
                    f"written for the drafter), {chain}-token chain verify "
                    f"{st[f'verify{chain}_ms']:.3f} ms{_x_floor(st, f'verify{chain}')}, draft "
                    f"{st['draft_ms']:.3f} ms{_x_floor(st, 'draft')}, a block's "
                    f"context injection {st['inject_ms']:.3f} ms; DDTree engine: 64-node verify "
                    f"{st['verify64_ms']:.3f} ms. Graph-replayed: {st['graphs']}.", ""] + ([
        "Their graphs replayed alone (the device's time, which the guard compares): " + ", ".join(
            f"{k[:-3]} {v:.3f} ms" for k, v in device.items()) + ".", ""] if device else [])


def _x_floor(st: dict, step: str) -> str:
    floor = st.get(f"{step}_floor_ms")
    return "" if floor is None else f" ({st[f'{step}_ms'] / floor:.2f}x its floor)"


def _verify_lines(v: dict) -> list[str]:
    ctxs, floors = list(v["ms"]), v.get("floor_ms", {})
    lines = ["## Tree verify over the AR step and its floor (batch 1, random trees of depth < "
             "16)", "", "| nodes | " + " | ".join(f"ctx {c} ms | / AR step | / floor"
                                                  for c in ctxs) + " |",
             "|---|" + "---|---|---|" * len(ctxs)]
    for n in v["ms"][ctxs[0]]:
        lines.append(f"| {n} | " + " | ".join(
            f"{v['ms'][c][n]:.3f} | {v['over_ar_step'][c][n]:.2f} | "
            + (f"{v['ms'][c][n] / floors[c][n]:.2f}" if c in floors else "-")
            for c in ctxs) + " |")
    return lines + [""]


def _c1_lines(c1: dict) -> list[str]:
    none = c1["none"]["tokens_per_s"]
    rows = [("none", c1["none"]), ("DFlash (fixed)", c1["dflash"]),
            ("DFlash (adaptive)", c1["dflash_adaptive"])]
    rows += [(f"DDTree budget {b}", v) for b, v in c1["ddtree_budgets"].items()]
    rows += [(f"DDTree budget {c1['best_budget']}, topk_cap "
              f"{c1['ddtree_topk_cap']['topk_cap']}", c1["ddtree_topk_cap"]),
             (f"DDTree budget {c1['best_budget']} (adaptive)", c1["ddtree_adaptive"])]
    lines = [f"## Concurrency 1 ({c1['prompts']} prompts one after another)", "",
             "| method | tokens/s | x none | tokens/step (± s.e.) | equal to plain |",
             "|---|---|---|---|---|"]
    for name, v in rows:
        eq = "-" if v.get("equal_to_plain") is None else f"{v['equal_to_plain']:.0%}"
        se = "" if v.get("tau_se") is None else f" ± {v['tau_se']:.2f}"
        lines.append(f"| {name} | {v['tokens_per_s']:.1f} | {v['tokens_per_s'] / none:.2f} | "
                     f"{v['tau']:.2f}{se} | {eq} |")
    return lines + ["", f"Best DDTree budget: {c1['best_budget']}.", ""]


def _profile_lines(prof: dict) -> list[str]:
    budget = f", DDTree at {prof['ddtree_budget']} nodes" if "ddtree_budget" in prof else ""
    lines = [f"## Engine steps under the profiler ({prof['batch']} requests, {prof['sampled']} "
             f"sampled{budget})", ""]
    for name in ("none", "dflash", "ddtree"):
        lines += [f"{prof[name]['tokens_per_step']:.2f} tokens per request per step.", "",
                  *profile_lines(name, prof[name])]
    return lines


def _sweep_lines(sw: dict) -> list[str]:
    names = list(sw["rows"])
    lines = [f"## Concurrency sweep (DFlash at paper-DFlash, DDTree budget {sw['ddtree_budget']}"
             f" at paper-DDTree; {sw['tokens']} timed tokens per request, {sw['rounds']} rounds:"
             " mean [min-max] tokens/s)", "",
             "| concurrency | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, c in enumerate(sw["levels"]):
        cells = []
        for name in names:
            runs = ([r["tokens_per_s"] for r in sw["rows"][name][i]["runs"]]
                    if i < len(sw["rows"][name]) else [])
            cells.append(f"{sum(runs) / len(runs):.0f} [{min(runs):.0f}-{max(runs):.0f}]"
                         if runs else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    specs = [n for n in names if n != "none"]
    if "none" not in names or not specs:
        return lines + [""]
    lines += ["", "Over `none`, round by round: mean (95% interval of the mean; where it holds "
              "1.0 the rounds do not tell the method from `none`)", "",
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


def _generate_lines(g: dict) -> list[str]:
    f, h = g["flashtree"], g["transformers"]
    return [f"## End to end against transformers (batch 1, {g['prompt_tokens']}-token prompt, "
            f"{g['new_tokens']} new tokens, greedy)", "",
            "| engine | tokens/s | total s | decode ms/token |", "|---|---|---|---|",
            f"| flashtree (spec none) | {f['tokens_per_s']:.1f} | {f['seconds']:.3f} | "
            f"{f['decode_ms_per_token']:.3f} |",
            f"| transformers generate | {h['tokens_per_s']:.1f} | {h['seconds']:.3f} | "
            f"{h['decode_ms_per_token']:.3f} |", ""]


def _pair_lines(p: dict) -> list[str]:
    ref = p["reference_chain"]["tokens_per_s"]
    rows = [("flashtree none", p["none"]), ("flashtree DFlash", p["dflash"]),
            ("flashtree DDTree", p["ddtree"]), ("reference, block 1 (its AR)", p["reference_ar"]),
            ("reference chain", p["reference_chain"])]
    return [f"## Default pair end to end ({p['num_prompts']} {p['prompts']}, {p['tokens']} new "
            "tokens each, greedy, one at a time, fixed policy)", "",
            "| engine | tokens/s | mean acceptance | vs reference chain |", "|---|---|---|---|",
            *[f"| {n} | {x['tokens_per_s']:.1f} | {x['mean_accept']:.2f} | "
              f"{x['tokens_per_s'] / ref:.2f}x |" for n, x in rows], "",
            f"Requests whose tokens equal: DFlash and the reference chain "
            f"{p['dflash_equal_to_reference']}/{p['num_prompts']} (bf16 near-ties may split "
            f"them); DFlash and plain {p['dflash_equal_to_none']}, DDTree and plain "
            f"{p['ddtree_equal_to_none']}.", ""]


def _acceptance_lines(acc: dict) -> list[str]:
    cats = [*acc["categories"], "all"]
    lines = ["## Tokens per target forward on held-out prompts (" + ", ".join(
        f"{k} {n}" for k, n in acc["categories"].items()) + f"; chat template, at most "
        f"{acc['max_tokens']} tokens; fixed policy)", "",
        "| spec | sampling | T | " + " | ".join(cats) + " | verify steps |",
        "|---|---|---|" + "---|" * len(cats) + "---|"]
    lines += [f"| {r['spec']} | {r['sampling']} | {r['T']} | "
              + " | ".join(f"{r[c]:.2f}" for c in cats) + f" | {r['steps']} |"
              for r in acc["rows"]]
    return lines + [""]


SECTION_LINES = {"steps": _steps_lines, "verify": _verify_lines, "c1": _c1_lines,
                 "profile": _profile_lines, "sweep": _sweep_lines, "generate": _generate_lines,
                 "pair": _pair_lines, "acceptance": _acceptance_lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="steps,calibrate,c1,profile",
                    help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--layers", type=int, help="target depth (default: the shape's)")
    ap.add_argument("--built-layers", type=int, help="with --layout: build this many layers and "
                    "repeat their MoE layers' weights to --layers (a full depth's steps where "
                    "its weights do not fit; random_pair.repeat_layers)")
    ap.add_argument("--first-dense", type=int, help="DeepSeek shapes: dense layers first")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--layout", help="tpN, epN or tpNepM: one rank's share of the layout, run "
                    "in a group of one (its kernels and collectives; no wire time) with the "
                    "shape's seeds' drafter (random_pair.random_rank)")
    ap.add_argument("--dflash-tau", type=float, default=PAPER_DFLASH_TAU, help="chain acceptance")
    ap.add_argument("--ddtree-tau", type=float, default=PAPER_DDTREE_TAU,
                    help="what the calibration budget's tree accepts under the oracle")
    ap.add_argument("--curve-taus", type=lambda v: [float(x) for x in v.split(",") if x],
                    default=list(CURVE_TAUS), help="c1's curve of chain acceptances ('': none)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens (the context)")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32], help="AR step batches")
    ap.add_argument("--verify-ctxs", type=int_list, default=[1024, 4096])
    ap.add_argument("--trees", type=int_list, default=[2**i for i in range(10)], help="verify's")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=16,
                    help="prompts at concurrency 1 (fewer: tokens/step too noisy to rank budgets)")
    ap.add_argument("--skip", type=int, default=48, help="tokens per request before timing")
    ap.add_argument("--tokens", type=int, default=256, help="timed tokens per request")
    ap.add_argument("--trials", type=int, default=256, help="Monte Carlo trials per setting")
    ap.add_argument("--budgets", type=int_list, default=[15, 31, 63, 127, 255, 511], help="c1's")
    ap.add_argument("--topk-cap", type=int, help="topk_cap compared at the best budget")
    ap.add_argument("--profile-batch", type=int, default=1)
    ap.add_argument("--profile-budget", type=int, help="DDTree nodes (default: c1's best budget, "
                    f"from this run or --out's; else {CALIBRATION_BUDGET})")
    ap.add_argument("--sampled-fraction", type=float, default=0.0, help="profile's at T=1")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128,256", help="sweep concurrencies")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sweep-tokens", type=int, default=128)
    ap.add_argument("--sweep-methods", default="none,dflash,ddtree")
    ap.add_argument("--sweep-budget", type=int, help="DDTree's (default: c1's best, <= 63)")
    ap.add_argument("--work", default="/tmp/flashtree_speculative", help="generate: checkpoint")
    ap.add_argument("--gen-prompt", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--default-model", default="default", help="pair/acceptance target")
    ap.add_argument("--default-draft", default=str(DEFAULT_DRAFTER_DIR))
    ap.add_argument("--pair-prompts", type=int, default=8)
    ap.add_argument("--pair-tokens", type=int, default=128)
    ap.add_argument("--acceptance-modes", default="dflash:match,ddtree:match,dflash:rrs,"
                    "ddtree:rrs", help="comma list of spec:tree_sampling")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--acceptance-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results") /
                    f"{datetime.date.today()}-speculative.md")
    ap.add_argument("--plot", type=Path, help="draw the plot of this JSON and exit")
    ap.add_argument("--guard", nargs="?", const="last", help="steps against a committed JSON "
                    "(default: the last of this shape, depth, layout and GPU); exit 1 if slower")
    ap.add_argument("--guard-tolerance", type=float, default=0.03)
    args = ap.parse_args()
    if args.plot:
        speedup_plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    if args.built_layers and not args.layout:
        ap.error("--built-layers repeats a rank's layers: give --layout too (e.g. tp8)")
    if args.profile_budget is not None and args.profile_budget < 1:
        ap.error(f"--profile-budget {args.profile_budget}: DDTree's nodes, at least 1")
    path = args.out.with_suffix(".json")
    old = json.loads(path.read_text()) if path.exists() else {}
    res = {k: old[k] for k in (*SECTIONS, "errors", "commands") if k in old}
    res["commands"] = [*res.get("commands", []), command()]
    layers = with_layers(SHAPES[args.shape], args.layers)["num_hidden_layers"]
    draft_layers = (DRAFTER_LAYOUT.get(args.shape, (5,))[0] if args.layout
                    else args.draft_layers)

    def save() -> None:
        keys = summary(res)
        built = f" (weights of {args.built_layers} repeated)" if args.built_layers else ""
        write_results(args.out, f"Speculative steps and end to end: {args.shape}-shaped target, "
                      f"{layers} layers{built}, {args.dtype}", report(res, keys),
                      {**res, **keys, "shape": args.shape, "layers": layers,
                       "built_layers": args.built_layers,
                       "layout": args.layout, "draft_layers": draft_layers,
                       "command": "; ".join(res["commands"])}, GOAL_KEYS)

    bench = Bench(args, res, save)
    share = rank_share(args.layout, args.device) if args.layout else contextlib.nullcontext()
    with share:
        run_sections(bench, sections, res, save)
    print(f"report: {args.out.with_suffix('.md')}\njson:   {path}")
    if args.guard and not guard(json.loads(path.read_text()), args.guard, path,
                                args.guard_tolerance):
        raise SystemExit(1)


def guard(run: dict, against: str, path: Path, tolerance: float) -> bool:
    """Print this run's steps against `against` (a JSON, or "last": the last committed of the
    same shape, depth, layout and GPU); False if one is slower by more than `tolerance`."""
    before = last_results(run, exclude=path) if against == "last" else Path(against)
    if before is None or "steps" not in run:
        print("guard: nothing to compare (no steps, or no committed run of this shape, depth, "
              "layout and GPU)")
        return True
    rows = compare(run["steps"], json.loads(before.read_text())["steps"], tolerance)
    print(f"guard against {before}:")
    for r in rows:
        replay = (f"; device {r['before_replay_ms']:.3f} -> {r['now_replay_ms']:.3f} ms "
                  f"({r['replay_ratio']:.3f}x)" if "replay_ratio" in r else "")
        print(f"  {r['step']}: {r['before_ms']:.3f} -> {r['now_ms']:.3f} ms ({r['ratio']:.3f}x)"
              + replay + ("  SLOWER" if r["slower"] else ""))
    return not any(r["slower"] for r in rows)


def run_sections(bench: Bench, sections: list[str], res: dict, save) -> None:
    for section in sections:
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


if __name__ == "__main__":
    main()
