"""Tensor parallelism on GPUs (NCCL): TP=2 tokens, replayed from CUDA graphs and run eagerly,
against TP=1 tokens in bf16 for spec none / dflash / ddtree (greedy and seeded sampling; each
divergence reported with TP=1's top-2 logit gap there); TP1 vs TP2 (graphs, and eager) decode
step time on a Qwen3-8B-shaped target with a 5-layer Qwen3-8B-shaped DFlash drafter (random
weights), AR and DDTree; the TP2 group's all-reduce latency per message size, NCCL against the
one-shot kernel, as the group measured it when it started; and DDTree end to end with the
acceptance oracle against plain decoding on TP1 and TP2. Writes a JSON beside the report.

    python benchmarks/tp_bench.py --out benchmarks/results/<date>-tp-gpu.md

`--shape tiny --device cpu` runs the same script small over gloo (a check of the script itself).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashtree import LLM, SamplingParams  # noqa: E402
from flashtree.bench.oracle import AcceptanceOracle, plain_references  # noqa: E402
from flashtree.bench.random_pair import QWEN3_8B, TINY  # noqa: E402
from flashtree.distributed import one_shot_all_reduce  # noqa: E402
from flashtree.runner.forward_batch import BatchItem, Mode  # noqa: E402

# The JSON beside the report.
RESULTS: dict = {"equality": [], "divergences": [], "steps": [], "oracle": []}
COMMON = dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              rms_norm_eps=1e-6)


def fill_and_save(model: torch.nn.Module, out: Path, seed: int, std: float, device: str) -> None:
    """Random weights for a model built on the meta device: N(0, std) matrices, unit norms;
    written as safetensors shards of at most ~4 GB plus an index, as HF checkpoints are."""
    from safetensors.torch import save_file

    gen = torch.Generator(device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in model.state_dict().items():
        if p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()
        if size + t.numel() * 2 > 4e9 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}  # as transformers reads
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def make_target(out: Path, shape: dict, layers: int, device: str) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(**{**shape, **COMMON, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    cfg.save_pretrained(out)
    fill_and_save(model, out, seed=1, std=0.02, device=device)
    return out


def make_drafter(out: Path, target: Path, shape: dict, layers: int, block: int,
                 device: str) -> Path:
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target / "config.json").read_text())
    n = tcfg["num_hidden_layers"]
    taps = sorted({round(1 + i * (n - 3) / 4) for i in range(5)})  # 5 spaced target layers
    cfg = Qwen3Config(**{**shape, **COMMON, "num_hidden_layers": layers},
                      layer_types=["full_attention"] * layers)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = block
    cfg.num_target_layers = n
    cfg.dflash_config = {"target_layer_ids": taps, "mask_token_id": shape["vocab_size"] - 1}
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    cfg.save_pretrained(out)
    fill_and_save(model, out, seed=2, std=0.02, device=device)
    return out


def free(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def top2_gap(llm: LLM, tokens: list[int]) -> float:
    """TP=1's logit gap between its two best next tokens after `tokens` (a near-tie is small)."""
    eng = llm.engine
    sid = -1
    eng.pages.reserve(sid, len(tokens))
    try:
        logits, _ = eng.runner.forward(Mode.PREFILL, [BatchItem(sid, 0, tokens)])
    finally:
        eng.pages.free(sid)
    top = logits[0].float().topk(2).values
    return float(top[0] - top[1])


