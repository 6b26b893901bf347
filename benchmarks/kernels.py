"""Kernels on one GPU, one call each, random data on the device:

  attention  a paged GQA attention layer call (Qwen3-8B's 32 query and 8 KV heads, head_dim
             128) for decode, a 16-token chain and a 64-node tree over batches and contexts:
             SDPA (the reference), Triton launched eagerly and replayed from a CUDA graph, the
             context K/V bytes read per second, Triton's largest difference from SDPA
  mla        MLA's latent attention (DeepSeek-V3: 128 heads, latent 512 + rope 64) through the
             Triton kernel, graph-replayed: decode at each context and batch (latent TB/s,
             TFLOP/s) and a 64-node tree verify at batch 1; where FlashInfer is installed, the
             engine's FlashInfer decode path on the same pages, checked against Triton
  gemv       the batch-1 GEMV kernel (`flashtree/layers/gemv.py`) against cuBLAS on the
             Qwen3-8B decode shapes for its candidate launch configurations, over weight copies
             larger than L2 (microseconds, weight TB/s), and MLA's q_a RMSNorm folded into
             the q_b GEMV against the two launches it replaces
  router     a float32 router (Kimi K2.6's, 384 x 7168) against 1 to 64 rows: cuBLAS's float32
             GEMM against the GEMV kernels (`gemv_rows`, which the engine takes up to ROWS_MAX)
  tree       the DDTree build, the torch build and (CUDA) the one-launch kernel, graph-replayed

    python -m benchmarks.kernels --out benchmarks/results/DATE-kernels.md

Off CUDA only SDPA and the torch build run (a check of the script). JSON keys:
`mla_decode_tbps_16k_b32`, `flashinfer_mla_decode_tbps_16k_b32`, `mla_verify64_over_decode`."""

from __future__ import annotations

import argparse
import datetime
import random
from pathlib import Path

import torch

from flashtree.attention.backend import AttentionMetadata
from flashtree.attention.sdpa import SdpaBackend
from flashtree.bench.floors import copy_bandwidth
from flashtree.bench.gemv_timing import (
    GEMV_SHAPES,
    gemv_configs,
    gemv_report,
    norm_fold,
    router_rows,
)
from flashtree.bench.results import int_list, write_results
from flashtree.bench.shapes import SHAPES
from flashtree.bench.timing import graph_ms, median_ms
from flashtree.bench.tree_build import tree_build_report, tree_build_times
from flashtree.kv.cache import KVCache, PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.speculative.tree import ancestor_mask

TREE_NODES = 64


def paged_batch(batch: int, ctx: int, tokens: int, page: int, tree: bool, rng: random.Random,
                device: torch.device) -> tuple[AttentionMetadata, int]:
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


def gqa_call(backend_cls, batch: int, ctx: int, tokens: int, heads: int, kv_heads: int,
             head_dim: int, tree: bool, device: torch.device, dtype: torch.dtype, page: int = 16):
    """One layer's paged attention through `backend_cls(cache)` over `batch` requests of `ctx`
    cached tokens plus `tokens` new ones (the same random data for every backend) -> (a
    callable, the context K/V bytes it reads)."""
    meta, num_pages = paged_batch(batch, ctx, tokens, page, tree,
                                  random.Random(batch * ctx + tokens), device)
    cache = KVCache(1, num_pages, page, kv_heads, head_dim, dtype, device)
    gen = torch.Generator(device).manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=device))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen, device=device))
    q, k, v = (torch.randn(batch * tokens, n, head_dim, generator=gen, device=device).to(dtype)
               for n in (heads, kv_heads, kv_heads))
    backend = backend_cls(cache)
    backend.begin_forward(meta)
    return (lambda: backend.forward(0, q, k, v),
            2 * batch * ctx * kv_heads * head_dim * q.element_size())


