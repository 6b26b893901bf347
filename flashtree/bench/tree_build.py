"""The DDTree build timed as the engine runs it, replayed through `RowGraphs` per bucket of rows:
the torch build (`tree.tree_nodes`, about a hundred small kernels) and, on CUDA, the
one-launch kernel (`speculative/tree_kernel.py`) replayed alike and launched directly, on the
same drafts (float32 logits of Qwen3's vocabulary, 15 depths, the top 16), with the share of
rows where both build the same trees (float32 path keys tie in a few rows; there either tree is
right)."""

from __future__ import annotations

from functools import partial

import torch

from flashtree.bench.timing import median_ms
from flashtree.graphs.rows import RowGraphs
from flashtree.speculative.tree import topk_logprobs, tree_nodes

VOCAB, DEPTH, TOPK = 151936, 15, 16


def tree_build_times(device: torch.device, rows_list: list[int], budgets: list[int], reps: int,
                     vocab: int = VOCAB) -> list[dict]:
    """Per (rows, budget): ms of the torch build replayed, and on CUDA of the kernel replayed
    and launched directly, with the share of rows whose trees are equal."""
    graphs = device.type == "cuda"
    if graphs:
        from flashtree.speculative.tree_kernel import build_trees_in_one_launch  # needs triton
    out = []
    for rows in rows_list:
        gen = torch.Generator(device).manual_seed(rows)
        logits = torch.randn(rows, DEPTH, vocab, device=device, generator=gen) * 3
        drafts = (*topk_logprobs(logits, min(TOPK, vocab)),
                  torch.zeros(rows, dtype=torch.long, device=device))
        for budget in budgets:
            builds = {"torch": RowGraphs(tree_nodes, [rows], device, graphs)}
            if graphs:
                builds["kernel"] = RowGraphs(build_trees_in_one_launch, [rows], device, graphs)
            row = {"rows": rows, "budget": budget}
            for name, build in builds.items():
                row[f"{name}_ms"] = median_ms(partial(build, *drafts, budget=budget), device,
                                              reps)
            if graphs:
                row["kernel_direct_ms"] = median_ms(
                    partial(build_trees_in_one_launch, *drafts, budget=budget), device, reps)
                (a, va), (b, vb) = (build(*drafts, budget=budget) for build in builds.values())
                same = (a == b).flatten(1).all(1) & (va == vb).flatten(1).all(1)
                row["rows_equal"] = same.float().mean().item()
            out.append(row)
    return out


def tree_build_report(rows: list[dict]) -> list[str]:
    lines = ["## The DDTree build (15 depths, top 16, Qwen3's vocabulary; ms, graph-replayed "
             "unless direct)", "", "| rows | budget | torch build | kernel | kernel direct | "
             "rows equal |", "|---|---|---|---|---|---|"]
    for r in rows:
        kernel = (f"{r['kernel_ms']:.3f} | {r['kernel_direct_ms']:.3f} | {r['rows_equal']:.2f}"
                  if "kernel_ms" in r else "- | - | -")
        lines.append(f"| {r['rows']} | {r['budget']} | {r['torch_ms']:.3f} | {kernel} |")
    return lines + [""]
