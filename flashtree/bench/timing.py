"""Timing for the benchmarks: median milliseconds by CUDA events (wall clock off CUDA), kernels
replayed from a CUDA graph, and one engine step timed exactly as serving runs it: the batch
built for scratch requests holding KV pages, run through the engine's own runner, which replays
its captured graph (`flashtree/graphs/runner.py`); `step_ms` raises when a timed call of an
engine that captures graphs ran eagerly instead."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

import torch

from flashtree.graphs.runner import GraphRunner, capture_graph
from flashtree.llm import LLM
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.sampling import SamplingParams
from flashtree.speculative.proposer import ContextRows
from flashtree.speculative.tree import ancestor_mask

# Scratch request ids count down from here (real ids count up from 0).
_SCRATCH_IDS = itertools.count(-2_000_000, -1)


class EagerFallback(RuntimeError):
    """A timed step that should have replayed a CUDA graph ran eagerly."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3
              ) -> float:
    """Median milliseconds of `fn()` over `reps` calls after `warmup`, each started on an idle
    device (host work inside `fn` counts): CUDA events on CUDA, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `fn` (reading and writing only fixed tensors) captured in a CUDA graph and
    replayed: the device time without launch overhead."""
    device = torch.device("cuda", torch.cuda.current_device())
    graph, _ = capture_graph(fn, device)
    return median_ms(graph.replay, device, reps)


def wall_s(fn: Callable[[], object], device: torch.device | None = None) -> tuple[float, object]:
    """(seconds, result) of one call of `fn` between device synchronizations."""
    if device is not None:
        sync(device)
    start = time.perf_counter()
    result = fn()
    if device is not None:
        sync(device)
    return time.perf_counter() - start, result


def captures_graphs(llm: LLM) -> bool:
    """Whether `llm`'s engine captured CUDA graphs of its forwards (off CUDA, or eager: no)."""
    graphs = llm.engine.runner.graphs
    return graphs is not None and graphs.use_cuda_graphs


def embedded_tokens(llm: LLM) -> int:
    """How many token ids, from 0, this process embeds: the whole vocabulary, or under a rank
    share its slice (rank 0's, from id 0). Ids past it embed to zero on a group of one, which
    makes every router tie, so scratch inputs draw from this range."""
    return llm.engine.runner.model.embed_tokens.vocab_end


def _runner_and_graphs(llm: LLM, drafter: bool) -> tuple[object, GraphRunner | None]:
    """The target's runner (or the drafter's) and its CUDA graphs, if any."""
    runner = llm.engine.proposer.runner if drafter else llm.engine.runner
    return runner, runner.graphs


def step_ms(llm: LLM, fn: Callable[[], object], reps: int, drafter: bool = False,
            warmup: int = 3) -> float:
    """Median ms of `fn`, one forward through `llm`'s target runner (or the drafter's runner,
    with `drafter`). When the engine captured CUDA graphs, every call must replay one, as it does
    in serving: raises EagerFallback otherwise."""
    runner, graphs = _runner_and_graphs(llm, drafter)
    before = 0 if graphs is None else graphs.replays
    ms = median_ms(fn, llm.engine.runner.device, reps, warmup)
    replayed = 0 if graphs is None else graphs.replays - before
    if captures_graphs(llm) and replayed < reps + warmup:
        raise EagerFallback(f"{replayed} graph replays in {reps + warmup} timed calls of the "
                            f"{'drafter' if drafter else 'target'}: the step ran eagerly "
                            "(no captured graph holds it)")
    return ms


def replay_ms(llm: LLM, fn: Callable[[], object], reps: int, drafter: bool = False
              ) -> float | None:
    """Median ms of replaying alone the one CUDA graph that a call of `fn` replays (the
    device's time of the step, without the host's work around it, which varies between runs
    more than a kernel change moves it); None without graphs or when `fn` replays several."""
    runner, graphs = _runner_and_graphs(llm, drafter)
    if graphs is None or not captures_graphs(llm):
        return None
    before = graphs.replays
    fn()
    if graphs.replays - before != 1:
        return None
    return median_ms(graphs.last_graph.replay, runner.device, reps)


