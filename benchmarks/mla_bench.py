"""MLA on one GPU: DeepSeek-V3's latent attention through the Triton kernel, and a few-layer
DeepSeek-V3-shaped model with CUDA graphs on and off. Random weights and caches on the device.

1. Attention, one layer call replayed from a CUDA graph: decode at each context and batch, with
   the latent bytes it reads over its time (TB/s); a 64-node tree verify at batch 1 against
   decode at the same context. The kernel is checked against SDPA on the smallest case first.
   Where FlashInfer is installed, each decode case also times the engine's FlashInfer decode
   path (`attention/flashinfer_mla.py`; FLASHTREE_FLASHINFER=0 skips it) on the same pages and
   queries, and checks its output against Triton's. The model section runs the engine, which
   decodes through FlashInfer where it is installed.
2. The model (`--layers`, the first dense as in DeepSeek-V3): a decode step at batch 1 and 32
   after `--model-ctx` tokens, graph-replayed against `enforce_eager=True`.

Writes markdown and JSON (`mla_decode_tbps_16k_b32`, `mla_verify64_over_decode`,
`mla_graph_speedup_b1`, with FlashInfer `flashinfer_mla_decode_tbps_16k_b32`):

    python benchmarks/mla_bench.py --out benchmarks/results/DATE-mla-gpu.md
    python benchmarks/mla_bench.py --shape tiny --device cpu --model-ctx 32 --out mla.md

On a CPU only the model section runs (a check of the script; tests/bench/ runs it, and the
attention section's calls through Triton's interpreter).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_bench import Scratch, median_ms, paged_verify_batch  # noqa: E402
from benchmarks.moe_bench import decode_forward, graph_ms  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402
from flashtree import LLM  # noqa: E402
from flashtree.attention.sdpa import SdpaBackend  # noqa: E402
from flashtree.bench.random_pair import random_target  # noqa: E402
from flashtree.kv.cache import KVCache  # noqa: E402

# (query heads, latent, rope) of the attention section; model configs of the model section.
ATTENTION = {"deepseek-v3": (128, 512, 64), "tiny": (4, 16, 8)}
MODELS = {
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
        num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        n_shared_experts=1, n_group=8, topk_group=4, topk_method="noaux_tc",
        scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, rope_theta=10000.0, max_position_embeddings=163840),
    "tiny": dict(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=512, q_lora_rank=24,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=4, topk_group=2, topk_method="noaux_tc",
        scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, rope_theta=10000.0, max_position_embeddings=4096),
}
TREE_NODES = 64


def latent_call(make_backend, batch: int, ctx: int, tokens: int, shape: tuple[int, int, int],
                device: torch.device, dtype: torch.dtype, page: int, tree: bool):
    """One layer's forward_latent through `make_backend(cache)` over `batch` requests of `ctx`
    cached tokens plus `tokens` new ones (a random tree when `tree`; the same random data for
    every backend) -> (a callable, the latent bytes it reads, FLOPs)."""
    heads, latent, rope = shape
    total = ctx + tokens
    meta, num_pages = paged_verify_batch(batch, ctx, tokens, page, tree,
                                         random.Random(batch * ctx + tokens), device)
    cache = KVCache(1, num_pages, page, 1, latent + rope, dtype, device, v_head_dim=0)
    gen = torch.Generator(device).manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=device))
    q = torch.randn(batch * tokens, heads, latent + rope, generator=gen, device=device).to(dtype)
    new = torch.randn(batch * tokens, 1, latent + rope, generator=gen, device=device).to(dtype)
    backend = make_backend(cache)
    backend.begin_forward(meta)
    scale = (latent + rope) ** -0.5
    # Each query row and head scores its keys over latent + rope and sums latent-wide values.
    flops = 2 * batch * tokens * heads * total * (2 * latent + rope)
    return (lambda: backend.forward_latent(0, q, new, latent, scale),
            batch * total * (latent + rope) * cache.k.element_size(), flops)


def flashinfer_backend(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype):
    """The engine's FlashInfer decode path as a backend factory (the Triton backend with
    `latent_decode`), or None where it does not apply here (saying why)."""
    from flashtree.attention.flashinfer_mla import latent_decode_for
    from flashtree.attention.triton import TritonBackend

    probe = KVCache(1, 1, 16, 1, shape[1] + shape[2], dtype, device, v_head_dim=0)
    if latent_decode_for(probe) is None:
        print("FlashInfer's MLA decode does not apply here (not installed, switched off, or "
              "not latent 512 + rope 64 in bf16/fp16): Triton only", flush=True)
        return None
    return lambda cache: TritonBackend(cache, latent_decode=latent_decode_for(cache))


def attention_section(args, device: torch.device, dtype: torch.dtype) -> dict:
    from flashtree.attention.triton import TritonBackend

    shape = ATTENTION[args.shape]
    check = [latent_call(cls, 2, min(args.contexts), 16, shape, device, dtype, 16, True)[0]()
             for cls in (SdpaBackend, TritonBackend)]
    err = (check[0].float() - check[1].float()).abs().max().item()
    flashinfer = flashinfer_backend(shape, device, dtype)
    rows = []

    def timed(step: str, ctx: int, batch: int, tokens: int, tree: bool) -> None:
        case = (batch, ctx, tokens, shape, device, dtype, 16, tree)
        fn, read, flops = latent_call(TritonBackend, *case)
        ms = graph_ms(fn, args.reps)
        rows.append({"step": step, "ctx": ctx, "batch": batch, "ms": ms,
                     "tbps": read / ms / 1e9, "tflops": flops / ms / 1e9})
        if flashinfer and step == "decode":
            fi_fn = latent_call(flashinfer, *case)[0]
            diff = (fi_fn().float() - fn().float()).abs().max().item()
            fi_ms = graph_ms(fi_fn, args.reps)
            rows[-1].update(flashinfer_ms=fi_ms, flashinfer_tbps=read / fi_ms / 1e9,
                            flashinfer_max_diff=diff)
        print(rows[-1], flush=True)

    for ctx in args.contexts:
        for batch in args.batches:
            timed("decode", ctx, batch, 1, False)
        timed(f"verify {TREE_NODES}", ctx, 1, TREE_NODES, True)
    out = {"shape": shape, "max_err_vs_sdpa": err, "rows": rows}
    if flashinfer:
        import flashinfer as package

        out["flashinfer"] = package.__version__
        out["max_diff_flashinfer_vs_triton"] = max(r["flashinfer_max_diff"] for r in rows
                                                   if "flashinfer_max_diff" in r)
    return out


def model_section(args, device: torch.device, dtype: torch.dtype) -> dict:
    shape = {**MODELS[args.shape], "num_hidden_layers": args.layers}
    model, cfg = random_target(shape, dtype, device)
    out = {"layers": args.layers, "ctx": args.model_ctx}
    for eager in (False, True):
        # The pool sized for the batches (sized from free memory, the second engine would see
        # what the first one's allocator still holds).
        pages = sum(args.model_batches) * (-(-(args.model_ctx + 64) // 16) + 1)
        llm = LLM.from_modules(model, cfg, max_num_seqs=max(args.model_batches),
                               max_model_len=args.model_ctx + 64, enforce_eager=eager,
                               kv_cache_pages=pages)
        if not eager:
            out["graphs"] = llm.engine.uses_cuda_graphs
        with Scratch(llm) as s, torch.inference_mode():
            for b in args.model_batches:
                run = decode_forward(llm, s, b, args.model_ctx, cfg.vocab_size)
                out[f"{'eager' if eager else 'graph'}_b{b}_ms"] = median_ms(run, device,
                                                                           args.reps)
        llm.shutdown()
    print(out, flush=True)
    return out


def summary(res: dict) -> dict:
    keys = {}
    att = res.get("attention")
    if att:
        rows = {(r["step"], r["ctx"], r["batch"]): r for r in att["rows"]}
        if ("decode", 16384, 32) in rows:
            keys["mla_decode_tbps_16k_b32"] = rows["decode", 16384, 32]["tbps"]
            if "flashinfer_tbps" in rows["decode", 16384, 32]:
                keys["flashinfer_mla_decode_tbps_16k_b32"] = (
                    rows["decode", 16384, 32]["flashinfer_tbps"])
        ctx = 16384 if ("decode", 16384, 1) in rows else att["rows"][0]["ctx"]
        if ("decode", ctx, 1) in rows:
            keys["mla_verify64_over_decode"] = (rows[f"verify {TREE_NODES}", ctx, 1]["ms"]
                                                / rows["decode", ctx, 1]["ms"])
    model = res.get("model")
    if model and model["graphs"] and "graph_b1_ms" in model:
        keys["mla_graph_speedup_b1"] = model["eager_b1_ms"] / model["graph_b1_ms"]
    return keys


def report(res: dict) -> str:
    lines = ["# MLA: the Triton latent attention and a DeepSeek-V3-shaped model", "",
             f"Machine: {res['machine']}. Command: `{res['command']}`.", ""]
    att = res.get("attention")
    if att:
        heads, latent, rope = att["shape"]
        fi = "flashinfer" in att
        lines += [f"## Attention ({heads} heads, latent {latent} + rope {rope}, graph-replayed;"
                  f" max |Triton - SDPA| {att['max_err_vs_sdpa']:.2g})", ""]
        if fi:
            lines += [f"FlashInfer {att['flashinfer']} (the engine's decode path, "
                      "`attention/flashinfer_mla.py`): decode rows on the same pages and "
                      f"queries, max |FlashInfer - Triton| "
                      f"{att['max_diff_flashinfer_vs_triton']:.2g}.", ""]
        lines += ["| step | context | batch | ms | latent TB/s | TFLOP/s |"
                  + (" FlashInfer ms | FlashInfer TB/s |" if fi else ""),
                  "|---|---|---|---|---|---|" + ("---|---|" if fi else "")]
        for r in att["rows"]:
            line = (f"| {r['step']} | {r['ctx']} | {r['batch']} | {r['ms']:.3f} | "
                    f"{r['tbps']:.2f} | {r['tflops']:.0f} |")
            if fi:
                line += (f" {r['flashinfer_ms']:.3f} | {r['flashinfer_tbps']:.2f} |"
                         if "flashinfer_ms" in r else " - | - |")
            lines.append(line)
        lines.append("")
    model = res.get("model")
    if model:
        default = "graphs" if model["graphs"] else "default (no graphs here)"
        lines += [f"## Model ({model['layers']} layers, context {model['ctx']}): decode step ms",
                  "", f"| batch | {default} | enforce_eager |", "|---|---|---|"]
        lines += [f"| {b} | {model[f'graph_b{b}_ms']:.3f} | {model[f'eager_b{b}_ms']:.3f} |"
                  for b in res["model_batches"]]
        lines.append("")
    lines += [f"`{k}` {v:.3f}" + "  " for k, v in res["summary"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(ATTENTION), default="deepseek-v3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--layers", type=int, default=3, help="model section: decoder layers")
    ap.add_argument("--model-ctx", type=int, default=4096)
    ap.add_argument("--model-batches", default="1,32")
    ap.add_argument("--sections", default="attention,model")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.model_batches = [int(b) for b in args.model_batches.split(",")]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()
    res = {"machine": f"{name or 'CPU'}, torch {torch.__version__}",
           "command": "python benchmarks/mla_bench.py " + " ".join(sys.argv[1:]),
           "model_batches": args.model_batches}
    sections = args.sections.split(",")
    if "attention" in sections and device.type == "cuda":
        res["attention"] = attention_section(args, device, dtype)
    if "model" in sections:
        res["model"] = model_section(args, device, dtype)
    res["summary"] = summary(res)
    res.update(res["summary"])
    write_results(args.out, report(res), res)


if __name__ == "__main__":
    main()
