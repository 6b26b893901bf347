"""Where a decode step's time goes: the engine generating for a batch of requests on a
SmolLM2-135M-shaped random target (plain, or speculating with the shipped drafter), timed per
step and profiled: GPU kernel time against wall time, kernel launches and host syncs per step,
and the Python functions that hold the host.

    python benchmarks/profile_step.py --batch 1024 --sampled-fraction 0.5
    python benchmarks/profile_step.py --batch 1 --spec none,dflash:fixed,ddtree:fixed,ddtree

With a random target the drafter's drafts are rejected, so a speculative step commits ~1 token:
this measures what a step costs, not what it gains.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.bench.cli import parse_method  # noqa: E402
from flashtree.models.registry import DEFAULT_DRAFTER_DIR  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=1e5, tie_word_embeddings=True,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")  # the runtime calls that launch device work
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profiler_activities(cuda: bool) -> list[torch.profiler.ProfilerActivity]:
    """The host's activity, and the device's where there is one."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def per_step_counts(events, steps: int) -> tuple[float, float, float]:
    """From a profile of `steps` steps (`key_averages()`), per step: the runtime calls that
    launch device work, the host syncs, and the device's milliseconds."""
    launches = sum(e.count for e in events if e.key in LAUNCHES) / steps
    syncs = sum(e.count for e in events if e.key in SYNCS) / steps
    device_ms = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / steps
    return launches, syncs, device_ms


def start_requests(llm: LLM, args: argparse.Namespace) -> None:
    """`batch` requests with random prompts, prefilled, so that every later step decodes."""
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        temp = 1.0 if i < args.sampled_fraction * args.batch else 0.0
        prompt = torch.randint(0, 49152, (args.prompt_len,), generator=gen).tolist()
        eng.add_request(prompt, SamplingParams(temperature=temp, max_tokens=args.max_tokens,
                                               seed=i, ignore_eos=True))
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()


def profile_spec(target: str, spec: str, args: argparse.Namespace) -> dict:
    method = parse_method(spec)
    kw = method.llm_kwargs(argparse.Namespace(tree_budget=args.tree_budget))
    if method.spec != "none":
        kw["draft"] = str(DEFAULT_DRAFTER_DIR)
    llm = LLM(model=target, device=args.device, dtype=args.dtype, skip_tokenizer_init=True,
              max_num_seqs=args.batch, max_model_len=args.prompt_len + args.max_tokens + 64,
              enforce_eager=args.enforce_eager, **kw)
    start_requests(llm, args)
    eng = llm.engine
    cuda = torch.cuda.is_available() and llm.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, committed = [], 0
    before = sum(len(s.output_ids) for s in eng.scheduler.running)
    for _ in range(args.steps):  # timed without a profiler: cProfile slows Python-heavy steps
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t)
    committed = sum(len(s.output_ids) for s in eng.scheduler.running) - before
    host = cProfile.Profile()
    for _ in range(args.steps):
        host.enable()
        eng.step()
        host.disable()
        sync()
    with torch.profiler.profile(activities=profiler_activities(cuda),
                                with_stack=bool(args.trace)) as prof:
        for _ in range(args.profiled_steps):
            eng.step()
        sync()
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}/{spec.replace(':', '_')}_b{args.batch}.json")
    events = prof.key_averages()
    launches, syncs, gpu_ms = per_step_counts(events, args.profiled_steps)
    result = {
        "spec": spec, "step_ms": 1e3 * sorted(times)[len(times) // 2],
        "tokens_per_step": committed / (args.steps * args.batch),
        "gpu_ms": gpu_ms if cuda else None,
        "launches": launches, "syncs": syncs,
        "host": pstats.Stats(host),
        "table": events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                              row_limit=15),
    }
    llm.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--spec", default="none",
                    help="comma list of METHOD[:POLICY[:BUDGET]] as `flashtree bench` takes")
    ap.add_argument("--tree-budget", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--sampled-fraction", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profiled-steps", type=int, default=5)
    ap.add_argument("--host-functions", type=int, default=12,
                    help="Python functions listed by own time, per spec")
    ap.add_argument("--op-tables", action="store_true", help="also print torch.profiler tables")
    ap.add_argument("--trace", help="folder for a Chrome trace (with Python stacks) per spec")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    results = []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(d)
        for spec in args.spec.split(","):
            r = profile_spec(d, spec, args)
            results.append(r)
            print(f"\n### {spec}, batch {args.batch}: host functions by own time "
                  f"({args.steps} steps)")
            r["host"].sort_stats("tottime").print_stats(args.host_functions)
            if args.op_tables:
                print(r["table"])
    print("\n| spec | batch | step ms | tokens/step/request | GPU kernel ms/step | launches/step "
          "| host syncs/step |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        gpu = f"{r['gpu_ms']:.2f}" if r["gpu_ms"] is not None else "-"
        print(f"| {r['spec']} | {args.batch} | {r['step_ms']:.2f} | {r['tokens_per_step']:.2f} "
              f"| {gpu} | {r['launches']:.0f} | {r['syncs']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
