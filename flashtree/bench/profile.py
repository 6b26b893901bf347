"""The benchmarks' one profiler: where the time of a repeated call (an engine step, a layer's
forward) goes. Per call: wall time (unprofiled), the GPU's busy time and share of the wall
(the union of its kernel and copy intervals), kernel time, device-to-host reads, launches and
host syncs (CUDA runtime calls), the top kernels (CPU ops off CUDA), the lines that wait for
the device, and the Python functions holding the host."""

from __future__ import annotations

import cProfile
import pstats
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashtree.bench.host_window import read_to_launch
from flashtree.bench.idle_gaps import SYNCS, busy_walk, idle_gaps
from flashtree.bench.timing import sync, wall_s

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")  # the runtime calls that launch device work
_READS = ("DtoH", "Device -> Pageable", "Device -> Pinned")
_PACKAGE = str(Path(__file__).resolve().parents[1]) + "/"  # this project's source files


def calls_made_at_most(calls: int, window: bool = False) -> int:
    """How many times `profile_calls(fn, device, calls, window=window)` calls `fn` at most
    (CUDA's sync-debug pass included): a caller that stops it with `done` (requests out of
    tokens) gives it this many calls' work, or a pass runs short."""
    return (5 if window else 3) * calls + min(calls, 3)


def profile_calls(fn: Callable[[], object], device: torch.device, calls: int = 8,
                  done: Callable[[], bool] = lambda: False, top: int = 12,
                  window: bool = False) -> dict:
    """Profile `calls` calls of `fn` (fewer once `done()`), four times over: timed bare, under
    torch.profiler, under cProfile and (CUDA) under the sync debug mode; with `window` (engine
    steps that read on the device path), twice more from each read to the next launch
    (`host_window.read_to_launch`): timed bare, then under cProfile."""
    total = [0]  # calls made in all

    def repeat(n: int) -> int:
        ran = 0
        while ran < n and not done():
            fn()
            ran += 1
        total[0] += ran
        return max(ran, 1)

    seconds, timed = wall_s(lambda: repeat(calls), device)
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        n = repeat(calls)
        sync(device)
    averages = prof.key_averages()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    own = _exclusive_us(gpu)
    busy = sum(us for _, us in own)
    wall_ms = seconds * 1e3 / timed
    out = {"calls": n, "wall_ms": wall_ms, "gpu_busy_ms": busy / 1e3 / n if cuda else None,
           "gpu_busy": busy / 1e3 / n / wall_ms if cuda else None,
           "device_reads": sum(any(r in e.name for r in _READS) for e in gpu) / n if cuda
           else None,
           "launches": sum(e.count for e in averages if e.key in LAUNCHES) / n,
           "syncs": sum(e.count for e in averages if e.key in SYNCS) / n,
           "top": _top(own, averages, n, top, cuda),
           "idle_gaps": idle_gaps(prof.events(), gpu, n)[:top] if cuda else []}
    out["sync_sites"] = _sync_sites(repeat, calls) if cuda else {}
    out["host_functions"] = _host_functions(repeat, calls, top)
    if window:
        (out["window_ms"], out["window_functions"],
         out["window_ours"]) = _window_functions(repeat, calls, top, device)
    out["calls_made"] = total[0]
    return out


def _exclusive_us(gpu: list) -> list[tuple[str, float]]:
    """(name, microseconds) of each device event, counting only the time past every event
    that started before it: the events' union split among them. Under programmatic dependent
    launch a kernel starts while the one before runs and waits for it, so its own span would
    count its predecessor's time again."""
    return [(e.name, own) for e, own, _ in busy_walk(gpu)]


def _top(own: list[tuple[str, float]], averages, n: int, k: int, cuda: bool
         ) -> list[tuple[str, float, float]]:
    """(kernel, ms per call, launches per call), largest first: GPU kernels and copies on
    CUDA by their own time (`own`, from `_exclusive_us`), CPU ops by self time elsewhere."""
    table: dict[str, list[float]] = {}
    if cuda:
        for name, us in own:
            row = table.setdefault(name[:70], [0.0, 0])
            row[0] += us / 1e3
            row[1] += 1
    else:
        table = {e.key[:70]: [e.self_cpu_time_total / 1e3, e.count] for e in averages}
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:k]
    return [(name, ms / n, count / n) for name, (ms, count) in rows if ms > 0]


