"""GPU fast-path benchmark (issue 8): one run on one GPU measures

1. copy bandwidth (device-to-device copy of a large bf16 tensor);
2. on a Qwen3-8B-shaped bf16 target with random weights and a 5-layer Qwen3-8B-shaped DFlash
   drafter (block 16): the AR decode step at batch 1/8/32 against its bandwidth floor, the tree
   verify step for 1..512 nodes at context 1k and 4k, the draft step, and end-to-end greedy
   generation of flashtree AR against `transformers` `generate` on the same checkpoint;
3. on the default pair (SmolLM2-135M GGUF + a DFlash drafter): end-to-end tokens/s of flashtree
   AR, DFlash and DDTree against the reference `dflash` package's `dflash_generate`;

and writes `benchmarks/results/<date>-gpu.md` plus a JSON beside it, with goals met / not met.

    python benchmarks/gpu_bench.py             # default pair: SmolLM2 + the shipped drafter
    python benchmarks/gpu_bench.py --shape tiny --device cpu --work /tmp/gb --out /tmp/gb/x.md \
        --default-model TINY_TARGET --default-draft TINY_DRAFTER      # a check of the script

Every section is wrapped: a failure is recorded (traceback in the report) and the rest still run.
Step times are wall times of `engine.runner.forward` (or `proposer.draft_logits`) between device
synchronizations, host work included: median of `--reps` after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tp_bench import make_drafter, make_target, step_times  # noqa: E402
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.attention.backend import AttentionMetadata  # noqa: E402
from flashtree.bench.random_pair import QWEN3_8B, TINY  # noqa: E402
from flashtree.kv.cache import PageTables  # noqa: E402
from flashtree.models.registry import DEFAULT_DRAFTER_DIR  # noqa: E402
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode  # noqa: E402
from flashtree.speculative.proposer import ContextRows  # noqa: E402
from flashtree.speculative.tree import ancestor_mask  # noqa: E402

SECTIONS = ("bandwidth", "ar_step", "generate", "verify", "draft", "default_pair")
# Scratch request ids count down from here (real ids count up from 0; cost.py's from -1e6).
SCRATCH_IDS = itertools.count(-2_000_000, -1)
TREE_MAX_DEPTH = 15  # block 16: a DDTree has at most 15 levels below the root

GOALS = [  # (JSON key, comparison, threshold, wording)
    ("ar_step_over_floor", "<=", 1.15, "AR step (batch 1, ctx 1k) within 1.15x of the floor"),
    ("verify64_over_ar_step", "<=", 1.2, "64-node tree verify within 1.2x of an AR step"),
    ("draft_over_ar_step", "<=", 0.15, "draft step within 0.15x of an AR step"),
    ("speedup_vs_reference_dflash", ">=", 10.0,
     "at least 10x the reference `dflash_generate` end to end (DFlash chain vs its chain)"),
    ("ddtree_over_dflash_e2e", ">", 1.0, "DDTree faster than the DFlash chain e2e, default pair"),
]


@dataclass(frozen=True)
class Preset:
    shape: dict
    copy_mib: int  # size of the copied tensor
    ctx: int  # context of the AR / draft steps and of the first verify context
    batches: tuple[int, ...]
    verify_ctxs: tuple[int, ...]
    tree_sizes: tuple[int, ...]
    reps: int
    gen_prompt: int  # random prompt tokens for the 8B-shaped end-to-end runs
    gen_tokens: int
    pair_tokens: int  # new tokens per default-pair request


TREES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PRESETS = {
    "qwen3-8b": Preset(QWEN3_8B, 2048, 1024, (1, 8, 32), (1024, 4096), TREES, 20, 1024, 128, 128),
    "tiny": Preset(TINY, 64, 256, (1, 8, 32), (256, 1024), TREES, 5, 256, 32, 32),
}


# --------------------------------------------------------------------------- timing helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median wall milliseconds of `fn()` between device synchronizations."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def top_ops(fn: Callable[[], object], device: torch.device, k: int = 8) -> tuple[float, list]:
    """One profiled call of `fn`: total self time of all ops/kernels (ms; device time on CUDA,
    CPU time otherwise) and the top `k` as (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)

    def self_us(e) -> float:
        if device.type == "cuda":
            return float(getattr(e, "self_device_time_total", 0)
                         or getattr(e, "self_cuda_time_total", 0))
        return float(e.self_cpu_time_total)

    rows = sorted(prof.key_averages(), key=self_us, reverse=True)
    total = sum(self_us(e) for e in rows) / 1e3
    return total, [(e.key[:70], self_us(e) / 1e3, e.count) for e in rows[:k] if self_us(e) > 0]