def equality(args, target: Path, drafter: Path) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (5, 33, 100, 17)]
    cases = [(spec, temp) for temp in (0.0, 0.8) for spec in ("none", "dflash", "ddtree")]
    common = dict(model=str(target), device=args.device, dtype=args.dtype,
                  skip_tokenizer_init=True, max_model_len=1024)
    runs = [(2, False), (2, True), (1, False)]  # (TP size, eager)
    tokens: dict[tuple, list[list[int]]] = {}
    for tp, eager in runs:
        for spec, temp in cases:
            kw = {} if spec == "none" else dict(draft=str(drafter), spec=spec)
            llm = LLM(**common, **kw, tensor_parallel_size=tp, enforce_eager=eager)
            sp = [SamplingParams(temperature=temp, max_tokens=args.equality_tokens,
                                 ignore_eos=True, seed=100 + i) for i in range(len(prompts))]
            tokens[tp, eager, spec, temp] = [o.outputs[0].token_ids
                                             for o in llm.generate(prompts, sp)]
            if tp == 1 and spec == "none" and temp == 0.0:
                gap_llm = llm
            else:
                free(llm)
    lines = ["| spec | T | TP2 graphs = TP2 eager | TP2 graphs = TP1 | first divergences from "
             "TP1: request @ index (TP1's top-2 logit gap there) |", "|---|---:|---:|---:|---|"]
    for spec, temp in cases:
        one, two, eager = (tokens[tp, e, spec, temp] for tp, e in ((1, False), (2, False),
                                                                    (2, True)))
        notes = []
        for r, (x, y) in enumerate(zip(one, two)):
            if x != y:
                j = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(map(len, (x, y))))
                gap = top2_gap(gap_llm, prompts[r] + x[:j])
                notes.append(f"{r} @ {j} ({gap:.3f})")
                RESULTS["divergences"].append(dict(spec=spec, temperature=temp, request=r,
                                                   index=j, tp1_top2_gap=gap))
        same_eager = sum(x == y for x, y in zip(two, eager))
        same_one = sum(x == y for x, y in zip(two, one))
        RESULTS["equality"].append(dict(spec=spec, temperature=temp, requests=len(one),
                                        graphs_equal_eager=same_eager, graphs_equal_tp1=same_one))
        lines.append(f"| {spec} | {temp} | {same_eager}/{len(one)} | {same_one}/{len(one)} | "
                     f"{', '.join(notes) or '-'} |")
    free(gap_llm)
    return lines