class Scratch:
    """Scratch requests holding KV pages of an engine while a measurement runs."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.pages, self.ids = llm, llm.engine.pages, []

    def take(self, count: int, committed: int, extra: int) -> list[int]:
        """`count` requests with `committed` tokens of (scratch) KV and room for `extra` more.
        Where the pool runs out (OutOfPages), the pages taken so far still go back on exit."""
        ids = [next(_SCRATCH_IDS) for _ in range(count)]
        for sid in ids:
            self.ids.append(sid)
            self.pages.reserve(sid, committed)
            self.pages.set_length(sid, committed)  # (frees pages past `committed`)
            self.pages.reserve(sid, committed + extra)
        return ids

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc) -> None:
        for sid in self.ids:
            self.pages.free(sid)

    def decode(self, batch: int, ctx: int) -> Callable[[], object]:
        """One DECODE forward of `batch` requests after `ctx` tokens, each on its own random
        token (a MoE batch then routes to as many experts as a real one)."""
        gen, vocab = random.Random(batch), embedded_tokens(self.llm)
        items = [BatchItem(sid, ctx, [gen.randrange(vocab - 1)])
                 for sid in self.take(batch, ctx, 1)]
        return lambda: self.llm.engine.runner.forward(Mode.DECODE, items)

    def verify(self, tokens: int, ctx: int, tree: bool) -> Callable[[], object]:
        """One VERIFY forward at batch 1 after `ctx` tokens, every logit scored: a random tree
        of `tokens` nodes (depth < 16, as a block-16 DDTree's) or a chain."""
        rng, vocab = random.Random(tokens), embedded_tokens(self.llm)
        sid, tree_kw = self.take(1, ctx, tokens)[0], {}
        if tree:
            parent, depth = random_tree(tokens, rng)
            tree_kw = dict(positions=[ctx + d for d in depth],
                           visible=ancestor_mask(torch.tensor([parent]))[0].to(self.llm.device))
        item = BatchItem(sid, ctx, [rng.randrange(vocab - 1) for _ in range(tokens)],
                         all_logits=True, **tree_kw)
        return lambda: self.llm.engine.runner.forward(Mode.VERIFY, [item])

    def draft(self, ctx: int) -> tuple[Callable[[], object], Callable[[], object]]:
        """(one draft block at batch 1 after `ctx` tokens of random context features, the
        injection of one block of context rows) through the engine's drafter."""
        prop, dev = self.llm.engine.proposer, self.llm.device
        block = prop.block_size
        sid = self.take(1, ctx, block)[0]
        gen = torch.Generator(dev).manual_seed(0)
        feats = torch.randn(ctx, prop.draft.fc.in_features, generator=gen, device=dev)
        prop.inject([ContextRows(feats.to(self.llm.dtype), ((sid, 0, ctx),))])
        rows = [ContextRows(feats[-block:].to(self.llm.dtype), ((sid, ctx - block, block),))]
        return lambda: prop.draft_logits([(sid, ctx, 7, block)]), lambda: prop.inject(rows)


def random_tree(n: int, rng: random.Random, max_depth: int = 15) -> tuple[list[int], list[int]]:
    """A random rooted tree of n nodes in topological order: (parent, depth), root 0 -> 0."""
    parent, depth = [0], [0]
    for i in range(1, n):
        p = rng.choice([j for j in range(i) if depth[j] < max_depth])
        parent.append(p)
        depth.append(depth[p] + 1)
    return parent, depth


def engine_step_ms(llm: LLM, batch: int, ctx: int, steps: int) -> tuple[float, float]:
    """(median wall ms of one `engine.step()`, mean tokens committed per request per step) with
    `batch` greedy requests of `ctx` random prompt tokens, after their prefill; host work,
    scheduling and (under tensor parallelism) the broadcast included."""
    eng, vocab = llm.engine, embedded_tokens(llm)
    gen = torch.Generator().manual_seed(batch)
    sp = SamplingParams(temperature=0, max_tokens=steps * 20 + 50, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(0, vocab - 1, (ctx,), generator=gen).tolist(), sp)
            for _ in range(batch)]
    while not all(s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    produced, times = sum(len(s.output_ids) for s in seqs), []
    for _ in range(steps):
        times.append(wall_s(eng.step, llm.device)[0] * 1e3)
    produced = sum(len(s.output_ids) for s in seqs) - produced
    for s in seqs:
        eng.abort(s)
    return sorted(times)[len(times) // 2], produced / (steps * batch)