class Scratch:
    """Scratch requests holding KV pages of an engine while a measurement runs."""

    def __init__(self, llm: LLM) -> None:
        self.pages = llm.engine.pages
        self.ids: list[int] = []

    def take(self, count: int, committed: int, extra: int) -> list[int]:
        """`count` requests with `committed` tokens of (scratch) KV and room for `extra` more."""
        ids = [next(SCRATCH_IDS) for _ in range(count)]
        for sid in ids:
            self.pages.reserve(sid, committed)
            self.pages.set_length(sid, committed)  # (frees pages past `committed`)
            self.pages.reserve(sid, committed + extra)
        self.ids += ids
        return ids

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc) -> None:
        for sid in self.ids:
            self.pages.free(sid)


# --------------------------------------------------------------------------- measurements
def copy_bandwidth(device: torch.device, mib: int, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of a `mib` MiB bf16 tensor."""
    n = mib * (1 << 20) // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)  # [n]
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, max(reps, 10))
    return 2 * n * 2 / (ms / 1e3)


def weight_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of all target parameters, tied tensors once; bytes a decode step reads): a decode
    step reads every matrix and lm_head, but of the embedding table only the rows it looks up
    (negligible), so an untied table is left out; a tied one is read as lm_head."""
    model = llm.model
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    emb = model.embed_tokens.weight
    tied = emb.data_ptr() == model.lm_head.weight.data_ptr()
    return total, total if tied else total - emb.numel() * emb.element_size()


def ar_forward(llm: LLM, s: Scratch, batch: int, ctx: int) -> Callable[[], object]:
    """One DECODE forward of `batch` scratch requests, each with `ctx` tokens of KV."""
    runner = llm.engine.runner
    items = [BatchItem(sid, ctx, [7]) for sid in s.take(batch, ctx, 1)]
    return lambda: runner.forward(Mode.DECODE, items)


def ar_step_ms(llm: LLM, batch: int, ctx: int, reps: int) -> float:
    with Scratch(llm) as s:
        return median_ms(ar_forward(llm, s, batch, ctx), llm.engine.runner.device, reps)


def random_tree(n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A random rooted tree of n nodes in topological order: (parent, depth), root 0 -> 0,
    depth capped at TREE_MAX_DEPTH as a block-16 DDTree is."""
    parent, depth = [0], [0]
    for i in range(1, n):
        p = rng.choice([j for j in range(i) if depth[j] < TREE_MAX_DEPTH])
        parent.append(p)
        depth.append(depth[p] + 1)
    return parent, depth


def verify_item(seq_id: int, ctx: int, n: int, rng: random.Random, vocab: int,
                device: torch.device) -> BatchItem:
    parent, depth = random_tree(n, rng)
    visible = ancestor_mask(torch.tensor([parent]))[0].to(device)  # [n, n] bool
    tokens = [rng.randrange(vocab - 1) for _ in range(n)]
    return BatchItem(seq_id, ctx, tokens, all_logits=True,
                     positions=[ctx + d for d in depth], visible=visible)


def paged_verify_batch(batch: int, ctx: int, tokens: int, page: int, tree: bool,
                       rng: random.Random, device: torch.device
                       ) -> tuple[AttentionMetadata, int]:
    """The attention metadata of one VERIFY forward of `batch` requests, each `ctx` tokens of
    context plus `tokens` new ones (a random tree of at most 4-wide fan-in when `tree`, else a
    chain), over a page pool of just enough pages -> (metadata, pages in the pool)."""
    total = ctx + tokens
    num_pages = batch * -(-total // page) + 1
    pages = PageTables(num_pages, page)
    items = []
    for i in range(batch):
        pages.reserve(i, total)
        visible = None
        if tree:
            parents = [0] + [rng.randrange(max(0, v - 4), v) for v in range(1, tokens)]
            visible = ancestor_mask(torch.tensor([parents]))[0].to(device)
        items.append(BatchItem(i, ctx, [0] * tokens, visible=visible))
    return ForwardBatch.build(Mode.VERIFY, items, pages, device).attn, num_pages


def verify_forward(llm: LLM, s: Scratch, n: int, ctx: int, vocab: int) -> Callable[[], object]:
    """One VERIFY forward of an n-node tree (all logits) after `ctx` tokens, batch 1."""
    runner = llm.engine.runner
    item = verify_item(s.take(1, ctx, n)[0], ctx, n, random.Random(n), vocab, runner.device)
    return lambda: runner.forward(Mode.VERIFY, [item])


def verify_ms(llm: LLM, n: int, ctx: int, reps: int, vocab: int) -> float:
    with Scratch(llm) as s:
        return median_ms(verify_forward(llm, s, n, ctx, vocab), llm.engine.runner.device, reps)


def draft_setup(llm: LLM, s: Scratch, ctx: int) -> tuple[list, torch.Tensor, int]:
    """A scratch request with `ctx` tokens of draft context KV; returns (draft blocks, the
    context features [ctx, len(target_layer_ids) * hidden], seq id)."""
    prop = llm.engine.proposer
    sid = s.take(1, ctx, prop.block_size)[0]
    gen = torch.Generator(llm.engine.runner.device).manual_seed(0)
    feats = torch.randn(ctx, prop.draft.fc.in_features, generator=gen,
                        device=llm.engine.runner.device).to(llm.dtype)
    prop.inject([ContextRows(feats, ((sid, 0, ctx),))])
    return [(sid, ctx, 7, prop.block_size)], feats, sid


def e2e_flashtree(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """Greedy generation, one request at a time: tokens/s over all, mean acceptance, outputs."""
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs, seconds = [], 0.0
    for p in prompts:
        sync(llm.device)
        t = time.perf_counter()
        outs.append(llm.generate([p], sp)[0].outputs[0])
        sync(llm.device)
        seconds += time.perf_counter() - t
    accepts = [a for o in outs for a in o.spec_accept_lengths]
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds, "seconds": seconds,
            "mean_accept": sum(accepts) / len(accepts) if accepts else float("nan"),
            "outputs": [list(o.token_ids) for o in outs]}


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model of a checkpoint directory or a GGUF file."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=dtype, device_map=str(device))  # = .to(device), without a CPU copy first
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return model.eval()


def e2e_numbers(run_s: Callable[[int], float], tokens: int) -> dict:
    """tokens/s of one run of `tokens` new tokens, and decode ms/token net of the first."""
    full, one = run_s(tokens), run_s(1)
    return {"tokens_per_s": tokens / full, "seconds": full, "first_token_s": one,
            "decode_ms_per_token": (full - one) / (tokens - 1) * 1e3}


def ft_e2e(llm: LLM, prompt: list[int], tokens: int) -> dict:
    def run_s(n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        sync(llm.device)
        t = time.perf_counter()
        out = llm.generate([prompt], sp)  # one prompt of token ids
        sync(llm.device)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t

    run_s(4)  # warm-up
    return e2e_numbers(run_s, tokens)


def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_e2e(target: Path, prompt: list[int], tokens: int, dtype: torch.dtype,
           device: torch.device) -> dict:
    model = load_hf(target, dtype, device)
    hf_generate_s(model, prompt, 4, device)  # warm-up
    return e2e_numbers(lambda n: hf_generate_s(model, prompt, n, device), tokens)


def hf_generate_s(model, prompt: list[int], tokens: int, device: torch.device) -> float:
    """Seconds of one greedy `generate` of exactly `tokens` new tokens (prefill included)."""
    ids = torch.tensor([prompt], device=device)  # [1, L]
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
              min_new_tokens=tokens, pad_token_id=0)
    with torch.inference_mode():
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(device)
    assert out.shape[1] == len(prompt) + tokens, out.shape
    return time.perf_counter() - t


# --------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.p = PRESETS[args.shape]
        if args.reps:
            self.p = replace(self.p, reps=args.reps)
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.work = Path(args.work)
        self.res: dict = {}  # raw numbers, section -> values
        self.md: list[str] = []
        self.errors: dict[str, str] = {}
        self.done: list[str] = []  # sections finished (well or not)
        self.start = time.time()
        self._llm: tuple[tuple[str, int | None], LLM] | None = None
        self._ckpt: tuple[Path, Path] | None = None

    # --- shared state -------------------------------------------------------------------
    def checkpoints(self) -> tuple[Path, Path]:
        """The 8B-shaped target and its 5-layer block-16 drafter (random weights), built once."""
        if self._ckpt is None:
            gen_dev = "cuda" if torch.cuda.is_available() else "cpu"
            shape = self.p.shape
            target = self.work / f"{self.args.shape}-target"
            drafter = self.work / f"{self.args.shape}-drafter"
            if not (target / "model.safetensors.index.json").exists():
                make_target(target, shape, shape["num_hidden_layers"], gen_dev)
            if not (drafter / "model.safetensors.index.json").exists():
                make_drafter(drafter, target, shape, 5, 16, gen_dev)
            self._ckpt = target, drafter
        return self._ckpt

    def llm(self, spec: str, tree_budget: int | None = None) -> LLM:
        """The 8B-shaped target as an LLM with `spec` (none or ddtree); one held at a time.
        The engine captures one verify shape, its tree budget's (default: the largest tree
        size), so each verified tree size gets its own engine."""
        p = self.p
        tree_budget = tree_budget or max(p.tree_sizes) - 1
        key = (spec, tree_budget if spec == "ddtree" else None)
        if self._llm is not None and self._llm[0] == key:
            return self._llm[1]
        self.release()
        target, drafter = self.checkpoints()
        max_len = max(max(p.verify_ctxs) + max(p.tree_sizes), p.gen_prompt + p.gen_tokens,
                      p.ctx + 20 * p.reps + 50) + 64
        kw = {} if spec == "none" else dict(draft=str(drafter), spec=spec,
                                            tree_budget=tree_budget)
        llm = LLM(model=str(target), device=self.args.device, dtype=self.args.dtype,
                  skip_tokenizer_init=True, max_model_len=max_len,
                  max_num_seqs=max(p.batches) if spec == "none" else 4,
                  enforce_eager=self.args.enforce_eager, **kw)
        self._llm = key, llm
        return llm

    def release(self) -> None:
        """Drop the held LLM (callers must not keep references, or its memory stays)."""
        if self._llm is not None:
            llm = self._llm[1]
            self._llm = None
            llm.shutdown()
            del llm
            empty_cache(self.device)

    @property
    def vocab(self) -> int:
        return self.p.shape["vocab_size"]

    def get(self, section: str, key: str) -> float:
        return self.res.get(section, {}).get(key, float("nan"))

    # --- sections (each returns markdown lines and fills self.res[section]) -------------
    def bandwidth(self) -> list[str]:
        bw = copy_bandwidth(self.device, self.p.copy_mib, self.p.reps)
        self.res["bandwidth"] = {"bytes_per_s": bw, "copy_mib": self.p.copy_mib}
        return [f"Device-to-device copy of a {self.p.copy_mib} MiB bf16 tensor, bytes read + "
                f"written over time (median of {max(self.p.reps, 10)}): **{bw / 1e9:.1f} GB/s**."]

    def ar_step(self) -> list[str]:
        llm, p = self.llm("none"), self.p
        total_w, read_w = weight_bytes(llm)
        kv_tok = llm.engine.cache.bytes_per_token
        if "bandwidth" not in self.res:  # the section was not picked: measure it anyway
            self.bandwidth()
        bw = self.get("bandwidth", "bytes_per_s")
        r: dict = {"weight_bytes_total": total_w, "weight_bytes_read": read_w,
                   "kv_bytes_per_token": kv_tok, "ctx": p.ctx, "steps": {}}
        lines = [f"Target weights {total_w / 1e9:.2f} GB; a decode step reads "
                 f"{read_w / 1e9:.2f} GB of them (all matrices and lm_head; of the untied "
                 f"embedding table only the looked-up rows, not counted). KV: "
                 f"{kv_tok / 1e3:.1f} kB per token. Floor = (weights read + batch x ctx x KV "
                 "per token) / copy bandwidth. Time: `runner.forward(DECODE)`.", "",
                 "| batch | ctx | step ms | floor ms | step / floor |",
                 "|---:|---:|---:|---:|---:|"]
        for b in p.batches:
            ms = ar_step_ms(llm, b, p.ctx, p.reps)
            floor = (read_w + b * p.ctx * kv_tok) / bw * 1e3
            r["steps"][b] = {"ms": ms, "floor_ms": floor, "over_floor": ms / floor}
            lines.append(f"| {b} | {p.ctx} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f} |")
            print(f"AR step batch {b}: {ms:.3f} ms (floor {floor:.3f})", flush=True)
        r["ar_b1_ms_by_ctx"] = {p.ctx: r["steps"][1]["ms"]}
        for c in p.verify_ctxs:
            if c != p.ctx:
                ms = ar_step_ms(llm, 1, c, p.reps)
                floor = (read_w + c * kv_tok) / bw * 1e3
                r["ar_b1_ms_by_ctx"][c] = ms
                lines.append(f"| 1 | {c} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f} |")
        r["ar_step_ms_b1"] = r["steps"][1]["ms"]
        r["ar_step_over_floor"] = r["steps"][1]["over_floor"]
        eng_ms, _ = step_times(llm, 1, p.ctx, p.reps, self.vocab)
        r["engine_step_ms_b1"] = eng_ms
        lines += ["", f"Whole `engine.step()` (scheduler, sampling, bookkeeping) at batch 1: "
                  f"{eng_ms:.3f} ms, {eng_ms / r['ar_step_ms_b1']:.2f}x the forward."]
        with Scratch(llm) as s:
            lines += self.profile_lines("AR step, batch 1", ar_forward(llm, s, 1, p.ctx),
                                        r["ar_step_ms_b1"])
        self.res["ar_step"] = r
        return lines

    def generate(self) -> list[str]:
        """flashtree AR vs transformers generate, same checkpoint, batch 1, greedy."""
        p = self.p
        prompt = torch.randint(0, self.vocab - 1, (p.gen_prompt,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        r: dict = {"prompt_tokens": p.gen_prompt, "new_tokens": p.gen_tokens}
        r["flashtree"] = ft_e2e(self.llm("none"), prompt, p.gen_tokens)
        self.release()
        target, _ = self.checkpoints()
        try:
            r["transformers"] = hf_e2e(target, prompt, p.gen_tokens, self.dtype, self.device)
        finally:
            empty_cache(self.device)
        f, h = r["flashtree"], r["transformers"]
        r["flashtree_over_transformers"] = f["tokens_per_s"] / h["tokens_per_s"]
        self.res["generate"] = r
        return [f"Batch 1, {p.gen_prompt}-token random prompt, {p.gen_tokens} new tokens, "
                "greedy. tokens/s includes the prefill; decode ms/token = (time of "
                f"{p.gen_tokens} tokens - time of 1 token) / {p.gen_tokens - 1}.", "",
                "| engine | tokens/s | total s | decode ms/token |", "|---|---:|---:|---:|",
                f"| flashtree (spec none) | {f['tokens_per_s']:.1f} | {f['seconds']:.3f} | "
                f"{f['decode_ms_per_token']:.3f} |",
                f"| transformers generate | {h['tokens_per_s']:.1f} | {h['seconds']:.3f} | "
                f"{h['decode_ms_per_token']:.3f} |", "",
                f"flashtree / transformers: **{r['flashtree_over_transformers']:.2f}x**."]

    def verify(self) -> list[str]:
        ar = self.ar_reference()
        p = self.p
        r: dict = {"ms": {}, "over_ar_step": {}}
        head = " | ".join(f"ctx {c} ms | / AR step" for c in p.verify_ctxs)
        lines = ["`runner.forward(VERIFY)` of one random tree (depth <= 15, ancestor-or-self "
                 "mask, all logits), batch 1, target capturing the drafter's layers; ratio to "
                 "the AR step at batch 1 with the same context.", "",
                 f"| nodes | {head} |", "|---:|" + "---:|---:|" * len(p.verify_ctxs)]
        for n in p.tree_sizes:
            llm, cells = self.llm("ddtree", n - 1), []
            for c in p.verify_ctxs:
                ms = verify_ms(llm, n, c, p.reps, self.vocab)
                base = ar[c]
                r["ms"].setdefault(c, {})[n] = ms
                r["over_ar_step"].setdefault(c, {})[n] = ms / base
                cells.append(f"{ms:.3f} | {ms / base:.2f}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
            print(f"verify {n} nodes: {cells}", flush=True)
        r["ar_step_ms"] = ar
        n64 = 64 if 64 in p.tree_sizes else p.tree_sizes[-1]
        r["verify64_over_ar_step"] = r["over_ar_step"][p.ctx][n64]
        llm = self.llm("ddtree", n64 - 1)
        with Scratch(llm) as s:
            lines += self.profile_lines(f"verify, {n64} nodes, ctx {p.ctx}",
                                        verify_forward(llm, s, n64, p.ctx, self.vocab),
                                        r["ms"][p.ctx][n64])
        self.res["verify"] = r
        return lines

    def ar_reference(self) -> dict[int, float]:
        """AR step ms at batch 1 for each verify context on the plain-AR engine (no layer
        capture): the ar_step section's numbers, else measured now (loads that engine: call
        this before taking the DDTree one)."""
        known = self.res.get("ar_step", {}).get("ar_b1_ms_by_ctx", {})
        return {c: known[c] if c in known else ar_step_ms(self.llm("none"), 1, c, self.p.reps)
                for c in self.p.verify_ctxs}

    def draft(self) -> list[str]:
        p = self.p
        ar = self.ar_reference()[p.ctx]
        llm = self.llm("ddtree")
        prop, device = llm.engine.proposer, llm.engine.runner.device
        with Scratch(llm) as s:
            blocks, feats, sid = draft_setup(llm, s, p.ctx)
            draft = median_ms(lambda: prop.draft_logits(blocks), device, p.reps)
            rows = [ContextRows(feats[-prop.block_size:],
                                ((sid, p.ctx - prop.block_size, prop.block_size),))]
            inject = median_ms(lambda: prop.inject(rows), device, p.reps)
            spec_decode = ar_step_ms(llm, 1, p.ctx, p.reps)  # DECODE with layer capture
            prof = self.profile_lines("draft step", lambda: prop.draft_logits(blocks), draft)
        eng_ms, per_step = step_times(llm, 1, p.ctx, p.reps, self.vocab)
        r = {"draft_ms": draft, "inject_block_ms": inject, "ar_step_ms": ar,
             "draft_over_ar_step": draft / ar, "decode_with_capture_ms": spec_decode,
             "ddtree_engine_step_ms": eng_ms, "ddtree_tokens_per_step": per_step,
             "block_size": prop.block_size}
        self.res["draft"] = r
        return [f"`proposer.draft_logits` of one block of {prop.block_size} at context {p.ctx} "
                f"(batch 1): **{draft:.3f} ms = {draft / ar:.3f}x** the AR step ({ar:.3f} ms). "
                f"Injecting {prop.block_size} context rows: {inject:.3f} ms. DECODE on the "
                f"DDTree engine's runner (capturing the drafter's layers): {spec_decode:.3f} ms. "
                f"A whole DDTree `engine.step()` at batch 1 (random drafter, adaptive policy): "
                f"{eng_ms:.3f} ms, {per_step:.2f} tokens/step.", *prof]

    def default_pair(self) -> list[str]:
        from flashtree.models.registry import resolve_model_path

        self.release()
        target = resolve_model_path(self.args.default_model)
        prompts, source = pair_prompts(target, self.args.pair_prompts)
        tokens = self.args.pair_tokens or self.p.pair_tokens
        r: dict = {"target": str(target), "drafter": self.args.default_draft,
                   "prompts": source, "num_prompts": len(prompts), "new_tokens": tokens}
        for spec in ("none", "dflash", "ddtree"):
            try:
                r[spec] = self.pair_run(target, spec, prompts, tokens)
            finally:
                empty_cache(self.device)
            print(f"default pair {spec}: {r[spec]['tokens_per_s']:.1f} tok/s", flush=True)
        try:
            r.update(reference_dflash(target, Path(self.args.default_draft), prompts, tokens,
                                      self.dtype, self.device))
        finally:
            empty_cache(self.device)
        ref = r["reference_chain"]["tokens_per_s"]
        r["speedup_vs_reference_dflash"] = r["dflash"]["tokens_per_s"] / ref
        r["ddtree_speedup_vs_reference_dflash"] = r["ddtree"]["tokens_per_s"] / ref
        r["ddtree_over_dflash_e2e"] = r["ddtree"]["tokens_per_s"] / r["dflash"]["tokens_per_s"]
        r["dflash_equal_to_reference"] = sum(
            a == b for a, b in zip(r["dflash"]["outputs"], r["reference_chain"]["outputs"]))
        self.res["default_pair"] = r
        rows = [("flashtree AR (spec none)", r["none"]), ("flashtree DFlash", r["dflash"]),
                ("flashtree DDTree", r["ddtree"]),
                ("reference dflash_generate, block 1 (its AR)", r["reference_ar"]),
                ("reference dflash_generate, chain", r["reference_chain"])]
        lines = [f"Target `{target.name}`, drafter `{self.args.default_draft}`; {len(prompts)} "
                 f"prompts ({source}), {tokens} new tokens each (EOS ignored on both sides), "
                 f"greedy, one request at a time, {self.args.dtype}; DFlash and DDTree with "
                 "`spec_policy=\"fixed\"` (the full block, the full tree every step).", "",
                 "| engine | tokens/s | mean acceptance | vs reference chain |",
                 "|---|---:|---:|---:|"]
        lines += [f"| {name} | {x['tokens_per_s']:.1f} | {x['mean_accept']:.2f} | "
                  f"{x['tokens_per_s'] / ref:.2f}x |" for name, x in rows]
        lines += ["", f"DFlash over reference chain (like for like): "
                  f"**{r['speedup_vs_reference_dflash']:.2f}x**; DDTree over reference chain: "
                  f"{r['ddtree_speedup_vs_reference_dflash']:.2f}x; DDTree over DFlash: "
                  f"**{r['ddtree_over_dflash_e2e']:.2f}x**. flashtree DFlash tokens equal to the "
                  f"reference's: {r['dflash_equal_to_reference']}/{len(prompts)} requests "
                  "(bf16 near-ties may split them)."]
        for x in r.values():
            if isinstance(x, dict):
                x.pop("outputs", None)
        return lines

    def pair_run(self, target: Path, spec: str, prompts: list[list[int]], tokens: int) -> dict:
        # The methods compared as configured (the full block, the full tree every step): the
        # adaptive policy, which may decode plain, is measured by `flashtree bench`.
        kw = {} if spec == "none" else dict(draft=self.args.default_draft, spec=spec,
                                            spec_policy="fixed")
        llm = LLM(model=str(target), device=self.args.device, dtype=self.args.dtype,
                  skip_tokenizer_init=True, max_num_seqs=4,
                  max_model_len=max(map(len, prompts)) + tokens + 64,
                  enforce_eager=self.args.enforce_eager, **kw)
        try:
            return e2e_flashtree(llm, prompts, tokens)
        finally:
            llm.shutdown()

    def profile_lines(self, what: str, fn: Callable[[], object], wall_ms: float) -> list[str]:
        """Top ops of one profiled call against its measured wall time (where the time goes:
        on CUDA, wall minus kernel time is host work and launch gaps)."""
        try:
            total, top = top_ops(fn, self.device)
        except Exception as e:  # noqa: BLE001 - a missing profile is not a failed section
            return ["", f"(profile of {what} failed: {type(e).__name__}: {e})"]
        self.res.setdefault("profiles", {})[what] = {"total_ms": total, "wall_ms": wall_ms,
                                                     "top": top}
        if self.device.type == "cuda":
            head = (f"{total:.3f} ms of GPU kernels against {wall_ms:.3f} ms wall (median "
                    f"above): the GPU is busy {total / wall_ms:.0%} of the step")
        else:
            head = f"{total:.3f} ms of CPU op self time (all threads)"
        return ["", f"Profile of one {what}: {head}.", "",
                "| op / kernel | ms | calls |", "|---|---:|---:|",
                *[f"| `{name}` | {ms:.3f} | {n} |" for name, ms, n in top]]

    # --- driver ----------------------------------------------------------------------------
    def run(self, sections: list[str], report: Callable[[], object]) -> None:
        """Run `sections` in order, calling `report()` after each (a run killed from outside
        still leaves the report of the sections done)."""
        titles = {"bandwidth": "Copy bandwidth", "ar_step": "AR decode step vs floor",
                  "generate": "End to end on the 8B-shaped target: flashtree AR vs transformers",
                  "verify": "Tree verify step", "draft": "Draft step",
                  "default_pair": "Default pair end to end (SmolLM2 + DFlash drafter)"}
        for name in sections:
            self.md += [f"## {titles[name]}", ""]
            elapsed = time.time() - self.start
            if elapsed > self.args.time_limit:
                self.md += [f"Skipped: {elapsed:.0f} s elapsed, over --time-limit "
                            f"{self.args.time_limit:.0f} s.", ""]
                self.errors[name] = "skipped (time limit)"
                self.done.append(name)
                continue
            t = time.time()
            print(f"== {name}", flush=True)
            try:
                self.md += [*getattr(self, name)(), ""]
            except Exception:  # noqa: BLE001 - recorded; the other sections still run
                self.errors[name] = traceback.format_exc()
                self.md += ["Failed:", "", "```", self.errors[name].rstrip(), "```", ""]
                print(self.errors[name], flush=True)
            self.md += [f"({time.time() - t:.0f} s)", ""]
            self.done.append(name)
            report()
        self.release()

    def headline(self) -> dict[str, float | None]:
        return {
            "ar_step_over_floor": self.get("ar_step", "ar_step_over_floor"),
            "verify64_over_ar_step": self.get("verify", "verify64_over_ar_step"),
            "draft_over_ar_step": self.get("draft", "draft_over_ar_step"),
            "speedup_vs_reference_dflash": self.get("default_pair", "speedup_vs_reference_dflash"),
            "ddtree_over_dflash_e2e": self.get("default_pair", "ddtree_over_dflash_e2e"),
        }


def pair_prompts(target: Path, n: int) -> tuple[list[list[int]], str]:
    """`n` held-out prompts (flashtree.bench.prompt_sets, round robin over chat/code/math)
    through the target's chat template; random token ids when it has no tokenizer."""
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
        stats, seconds = [], 0.0
        for p in prompts:
            sync(device)
            t = time.perf_counter()
            stats.append(one(p))
            sync(device)
            seconds += time.perf_counter() - t
        accepts = [a for s in stats for a in s.acceptance_lengths]
        out[name] = {
            "tokens_per_s": sum(s.num_output_tokens for s in stats) / seconds,
            "seconds": seconds, "mean_accept": sum(accepts) / len(accepts),
            "outputs": [s.output_ids[0, s.num_input_tokens:].tolist() for s in stats]}
        print(f"reference {name}: {out[name]['tokens_per_s']:.1f} tok/s", flush=True)
    return out


