"""Multi-GPU layouts of a MoE target (random weights, Qwen3-30B-A3B-shaped by default, or
DeepSeek-V3-shaped with `--shape deepseek-v3`, depth set by `--layers`): decode tokens/s per
concurrency, plain and with DDTree over a random drafter; the verify forward's time per tree
budget; each layout's greedy tokens against the first layout's; all-reduce and all-to-all
latency at the model's message sizes.

    python benchmarks/multigpu_bench.py --out benchmarks/results/2026-11-30-multigpu.md

Layout names map to (tensor_parallel_size, expert_parallel_size) by SGLang's `--tp T --ep E`
convention (README: E divides T; the experts form E groups held by T / E ranks each):
  tpN     -> (N, 1)      every expert sliced over all N ranks
  epN     -> (N, N)      each rank holds num_experts / N whole experts
  epNtpM  -> (N * M, N)  N expert groups of M ranks, each expert sliced over its group's M
So "tp4,tp8,ep8,ep4tp2" is TP4, TP8, TP8 with EP8, and TP8 with EP4. A layout needing more
ranks than GPUs (on CPU: `--max-ranks`) is skipped with a line in the report.

`--shape tiny --device cpu --dtype float32 --max-ranks 2 --layouts tp2,ep2` runs the same script
small over gloo (a check of the script itself).
"""

from __future__ import annotations

import argparse
import platform
import re
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.tp_bench import COMMON, fill_and_save, free, make_drafter, step_times  # noqa: E402
from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.runner.forward_batch import Mode  # noqa: E402

# family, target config, default depth, DFlash drafter (dense Qwen3) config
SHAPES = {
    "qwen3-moe": ("Qwen3Moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1e6,
        max_position_embeddings=40960), 48, dict(
        hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960)),
    "deepseek-v3": ("DeepseekV3", dict(  # 6 layers: 3 dense + 3 MoE, ~75 GB in bf16
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
        topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        rope_theta=1e4, max_position_embeddings=163840), 6, dict(
        hidden_size=7168, intermediate_size=18432, num_attention_heads=56, num_key_value_heads=8,
        head_dim=128, vocab_size=129280, rope_theta=1e4, max_position_embeddings=163840)),
    "tiny": ("Qwen3Moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=1e4,
        max_position_embeddings=4096), 4, dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, rope_theta=1e4, max_position_embeddings=4096)),
}
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