def _sync_sites(repeat: Callable[[int], int], calls: int) -> dict[str, float]:
    """Lines that wait for the device, with how often per call (CUDA's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n = repeat(min(calls, 3))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites: dict[str, float] = {}
    for w in caught:
        key = f"{short_path(w.filename)}:{w.lineno}"
        sites[key] = sites.get(key, 0) + 1 / n
    return sites


def _host_functions(repeat: Callable[[int], int], calls: int, k: int
                    ) -> list[tuple[str, float, float]]:
    """cProfile of the calls: the functions holding the host longest, as (function, own ms per
    call, ms per call with callees); waits for the device show as `tolist` or `item`."""
    prof = cProfile.Profile()
    prof.enable()
    n = repeat(calls)
    prof.disable()
    return _function_rows(prof, n, k)


def _window_functions(repeat: Callable[[int], int], calls: int, k: int, device: torch.device
                      ) -> tuple[float | None, list[tuple[str, float, float]],
                                 list[tuple[str, float, float]]]:
    """The host's time from a step's device read to the next launch (ms per window, timed
    without a profiler; None where no step read on the device path), and from cProfile within
    those windows in a second pass (ms per window): the functions of longest own time, and
    this project's functions by their time with callees (which phase of the step holds it)."""
    with read_to_launch(None, device) as timed:
        repeat(calls)
    prof = cProfile.Profile()
    with read_to_launch(prof, device) as profiled:
        repeat(calls)
    if not timed or not profiled:
        return None, [], []
    n = len(profiled)
    return (sum(timed) * 1e3 / len(timed), _function_rows(prof, n, k),
            _function_rows(prof, n, k, ours_with_callees=True))


def _function_rows(prof: cProfile.Profile, n: int, k: int, ours_with_callees: bool = False
                   ) -> list[tuple[str, float, float]]:
    """The `k` functions of longest own time (or, `ours_with_callees`, this project's of
    longest time with callees): (function, own ms, ms with callees) per `n`."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tt, ct, callers)
    rows = [(f"{short_path(f)}:{line}({name})", tt * 1e3 / n, ct * 1e3 / n)
            for (f, line, name), (_, _, tt, ct, _) in stats.items()
            if not ours_with_callees or f.startswith(_PACKAGE)]
    return sorted(rows, key=lambda r: -r[2 if ours_with_callees else 1])[:k]


def short_path(path: str) -> str:
    """A source path without the machine's folders."""
    return path.rpartition("flashtree/")[2] if "flashtree/" in path else Path(path).name


def profile_lines(name: str, p: dict) -> list[str]:
    """A profile as markdown: a summary line, the top kernels, the device reads by line and the
    host functions."""
    busy = "" if p["gpu_busy"] is None else (f", GPU busy {p['gpu_busy_ms']:.2f} ms "
                                             f"({p['gpu_busy']:.0%})")
    reads = "" if p["device_reads"] is None else f", {p['device_reads']:.1f} device reads"
    lines = [f"**{name}**: {p['wall_ms']:.2f} ms wall per call{busy}{reads}, "
             f"{p['launches']:.0f} launches, {p['syncs']:.1f} host syncs per call.", "",
             "| kernel (CPU op off CUDA) | own ms per call | launches per call |", "|---|---|---|"]
    lines += [f"| `{k}` | {ms:.3f} | {c:.1f} |" for k, ms, c in p["top"]]
    if p.get("idle_gaps"):
        lines += ["", "| device idle, ended by | ms per call | gaps per call |", "|---|---|---|"]
        lines += [f"| {k} | {ms:.3f} | {c:.1f} |" for k, ms, c in p["idle_gaps"]]
    lines += ["", "Device reads by line (per call): " + (", ".join(
        f"`{k}` {v:.1f}" for k, v in p["sync_sites"].items()) or "none"), "",
        "| host function (cProfile) | own ms per call | with callees |", "|---|---|---|"]
    lines += [f"| `{k}` | {own:.3f} | {cum:.3f} |" for k, own, cum in p["host_functions"]]
    if p.get("window_ms") is not None:
        lines += ["", f"From each device read to the next launch: {p['window_ms']:.2f} ms of "
                  "host work, timed bare (the table's times are under cProfile, which slows "
                  "the host).", "",
                  "| host function in that window | own ms per window | with callees |",
                  "|---|---|---|"]
        lines += [f"| `{k}` | {own:.3f} | {cum:.3f} |" for k, own, cum in p["window_functions"]]
        lines += ["", "| this project's functions in that window | ms with callees |", "|---|---|"]
        lines += [f"| `{k}` | {cum:.3f} |" for k, _, cum in p.get("window_ours", [])]
    return lines + [""]