# --------------------------------------------------------------------------- report
def goal_lines(head: dict[str, float | None]) -> list[str]:
    lines = ["| goal | value | target | met |", "|---|---:|---:|---|"]
    for key, op, thr, words in GOALS:
        v = head[key]
        ok = v is not None and math.isfinite(v) and {
            "<=": v <= thr, ">=": v >= thr, ">": v > thr}[op]
        shown = f"{v:.3f}" if v is not None and math.isfinite(v) else "n/a"
        lines.append(f"| {words} (`{key}`) | {shown} | {op} {thr} | "
                     f"{'met' if ok else 'NOT met'} |")
    return lines


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def write_report(bench: Bench, out: Path, sections: list[str]) -> dict:
    head = bench.headline()
    info = machine()
    args = bench.args
    md = [f"# GPU benchmark ({args.shape}-shaped target, {args.dtype}, {args.device}"
          f"{', eager' if args.enforce_eager else ''})", "",
          "Command: `python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:]) + "`", "",
          f"Machine: {info.get('gpu', 'no GPU')} (CUDA {info.get('cuda')}), CPU "
          f"{info['cpu']}, torch {info['torch']}, triton {info['triton']}, Python "
          f"{info['python']}. Date {datetime.date.today()}; "
          f"{time.time() - bench.start:.0f} s in all.", "",
          "## Goals", "", *goal_lines(head), "",
          "`speedup_vs_reference_dflash` is flashtree's DFlash chain over the reference "
          "package's chain (like for like); DDTree over the reference chain is "
          "`ddtree_speedup_vs_reference_dflash` in the JSON.", "", *bench.md]
    if bench.errors:
        md += ["## Sections that failed or were skipped", "",
               *[f"- {k}: {v.strip().splitlines()[-1]}" for k, v in bench.errors.items()], ""]
    pending = [s for s in sections if s not in bench.done]
    if pending:
        md += [f"Not run yet (report written mid-run): {', '.join(pending)}.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md))
    data = {**head, "goals": {k: {"op": op, "threshold": thr} for k, op, thr, _ in GOALS},
            "command": sys.argv, "machine": info, "shape": args.shape, "dtype": args.dtype,
            "device": args.device, "enforce_eager": args.enforce_eager, "sections": sections,
            "done": bench.done, "results": bench.res, "errors": bench.errors}
    out.with_suffix(".json").write_text(json.dumps(finite(data), indent=1, default=str))
    return head


def finite(x):
    """`x` with NaN / infinite floats as None (strict JSON), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="markdown report (default benchmarks/results/<date>-gpu.md); the "
                         "JSON goes beside it")
    ap.add_argument("--work", default="/tmp/gpu_bench", help="where random checkpoints go")
    ap.add_argument("--shape", default="qwen3-8b", choices=list(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--enforce-eager", action="store_true", help="LLM(enforce_eager=True)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--time-limit", type=float, default=480.0,
                    help="soft budget in seconds: sections that would start later are skipped "
                         "(the report is rewritten after every section)")
    ap.add_argument("--default-model", default="default", help="target of the default pair")
    ap.add_argument("--default-draft", default=str(DEFAULT_DRAFTER_DIR),
                    help="z-lab-format DFlash drafter dir (default: the shipped one)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed runs per step measurement (default 20; 5 for tiny)")
    ap.add_argument("--pair-prompts", type=int, default=8)
    ap.add_argument("--pair-tokens", type=int, default=None,
                    help="new tokens per default-pair request (default 128; 32 for tiny)")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-gpu.md")
    sections = [s for s in SECTIONS if s in args.sections]
    torch.manual_seed(0)
    bench = Bench(args)
    bench.run(sections, lambda: write_report(bench, out, sections))
    head = write_report(bench, out, sections)
    print("\n".join(["", *goal_lines(head), "", f"report: {out}",
                      f"json:   {out.with_suffix('.json')}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