def step_times(llm: LLM, batch: int, ctx: int, steps: int, vocab: int) -> tuple[float, float]:
    """Median wall ms of one engine decode step and mean tokens committed per request per step,
    with `batch` requests of `ctx` prompt tokens."""
    eng = llm.engine
    gen = torch.Generator().manual_seed(batch)
    sp = SamplingParams(temperature=0, max_tokens=steps * 20 + 50, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(0, vocab - 1, (ctx,), generator=gen).tolist(), sp)
            for _ in range(batch)]
    while not all(s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    times, produced = [], sum(len(s.output_ids) for s in seqs)
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    produced = sum(len(s.output_ids) for s in seqs) - produced
    for s in seqs:
        eng.abort(s)
    return sorted(times)[len(times) // 2], produced / (steps * batch)


def bench(args, target: Path, drafter: Path) -> list[str]:
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    rows: dict[tuple, tuple[float, float]] = {}
    runs = [(1, False), (2, False), (2, True)]  # (TP size, eager)
    for tp, eager in runs:
        for spec in ("none", "ddtree"):
            kw = {} if spec == "none" else dict(draft=str(drafter), spec=spec,
                                                spec_policy="fixed")
            llm = LLM(model=str(target), device=args.device, dtype=args.dtype,
                      skip_tokenizer_init=True, max_model_len=args.ctx + 1024,
                      max_num_seqs=max(args.batches), tensor_parallel_size=tp,
                      enforce_eager=eager, **kw)
            if tp == 2 and not eager and spec == "none":
                record_all_reduce_latency()
            for b in args.batches:
                rows[tp, eager, spec, b] = step_times(llm, b, args.ctx, args.steps, vocab)
                print(f"tp{tp} eager={eager} {spec} batch {b}: "
                      f"{rows[tp, eager, spec, b][0]:.2f} ms/step", flush=True)
            free(llm)
    lines = ["| spec | batch | TP1 ms/step | TP2 ms/step | TP2 eager ms/step | TP2/TP1 | "
             "tokens/step/request |", "|---|---:|---:|---:|---:|---:|---:|"]
    for spec in ("none", "ddtree"):
        for b in args.batches:
            t1, t2, t2e = (rows[tp, e, spec, b][0] for tp, e in runs)
            RESULTS["steps"].append(dict(spec=spec, batch=b, tp1_ms=t1, tp2_ms=t2,
                                         tp2_eager_ms=t2e, tp2_over_tp1=t2 / t1))
            lines.append(f"| {spec} | {b} | {t1:.2f} | {t2:.2f} | {t2e:.2f} | {t2 / t1:.2f} | "
                         f"{rows[2, False, spec, b][1]:.2f} |")
    for b in (1, 32):
        if (1, False, "none", b) in rows:
            RESULTS[f"tp2_over_tp1_b{b}"] = (rows[2, False, "none", b][0]
                                             / rows[1, False, "none", b][0])
    return lines


def oracle_runs(args, target: Path, drafter: Path) -> list[str]:
    """End to end at real acceptance: DDTree with the acceptance oracle against plain
    decoding, on TP1 and TP2, at each `--oracle-concurrency` (tokens/s of whole generate
    calls, prefill included; all prompts of one call arrive together)."""
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    most = max(args.oracle_concurrency)
    prompts = [torch.randint(0, vocab - 1, (args.ctx,), generator=gen).tolist()
               for _ in range(most)]
    params = SamplingParams(temperature=0, max_tokens=args.oracle_tokens, ignore_eos=True)
    p, q = args.oracle
    rows = {}
    for tp in (1, 2):
        for spec in ("none", "ddtree"):
            kw = {} if spec == "none" else dict(draft=str(drafter), spec=spec,
                                                spec_policy="fixed")
            llm = LLM(model=str(target), device=args.device, dtype=args.dtype,
                      skip_tokenizer_init=True, max_model_len=args.ctx + args.oracle_tokens + 64,
                      max_num_seqs=most, tensor_parallel_size=tp, **kw)
            if spec == "ddtree":
                AcceptanceOracle(llm, plain_references(llm, prompts, params), p, q, seed=0)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
            for c in args.oracle_concurrency:
                start = time.perf_counter()
                outs = llm.generate(prompts[:c], params)
                seconds = time.perf_counter() - start
                steps = [n for o in outs for n in o.outputs[0].spec_accept_lengths]
                rows[tp, spec, c] = (c * args.oracle_tokens / seconds,
                                     sum(steps) / max(len(steps), 1))
                print(f"oracle tp{tp} {spec} concurrency {c}: {rows[tp, spec, c][0]:.1f} "
                      "tokens/s", flush=True)
            free(llm)
    lines = ["| TP | concurrency | none tokens/s | DDTree tokens/s | DDTree / none | "
             "tokens per step |", "|---:|---:|---:|---:|---:|---:|"]
    for tp in (1, 2):
        for c in args.oracle_concurrency:
            (none, _), (tree, tau) = rows[tp, "none", c], rows[tp, "ddtree", c]
            RESULTS["oracle"].append(dict(tp=tp, concurrency=c, none_tokens_s=none,
                                          ddtree_tokens_s=tree, tau=tau, p=p, q=q))
            lines.append(f"| {tp} | {c} | {none:.1f} | {tree:.1f} | {tree / none:.2f} | "
                         f"{tau:.2f} |")
    return lines


def record_all_reduce_latency() -> None:
    """The running TP group's calibration: NCCL and one-shot us per message size (slowest
    rank), and the largest message the group sends one-shot."""
    one_shot = one_shot_all_reduce()
    RESULTS["one_shot_max_bytes"] = None if one_shot is None else one_shot.max_bytes
    if one_shot is not None:
        RESULTS["all_reduce_us"] = [dict(bytes=n, nccl=a, one_shot=b)
                                    for n, (a, b) in one_shot.latency_us.items()]


def all_reduce_table() -> list[str]:
    if not RESULTS.get("all_reduce_us"):
        return ["No one-shot all-reduce in the TP2 group (see the warning in the log).", ""]
    lines = [f"Messages up to {RESULTS['one_shot_max_bytes']} bytes go one-shot.", "",
             "| bytes | NCCL us | one-shot us |", "|---:|---:|---:|"]
    lines += [f"| {r['bytes']} | {r['nccl']:.1f} | {r['one_shot']:.1f} |"
              for r in RESULTS["all_reduce_us"]]
    return [*lines, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="markdown report path")
    ap.add_argument("--work", default="/tmp/ft_tp_bench", help="where random checkpoints go")
    ap.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--equality-layers", type=int, default=4)
    ap.add_argument("--equality-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--oracle", type=lambda t: tuple(float(v) for v in t.split(",")),
                    default=(0.863, 0.5), metavar="P,Q",
                    help="oracle rates: the drafter's top-1 is right with P (0.863: tau 6.6 "
                         "for a block-16 chain, the DFlash paper's), its top-2 with Q of the rest")
    ap.add_argument("--oracle-concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--oracle-tokens", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[], choices=["equality", "bench", "oracle"])
    args = ap.parse_args()
    shape = QWEN3_8B if args.shape == "qwen3-8b" else TINY
    work = Path(args.work)
    gen_dev = "cuda" if torch.cuda.is_available() else "cpu"
    report = [f"# Tensor parallelism, TP1 vs TP2 ({args.shape}-shaped, random weights, "
              f"{args.dtype})", "",
              f"Machine: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}"
              f" x {max(torch.cuda.device_count(), 1)}, torch {torch.__version__}, "
              f"Python {platform.python_version()}.", "",
              "Command: `python benchmarks/tp_bench.py " + " ".join(sys.argv[1:]) + "`", ""]
    if "equality" not in args.skip:
        report += [f"## TP2 vs TP1 tokens ({args.equality_layers} target layers, 2-layer "
                   f"drafter, block 8, {args.equality_tokens} tokens per request, seeded "
                   "sampling at T = 0.8)", ""]
        t0 = time.time()
        try:
            small = make_target(work / "eq_target", shape, args.equality_layers, gen_dev)
            small_d = make_drafter(work / "eq_drafter", small, shape, 2, 8, gen_dev)
            report += [*equality(args, small, small_d), "", f"({time.time() - t0:.0f} s)", ""]
        except Exception:  # noqa: BLE001 - the report says what failed; the bench still runs
            report += ["```", traceback.format_exc(), "```", ""]
        print("\n".join(report), flush=True)
    @functools.cache
    def full_pair() -> tuple[Path, Path]:
        """The full-depth target and its drafter, written once for the sections that use them."""
        target = make_target(work / "target", shape, shape["num_hidden_layers"], gen_dev)
        return target, make_drafter(work / "drafter", target, shape, 5, 16, gen_dev)

    if "bench" not in args.skip:
        report += [f"## Decode step time, context {args.ctx}, median of {args.steps} steps "
                   "(wall time of `engine.step()`, host and broadcast included; DDTree budget "
                   "15, random drafter so about one token per step). TP2/TP1 compares graph "
                   "runs (goals: <= 0.65 at batch 1, <= 0.6 at batch 32)", ""]
        try:
            report += [*bench(args, *full_pair()), ""]
            report += ["## All-reduce latency in the TP2 group (bf16, replayed from a CUDA graph "
                       "of 20 calls, slowest rank)", "", *all_reduce_table()]
        except Exception:  # noqa: BLE001
            report += ["```", traceback.format_exc(), "```", ""]
    if "oracle" not in args.skip:
        report += [f"## DDTree end to end with the acceptance oracle (P {args.oracle[0]}, Q "
                   f"{args.oracle[1]}; budget 15, block 16; context {args.ctx}, "
                   f"{args.oracle_tokens} new tokens per request)", ""]
        try:
            report += [*oracle_runs(args, *full_pair()), ""]
        except Exception:  # noqa: BLE001
            report += ["```", traceback.format_exc(), "```", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(report))
    RESULTS.update(command="python benchmarks/tp_bench.py " + " ".join(sys.argv[1:]),
                   machine=report[2], shape=args.shape, dtype=args.dtype, ctx=args.ctx)
    Path(args.out).with_suffix(".json").write_text(json.dumps(RESULTS, indent=1))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
