"""CPU weight formats for a decode step, measured against each other: the matmuls of one token of
the default model (SmolLM2-135M: 30 layers of q/k/v, o, gate/up and down, then the tied LM head)
with the weights held as float32, bfloat16, PyTorch's packed int4 (group 32, the layout GGUF
Q4_0/Q4_1 map to exactly) and packed int8 (one scale per row), at 1, 4 and 16 rows (`--rows`;
16 is the verify of a 15-node tree, and its cost over 1 row decides whether speculation can
pay), 1 thread and all cores. Every layer has its own weights, as in the model, so a pass
streams them from memory the way a decode step does (a single repeated matmul would run from
cache). Also reported: each format's largest relative error against the float32 product of the
same (dequantized) weights.

    python benchmarks/cpu_kernels.py --out benchmarks/results/DATE-cpu-kernels.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import write_results  # noqa: E402

HIDDEN, INTER, KV, VOCAB, LAYERS, GROUP = 576, 1536, 192, 49152, 30, 32
# (out, in) of one layer's matmuls: fused q/k/v, o, fused gate/up, down.
LAYER = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


class Weight:
    """One weight in every format, from random 4-bit codes with Q4_1's block scales and mins
    (so that int4 holds it exactly)."""

    def __init__(self, n: int, k: int, gen: torch.Generator) -> None:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        d = torch.rand(n, k // GROUP, generator=gen) * 0.02
        m = -torch.rand(n, k // GROUP, generator=gen) * 0.15
        self.fp32 = (q.view(n, -1, GROUP) * d[..., None] + m[..., None]).view(n, k)
        self.bf16 = self.fp32.bfloat16()
        self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        zeros = m + 8 * d  # torch's int4 dequantization: (code - 8) * scale + zero
        self.int4_sz = torch.stack([d, zeros], -1).transpose(0, 1).contiguous()
        self.int4_sz_bf16 = self.int4_sz.bfloat16()
        scale = self.fp32.abs().amax(1) / 127
        self.int8 = (self.fp32 / scale[:, None]).round().to(torch.int8)
        self.int8_scale = scale.bfloat16()


FORMATS: dict[str, tuple[Callable, float]] = {  # name: (x, weight -> y), bytes per weight
    "float32": (lambda x, w: F.linear(x, w.fp32), 4.0),
    "bfloat16": (lambda x, w: F.linear(x.bfloat16(), w.bf16), 2.0),
    "int4, float32 activations": (lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, w.int4, GROUP, w.int4_sz), 0.5 + 8 / GROUP),
    "int4, bfloat16 activations": (lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), w.int4, GROUP, w.int4_sz_bf16), 0.5 + 4 / GROUP),
    "int8 per row, bfloat16 activations": (lambda x, w: torch.ops.aten._weight_int8pack_mm(
        x.bfloat16(), w.int8, w.int8_scale), 1.0),
}


def token_pass(fmt: Callable, layers: list[list[Weight]], head: Weight, rows: int) -> float:
    """Seconds for one token's matmuls (every layer, then the head)."""
    x = torch.randn(rows, HIDDEN)
    x_inter = torch.randn(rows, INTER)
    start = time.perf_counter()
    for layer in layers:
        for (_, k), w in zip(LAYER, layer):
            fmt(x_inter if k == INTER else x, w)
    fmt(x, head)
    return time.perf_counter() - start


def max_error(fmt: Callable, w: Weight, rows: int) -> float:
    x = torch.randn(rows, w.fp32.shape[1])
    ref = F.linear(x, w.fp32)
    return float((fmt(x, w).float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4, 16],
                    help="token rows per pass (16: a verify of a 15-node tree)")
    ap.add_argument("--out", type=Path, required=True, help="markdown report (JSON beside it)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    layers = [[Weight(n, k, gen) for n, k in LAYER] for _ in range(LAYERS)]
    head = Weight(VOCAB, HIDDEN, gen)
    params = sum(n * k for n, k in LAYER) * LAYERS + VOCAB * HIDDEN
    cores = os.cpu_count() or 1
    rows_out = []
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        for rows in args.rows:
            for name, (fmt, bytes_per) in FORMATS.items():
                token_pass(fmt, layers, head, rows)  # warm-up
                best = min(token_pass(fmt, layers, head, rows) for _ in range(args.repeats))
                rows_out.append({"threads": threads, "rows": rows, "format": name,
                                 "ms": best * 1e3, "weight_mb": params * bytes_per / 1e6,
                                 "max_rel_error": max_error(fmt, layers[0][2], rows)})
    for r in rows_out:
        base = next(b for b in rows_out if b["threads"] == r["threads"]
                    and b["rows"] == r["rows"] and b["format"] == "float32")
        one = next(b for b in rows_out if b["threads"] == r["threads"]
                   and b["rows"] == min(args.rows) and b["format"] == r["format"])
        r["speedup_over_float32"] = base["ms"] / r["ms"]
        r["over_fewest_rows"] = r["ms"] / one["ms"]
    res = {"machine": f"{platform.processor() or 'CPU'}, {cores} cores, torch {torch.__version__}",
           "command": "python benchmarks/cpu_kernels.py " + " ".join(sys.argv[1:]),
           "rows": rows_out}
    lines = ["# CPU weight formats: one token's matmuls", "",
             f"Machine: {res['machine']}. Command: `{res['command']}`. The default model's "
             f"{LAYERS} layers and tied LM head ({params / 1e6:.0f}M weights), each weight its "
             f"own tensor; best of {args.repeats} passes.", "",
             "| threads | rows | format | weights MB | ms per pass | over float32 | "
             f"over {min(args.rows)} row(s) | max rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['threads']} | {r['rows']} | {r['format']} | {r['weight_mb']:.0f} | "
                     f"{r['ms']:.1f} | {r['speedup_over_float32']:.2f} | "
                     f"{r['over_fewest_rows']:.2f} | {r['max_rel_error']:.1e} |")
    write_results(args.out, "\n".join(lines) + "\n", res)


if __name__ == "__main__":
    main()
