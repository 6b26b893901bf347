"""Paged attention on one GPU: the Triton backend (eager launch, and replayed from a CUDA graph)
against the SDPA reference backend, per layer call, for decode (1 token), chain verify (a
causal block) and tree verify (random DDTree-shaped ancestor masks) at several batch sizes and
context lengths. Also checks the Triton output against SDPA in the same run.

Shapes default to a Qwen3-8B layer (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token
pages). Time: CUDA events, `--warmup` untimed calls, median of `--iters`. `kv GB/s` is the
context K/V bytes one call reads over its graph-replay time (the H200 copies about 4.2 TB/s).

    python -m benchmarks.gpu_attention --out benchmarks/results/gpu_attention.md

This is a benchmark, not a test: it prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys

import torch

from benchmarks.gpu_bench import paged_verify_batch
from flashtree.attention.sdpa import SdpaBackend
from flashtree.attention.triton import TritonBackend
from flashtree.kv.cache import KVCache


def build(mode: str, batch: int, context: int, tokens: int, args, rng: random.Random):
    page = args.page_size
    meta, num_pages = paged_verify_batch(batch, context, tokens, page, mode == "tree", rng,
                                         torch.device("cuda"))
    dtype = getattr(torch, args.dtype)
    cache = KVCache(1, num_pages, page, args.kv_heads, args.head_dim, dtype, torch.device("cuda"))
    cache.k.normal_()
    cache.v.normal_()
    n = batch * tokens
    q = torch.randn(n, args.heads, args.head_dim, device="cuda", dtype=dtype)
    k = torch.randn(n, args.kv_heads, args.head_dim, device="cuda", dtype=dtype)
    v = torch.randn(n, args.kv_heads, args.head_dim, device="cuda", dtype=dtype)
    return meta, cache, q, k, v


def median_ms(fn, args) -> float:
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(mode: str, batch: int, context: int, tokens: int, args, rng: random.Random) -> str:
    meta, cache, q, k, v = build(mode, batch, context, tokens, args, rng)
    sdpa, triton = SdpaBackend(cache), TritonBackend(cache)
    sdpa.begin_forward(meta)
    triton.begin_forward(meta)
    err = (triton.forward(0, q, k, v).float() - sdpa.forward(0, q, k, v).float()).abs().max()
    t_sdpa = median_ms(lambda: sdpa.forward(0, q, k, v), args)
    t_triton = median_ms(lambda: triton.forward(0, q, k, v), args)
    t_graph = median_ms(graphed(lambda: triton.forward(0, q, k, v)), args)
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * q.element_size()
    return (f"| {mode} | {batch} | {context} | {tokens} | {t_sdpa:.3f} | {t_triton:.3f} | "
            f"{t_graph:.3f} | {kv_bytes / t_graph / 1e6:.0f} | {err.item():.1e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--chain-tokens", type=int, default=16)
    p.add_argument("--tree-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    rng = random.Random(0)
    rows = ["| mode | batch | context | tokens | sdpa ms | triton ms | triton graph ms | "
            "kv GB/s | max err |", "|---|---|---|---|---|---|---|---|---|"]
    modes = {"decode": 1, "chain": args.chain_tokens, "tree": args.tree_tokens}
    for mode, tokens in modes.items():
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                rows.append(measure(mode, batch, context, tokens, args, rng))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    header = (f"# Paged attention per layer call, {torch.cuda.get_device_name()}\n\n"
              f"`{shlex.join(['python', '-m', 'benchmarks.gpu_attention', *sys.argv[1:]])}`\n\n"
              f"{args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
              f"{args.dtype}, page {args.page_size}; torch {torch.__version__}\n\n")
    table = header + "\n".join(rows) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)


if __name__ == "__main__":
    main()
