"""The GEMV kernels of `flashtree/layers/gemv.py` timed graph-replayed against cuBLAS, for
`benchmarks/kernels.py`: the batch-1 GEMV at each candidate launch configuration over weight
copies larger than L2, an RMSNorm folded into it (MLA's q_a norm before q_b) against the two
launches it replaces, and a float32 router against a verify's few rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtree.bench.timing import graph_ms

GEMV_SHAPES = {  # Qwen3-8B's, and a Kimi K2.6 TP8 rank's dense projections
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288), "lm_head": (151936, 4096), "drafter fc": (4096, 20480)},
    "kimi-tp8": {"qkv_a": (2112, 7168), "q_b": (1536, 1536), "o": (7168, 1024),
                 "shared gate_up": (512, 7168), "shared down": (7168, 256),
                 "lm_head": (20480, 7168)}}
GEMV_CONFIGS = ((8, 512, 4, 3), (16, 256, 4, 3), (8, 512, 8, 2), (16, 512, 8, 3),
                (4, 1024, 4, 3), (2, 512, 4, 3), (1, 1024, 4, 3))  # BLOCK_N, K, warps, stages
L2_BYTES = 200e6  # weight copies beyond this: more than an H100/H200's 50 MB L2 holds


def _copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    count = max(1, int(L2_BYTES // (n * k * dtype.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(count)]


def _us_per_copy(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    return graph_ms(lambda: [fn(x, w) for w in weights], reps) * 1e3 / len(weights)


@torch.inference_mode()
def gemv_configs(shapes: str, reps: int) -> list[dict]:
    """Per shape of GEMV_SHAPES[shapes]: cuBLAS (`F.linear`), the kernel at each launch
    configuration and at the default choice, microseconds."""
    import flashtree.layers.gemv as module
    from flashtree.layers import dense

    default = (module._BLOCK_N, module._BLOCK_K, module._WARPS, module._STAGES)
    choose, rows = module.launch_shape, []
    try:
        for name, (n, k) in GEMV_SHAPES[shapes].items():
            weights = _copies(n, k, torch.bfloat16)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            row: dict = {"shape": name, "n": n, "k": k,
                         "F.linear": _us_per_copy(F.linear, x, weights, reps)}
            for config in GEMV_CONFIGS:
                module._BLOCK_N, module._BLOCK_K, module._WARPS, module._STAGES = config
                module.launch_shape = lambda n, device, c=config: c[:2]
                row["x".join(map(str, config))] = _us_per_copy(dense, x, weights, reps)
            module.launch_shape = choose
            module._BLOCK_N, module._BLOCK_K, module._WARPS, module._STAGES = default
            row["default"] = _us_per_copy(dense, x, weights, reps)
            rows.append(row)
            print(row, flush=True)
    finally:
        module._BLOCK_N, module._BLOCK_K, module._WARPS, module._STAGES = default
        module.launch_shape = choose
    return rows


@torch.inference_mode()
def norm_fold(reps: int, n: int = 1536, k: int = 1536) -> dict:
    """MLA's q_a RMSNorm then the q_b GEMV (a Kimi TP8 rank's 1536 x 1536) at one row: the
    norm kernel and the GEMV (two launches) against the GEMV with the norm folded in."""
    from flashtree.layers import dense
    from flashtree.layers.norm import RMSNorm

    norm = RMSNorm(k, 1e-6).to("cuda", torch.bfloat16)
    weights = _copies(n, k, torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"n": n, "k": k,
           "two_launches_us": _us_per_copy(lambda x, w: dense(norm(x), w), x, weights, reps),
           "folded_us": _us_per_copy(lambda x, w: dense(x, w, norm=norm), x, weights, reps)}
    print(row, flush=True)
    return row


@torch.inference_mode()
def router_rows(reps: int) -> list[dict]:
    """`F.linear(x.float(), w)` (cuBLAS) against `gemv` (one row) and `gemv_rows` (more) for
    Kimi K2.6's float32 router (384 x 7168), microseconds."""
    from flashtree.layers.gemv import gemv, gemv_rows

    weights, rows = _copies(384, 7168, torch.float32), []
    for m in (1, 2, 4, 8, 9, 16, 32, 64):
        x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
        kernel = gemv if m == 1 else (lambda x, w: gemv_rows(x, w, rows_max=64))
        row = {"rows": m,
               "cublas_us": _us_per_copy(lambda x, w: F.linear(x.float(), w), x, weights, reps),
               "kernel_us": _us_per_copy(kernel, x, weights, reps)}
        row["kernel_tbps"] = 384 * 7168 * 4 / row["kernel_us"] / 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def gemv_report(res: dict) -> list[str]:
    """The markdown of the gemv and router sections present in `res`."""
    lines: list[str] = []
    if res.get("gemv"):
        names = [k for k in res["gemv"][0] if k not in ("shape", "n", "k")]
        lines += ["## Batch-1 GEMV, graph-replayed (us, weight TB/s; configs BLOCK_N x BLOCK_K "
                  "x warps x stages)", "", "| shape | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        lines += [f"| {r['shape']} ({r['n']}x{r['k']}) | " + " | ".join(
            f"{r[c]:.1f}, {r['n'] * r['k'] * 2 / r[c] / 1e6:.2f}" for c in names) + " |"
            for r in res["gemv"]]
    if res.get("norm_fold"):
        r = res["norm_fold"]
        lines += ["", f"RMSNorm then GEMV ({r['n']}x{r['k']}, MLA's q_a norm and q_b): "
                  f"{r['two_launches_us']:.1f} us in two launches, {r['folded_us']:.1f} us "
                  "folded into one.", ""]
    if res.get("router"):
        lines += ["", "## Float32 router (384 x 7168) against a verify's rows, graph-replayed",
                  "", "| rows | cuBLAS us | kernel us | kernel weight TB/s |", "|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['cublas_us']:.1f} | {r['kernel_us']:.1f} | "
                  f"{r['kernel_tbps']:.2f} |" for r in res["router"]]
    return lines