def latent_call(backend_cls, batch: int, ctx: int, tokens: int, shape: tuple[int, int, int],
                tree: bool, device: torch.device, dtype: torch.dtype, page: int = 16):
    """One layer's forward_latent through `backend_cls(cache)` over `batch` requests of `ctx`
    cached tokens plus `tokens` new ones (a random tree when `tree`; the same random data for
    every backend) -> (a callable, the latent bytes it reads, FLOPs)."""
    heads, latent, rope = shape
    total = ctx + tokens
    meta, num_pages = paged_batch(batch, ctx, tokens, page, tree,
                                  random.Random(batch * ctx + tokens), device)
    cache = KVCache(1, num_pages, page, 1, latent + rope, dtype, device, v_head_dim=0)
    gen = torch.Generator(device).manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=device))
    q = torch.randn(batch * tokens, heads, latent + rope, generator=gen, device=device).to(dtype)
    new = torch.randn(batch * tokens, 1, latent + rope, generator=gen, device=device).to(dtype)
    backend = backend_cls(cache)
    backend.begin_forward(meta)
    scale = (latent + rope) ** -0.5
    # Each query row and head scores its keys over latent + rope and sums latent-wide values.
    flops = 2 * batch * tokens * heads * total * (2 * latent + rope)
    return (lambda: backend.forward_latent(0, q, new, latent, scale),
            batch * total * (latent + rope) * cache.k.element_size(), flops)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def attention(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    cuda = device.type == "cuda"
    rows = []
    for mode, tokens in (("decode", 1), ("chain", 16), ("tree", TREE_NODES)):
        for batch in args.batches:
            for ctx in args.contexts:
                case = (batch, ctx, tokens, args.heads, args.kv_heads, args.head_dim,
                        mode == "tree", device, dtype)
                sdpa, read = gqa_call(SdpaBackend, *case)
                row = {"mode": mode, "batch": batch, "ctx": ctx, "tokens": tokens,
                       "sdpa_ms": median_ms(sdpa, device, args.reps, 5)}
                if cuda:
                    from flashtree.attention.triton import TritonBackend

                    triton, _ = gqa_call(TritonBackend, *case)
                    row.update(max_err=_max_diff(triton(), sdpa()),
                               triton_ms=median_ms(triton, device, args.reps, 5),
                               triton_graph_ms=graph_ms(triton, args.reps))
                    row["kv_gbps"] = read / row["triton_graph_ms"] / 1e6
                    torch.cuda.empty_cache()
                rows.append(row)
                print(row, flush=True)
    return rows


def _flashinfer(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype):
    """The engine's FlashInfer decode path as a backend class (the Triton backend with
    `latent_decode`), or None where it does not apply here (saying why)."""
    from flashtree.attention.flashinfer_mla import latent_decode_for
    from flashtree.attention.triton import TritonBackend

    probe = KVCache(1, 1, 16, 1, shape[1] + shape[2], dtype, device, v_head_dim=0)
    if latent_decode_for(probe) is None:
        print("FlashInfer's MLA decode does not apply here (not installed, switched off, or "
              "not latent 512 + rope 64 in bf16/fp16): Triton only", flush=True)
        return None
    return lambda cache: TritonBackend(cache, latent_decode=latent_decode_for(cache))


def mla(args, device: torch.device, dtype: torch.dtype) -> dict:
    s = SHAPES[args.mla_shape]
    shape = (args.mla_heads or s["num_attention_heads"], s["kv_lora_rank"], s["qk_rope_head_dim"])
    cuda = device.type == "cuda"
    if cuda:
        from flashtree.attention.triton import TritonBackend

        kernel, timer = TritonBackend, (lambda fn: graph_ms(fn, args.reps))
        ref = [latent_call(cls, 2, min(args.mla_contexts), 16, shape, True, device, dtype)[0]()
               for cls in (SdpaBackend, TritonBackend)]
        out: dict = {"max_err_vs_sdpa": _max_diff(*ref),
                     "copy_bytes_per_s": copy_bandwidth(device, 1024, 10)}
        flashinfer = _flashinfer(shape, device, dtype)
    else:  # the reference backend, timed eagerly: a check of the script
        kernel, out, flashinfer = SdpaBackend, {}, None
        timer = lambda fn: median_ms(fn, device, args.reps)  # noqa: E731
    out.update(shape=shape, backend=kernel.__name__, rows=[])
    for ctx in args.mla_contexts:
        for batch, tokens in [(b, 1) for b in args.mla_batches] + [(1, TREE_NODES)]:
            case = (batch, ctx, tokens, shape, tokens > 1, device, dtype)
            fn, read, flops = latent_call(kernel, *case)
            ms = timer(fn)
            row = {"step": "decode" if tokens == 1 else f"verify {TREE_NODES}", "ctx": ctx,
                   "batch": batch, "ms": ms, "tbps": read / ms / 1e9, "tflops": flops / ms / 1e9}
            if flashinfer and tokens == 1:
                fi = latent_call(flashinfer, *case)[0]
                fi_ms = graph_ms(fi, args.reps)
                row.update(flashinfer_ms=fi_ms, flashinfer_tbps=read / fi_ms / 1e9,
                           flashinfer_max_diff=_max_diff(fi(), fn()))
            out["rows"].append(row)
            print(row, flush=True)
    if flashinfer:
        import flashinfer as package

        out["flashinfer"] = package.__version__
    return out


def summary(res: dict) -> dict:
    keys, rows = {}, {(r["step"], r["ctx"], r["batch"]): r for r in res.get("mla", {})
                      .get("rows", [])}
    if ("decode", 16384, 32) in rows:
        keys["mla_decode_tbps_16k_b32"] = rows["decode", 16384, 32]["tbps"]
        keys["mla_decode_bw_fraction_16k_b32"] = (rows["decode", 16384, 32]["tbps"] * 1e12
                                                  / res["mla"].get("copy_bytes_per_s", 1e30))
        if "flashinfer_tbps" in rows["decode", 16384, 32]:
            keys["flashinfer_mla_decode_tbps_16k_b32"] = rows["decode", 16384, 32][
                "flashinfer_tbps"]
    if rows:
        ctx = 16384 if ("decode", 16384, 1) in rows else min(c for _, c, _ in rows)
        if ("decode", ctx, 1) in rows:
            keys["mla_verify64_over_decode"] = (rows[f"verify {TREE_NODES}", ctx, 1]["ms"]
                                                / rows["decode", ctx, 1]["ms"])
    return keys


def report(res: dict, args) -> list[str]:
    lines = []
    if "attention" in res:
        lines += [f"## Paged GQA attention per layer call ({args.heads} query heads, "
                  f"{args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype}, page 16)",
                  "", "| mode | batch | context | tokens | sdpa ms | triton ms | triton graph ms "
                  "| kv GB/s | max err |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res["attention"]:
            triton = (f"{r['triton_ms']:.3f} | {r['triton_graph_ms']:.3f} | {r['kv_gbps']:.0f} "
                      f"| {r['max_err']:.1e}" if "triton_ms" in r else "- | - | - | -")
            lines.append(f"| {r['mode']} | {r['batch']} | {r['ctx']} | {r['tokens']} | "
                         f"{r['sdpa_ms']:.3f} | {triton} |")
        lines.append("")
    m = res.get("mla")
    if m:
        heads, latent, rope = m["shape"]
        fi = "flashinfer" in m
        lines += [f"## MLA latent attention ({heads} heads, latent {latent} + rope {rope}, "
                  f"{m['backend']}" + (f"; max |Triton - SDPA| {m['max_err_vs_sdpa']:.2g}"
                                       if "max_err_vs_sdpa" in m else "")
                  + (f"; FlashInfer {m['flashinfer']}, the engine's decode path" if fi else "")
                  + ")", "", "| step | context | batch | ms | latent TB/s | TFLOP/s |"
                  + (" FlashInfer ms | FlashInfer TB/s | max diff |" if fi else ""),
                  "|---|---|---|---|---|---|" + ("---|---|---|" if fi else "")]
        for r in m["rows"]:
            line = (f"| {r['step']} | {r['ctx']} | {r['batch']} | {r['ms']:.3f} | "
                    f"{r['tbps']:.2f} | {r['tflops']:.1f} |")
            if fi:
                line += (f" {r['flashinfer_ms']:.3f} | {r['flashinfer_tbps']:.2f} | "
                         f"{r['flashinfer_max_diff']:.2g} |" if "flashinfer_ms" in r
                         else " - | - | - |")
            lines.append(line)
        lines.append("")
    lines += gemv_report(res)
    return lines + tree_build_report(res["tree"]) if "tree" in res else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="attention,mla,gemv,router,tree")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--contexts", type=int_list, default=[512, 4096, 16384])
    ap.add_argument("--mla-shape", default="deepseek-v3", choices=["deepseek-v3", "tiny-mla"])
    ap.add_argument("--mla-heads", type=int, help="a rank's share (8: Kimi K2.6 at TP8)")
    ap.add_argument("--gemv-shapes", default="qwen3-8b", choices=sorted(GEMV_SHAPES))
    ap.add_argument("--mla-contexts", type=int_list, default=[4096, 16384, 65536])
    ap.add_argument("--mla-batches", type=int_list, default=[1, 32])
    ap.add_argument("--budgets", type=int_list, default=[63, 255, 511], help="tree's")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results") / f"{datetime.date.today()}-kernels.md")
    args = ap.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    res: dict = {"device": args.device, "dtype": args.dtype}
    sections = args.sections.split(",")
    if "attention" in sections:
        res["attention"] = attention(args, device, dtype)
    if "mla" in sections:
        res["mla"] = mla(args, device, dtype)
    if "gemv" in sections and device.type == "cuda":
        res["gemv"] = gemv_configs(args.gemv_shapes, args.reps)
        res["norm_fold"] = norm_fold(args.reps)
    if "router" in sections and device.type == "cuda":
        res["router"] = router_rows(args.reps)
    if "tree" in sections:
        res["tree"] = tree_build_times(device, args.batches, args.budgets, args.reps)
    keys = summary(res)
    write_results(args.out, f"Kernels on {args.device}", report(res, args), {**res, **keys},
                  ("mla_decode_tbps_16k_b32", "mla_verify64_over_decode"))


if __name__ == "__main__":
    main()