def make_target(out: Path, family: str, cfg: dict, layers: int, device: str) -> Path:
    """A random-weight HF checkpoint with per-expert tensors (experts.{e}.gate_proj ...), the
    format released checkpoints use; transformers' modules hold them fused per layer."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, f"{family}Config")(
        **{**cfg, **COMMON, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2 * I, H]
            for e in range(p.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    tensors[f"{name[:-12]}{e}.{proj}.weight"] = p[e, : p.shape[1] // 2]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            for e in range(p.shape[0]):
                tensors[f"{name[:-9]}{e}.down_proj.weight"] = p[e]
        else:
            tensors[name] = p
    config.save_pretrained(out)
    fill_and_save(SimpleNamespace(state_dict=lambda: tensors), out, seed=1, std=0.02,
                  device=device)
    return out


def _timed(op, iters: int, device: torch.device) -> float:
    """Mean microseconds of `op` over `iters` calls after 5 warm-up calls."""
    for _ in range(5):
        op()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        op()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


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
        out["all_reduce", n] = _timed(lambda x=x: dist.all_reduce(x), iters, device)
        if cuda:  # gloo has no all_to_all_single; pad so every rank gets an equal part
            flat = torch.zeros(-(-x.numel() // world) * world, dtype=dtype, device=device)
            recv = torch.empty_like(flat)
            out["all_to_all", n] = _timed(lambda f=flat, r=recv: dist.all_to_all_single(r, f),
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


def timing_verify(llm: LLM) -> list[float]:
    """Wrap rank 0's model runner so each VERIFY forward's wall ms lands in the returned list
    (the other ranks run theirs in lockstep: the forward's all-reduces join them)."""
    runner, times = llm.engine.runner, []
    forward = runner.forward

    def timed(mode, items, *args, **kwargs):
        if mode is not Mode.VERIFY:
            return forward(mode, items, *args, **kwargs)
        sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        out = forward(mode, items, *args, **kwargs)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
        return out

    runner.forward = timed
    return times


def greedy_tokens(llm: LLM, vocab: int) -> list[list[int]]:
    """32 greedy tokens for each of 4 seeded random prompts (layouts compare these)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (5, 33, 100, 17)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def run_layout(args, layout: str, target: Path, drafter: Path, vocab: int
               ) -> tuple[list, list, list]:
    """Decode rows (spec, concurrency, ms/step, tokens/step/request, tokens/s), verify rows
    (tree budget, verify ms, step ms) and plain greedy tokens of one layout."""
    tp, ep = parse_layout(layout)
    ctx_len = args.ctx + args.steps * 20 + 50 + max(args.tree_sizes) + 64
    runs = [("none", None), ("ddtree", None)] + [("ddtree", b) for b in args.tree_sizes]
    decode, verify, tokens = [], [], []
    for spec, budget in runs:
        kw = {} if spec == "none" else dict(draft=str(drafter), spec=spec, spec_policy="fixed",
                                            tree_budget=budget)
        conc = args.concurrency if budget is None else args.verify_concurrency
        llm = LLM(model=str(target), device=args.device, dtype=args.dtype,
                  skip_tokenizer_init=True, max_model_len=ctx_len, max_num_seqs=max(conc),
                  tensor_parallel_size=tp, expert_parallel_size=ep, **kw)
        try:
            if spec == "none":
                tokens = greedy_tokens(llm, vocab)
            for c in conc:
                times = timing_verify(llm) if budget is not None else []
                ms, per_req = step_times(llm, c, args.ctx, args.steps, vocab)
                if budget is None:
                    decode.append((spec, c, ms, per_req, c * per_req / ms * 1e3))
                else:
                    verify.append((budget, c, sorted(times)[len(times) // 2], ms))
                print(f"{layout} {spec} budget {budget} concurrency {c}: {ms:.2f} ms/step",
                      flush=True)
        finally:
            free(llm)
    return decode, verify, tokens


def equality_table(tokens: dict[str, list[list[int]]]) -> list[str]:
    """Each layout's greedy tokens against the first layout's (bf16 layouts sum in different
    orders, so a divergence at a near-tie is expected; the index says where)."""
    if len(tokens) < 2:
        return []
    first, *others = tokens
    lines = ["", f"## Greedy tokens against {first} (4 prompts, 32 tokens, plain decoding)", "",
             "| layout | requests equal | first divergences: request @ index |", "|---|---:|---|"]
    for name in others:
        diverged = [f"{r} @ {next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), 32)}"
                    for r, (a, b) in enumerate(zip(tokens[first], tokens[name])) if a != b]
        same = len(tokens[first]) - len(diverged)
        lines.append(f"| {name} | {same}/{len(tokens[first])} | {', '.join(diverged) or '-'} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="markdown report path")
    ap.add_argument("--work", default="/tmp/ft_multigpu_bench", help="random checkpoints go here")
    ap.add_argument("--shape", default="qwen3-moe", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, help="target depth (default: the shape's, see SHAPES)")
    ap.add_argument("--draft-layers", type=int, default=1, choices=[1, 2])
    ap.add_argument("--layouts", default="tp4,tp8,ep8,ep4tp2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-ranks", type=int, default=2, help="ranks allowed on CPU")
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--tree-sizes", default="1,16,64,256", help="DDTree tree_budget values")
    ap.add_argument("--verify-concurrency", default="1", help="requests per verify forward")
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="timed engine steps (median)")
    ap.add_argument("--comm-tokens", default=f"1,16,128,{128 * 65}")
    ap.add_argument("--comm-iters", type=int, default=50)
    args = ap.parse_args()
    for key in ("concurrency", "tree_sizes", "verify_concurrency", "comm_tokens"):
        setattr(args, key, [int(v) for v in getattr(args, key).split(",")])
    layouts = args.layouts.split(",")
    for name in layouts:
        parse_layout(name)  # fail on a bad name before any work
    family, cfg, default_layers, draft_cfg = SHAPES[args.shape]
    layers = args.layers or default_layers
    cuda = args.device == "cuda"
    ranks = torch.cuda.device_count() if cuda else args.max_ranks
    gpu = (torch.cuda.get_device_name(0) if ranks else "no GPU") if cuda else "CPU"
    report = [f"# MoE multi-GPU layouts ({args.shape}-shaped, {layers} layers, random weights, "
              f"{args.dtype})", "",
              f"Machine: {gpu} x {ranks if cuda else 1}, torch {torch.__version__}, Python "
              f"{platform.python_version()}.", "",
              "Command: `python benchmarks/multigpu_bench.py " + " ".join(sys.argv[1:]) + "`",
              ""]
    runnable = []
    for name in layouts:
        tp, ep = parse_layout(name)
        if tp > ranks:
            report.append(f"- skipped {name} (TP {tp}, EP {ep}): needs {tp} ranks, "
                          f"{ranks} available")
        else:
            runnable.append(name)
    work, gen_dev = Path(args.work), "cuda" if torch.cuda.is_available() else "cpu"
    target = make_target(work / f"{args.shape}-{layers}", family, cfg, layers, gen_dev)
    block = 8 if args.shape == "tiny" else 16
    drafter = make_drafter(work / f"{args.shape}-{layers}-drafter", target, draft_cfg,
                           args.draft_layers, block, gen_dev)
    decode, verify, tokens = {}, {}, {}
    for name in runnable:
        try:
            decode[name], verify[name], tokens[name] = run_layout(args, name, target, drafter,
                                                                  cfg["vocab_size"])
        except Exception:  # noqa: BLE001 - the report says what failed; other layouts run
            report += ["", f"{name} failed:", "```", traceback.format_exc(), "```"]
    report += ["", f"## Decode, context {args.ctx}, median of {args.steps} engine steps "
               f"(DDTree: fixed policy, budget {block - 1}, {args.draft_layers}-layer random "
               "drafter, so about one token per step)", "",
               "| layout | TP | EP | spec | concurrency | ms/step | tokens/step/request | "
               "tokens/s |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for name, rows in decode.items():
        tp, ep = parse_layout(name)
        report += [f"| {name} | {tp} | {ep} | {spec} | {c} | {ms:.2f} | {per:.2f} | {tps:.1f} |"
                   for spec, c, ms, per, tps in rows]
    report += ["", "## Verify forward per DDTree tree_budget (budget + 1 tokens per request; "
               "median ms of rank 0's VERIFY forward, and of the whole engine step)", "",
               "| layout | tree_budget | concurrency | verify ms | step ms |",
               "|---|---:|---:|---:|---:|"]
    for name, rows in verify.items():
        report += [f"| {name} | {b} | {c} | {v:.2f} | {ms:.2f} |" for b, c, v, ms in rows]
    report += equality_table(tokens)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    report += ["", f"## Collectives, mean us over {args.comm_iters} calls on rank 0 "
               f"(message: hidden {cfg['hidden_size']} x tokens x {elem} bytes)", "",
               "| ranks | tokens | bytes | all_reduce us | all_to_all_single us |",
               "|---:|---:|---:|---:|---:|"]
    for world in sorted({parse_layout(n)[0] for n in runnable} - {1}):
        try:
            lat = comm_latency(args, world, cfg["hidden_size"])
        except Exception:  # noqa: BLE001
            report += ["", "```", traceback.format_exc(), "```"]
            continue
        for n in args.comm_tokens:
            a2a = f"{lat['all_to_all', n]:.1f}" if ("all_to_all", n) in lat else "n/a on gloo"
            report.append(f"| {world} | {n} | {n * cfg['hidden_size'] * elem} | "
                          f"{lat['all_reduce', n]:.1f} | {a2a} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
