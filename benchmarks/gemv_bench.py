"""The batch-1 GEMV kernel (flashtree/layers/gemv.py) against cuBLAS (`F.linear`) on the
Qwen3-8B decode shapes, and its candidate launch configurations: microseconds and weight
bytes streamed per second, each GEMM replayed from a CUDA graph over enough weight copies
that the 50 MB L2 cannot hold them. Run on the GPU to re-tune `_BLOCK_N`, `_BLOCK_K`,
`_WARPS`, `_STAGES` there:

    python benchmarks/gemv_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashtree.layers.gemv as gemv_module  # noqa: E402
from flashtree.layers import dense  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096), "drafter fc": (4096, 20480)}
CONFIGS = ((8, 512, 4, 3), (16, 256, 4, 3), (8, 512, 8, 2), (16, 512, 8, 3), (4, 1024, 4, 3))


def microseconds(product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Graph-replayed time of `product(x, w)` per weight."""
    return triton.testing.do_bench_cudagraph(
        lambda: [product(x, w) for w in weights], rep=25) * 1e3 / len(weights)


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    names = ["F.linear"] + ["x".join(map(str, c)) for c in CONFIGS]
    print("| shape | " + " | ".join(names) + " |  (us, TB/s; config BLOCK_N x BLOCK_K x warps x "
          "stages)\n|---|" + "---|" * len(names))
    for name, (n, k) in SHAPES.items():
        copies = max(1, int(200e6 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                   for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cells = []
        for config in (None, *CONFIGS):
            if config is not None:
                (gemv_module._BLOCK_N, gemv_module._BLOCK_K, gemv_module._WARPS,
                 gemv_module._STAGES) = config
            us = microseconds(F.linear if config is None else dense, x, weights)
            cells.append(f"{us:.1f}, {n * k * 2 / us / 1e6:.2f}")
        print(f"| {name} ({n}x{k}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
