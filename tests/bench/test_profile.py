"""The profiler's device-time attribution, on recorded event intervals (no GPU needed)."""

from __future__ import annotations

import cProfile
from types import SimpleNamespace

import torch

from flashtree.bench.idle_gaps import idle_gaps
from flashtree.bench.profile import _exclusive_us, _function_rows, _top
from flashtree.transfer import lists_to_device


def event(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_a_kernel_launched_early_counts_only_its_time_past_the_one_before():
    """Under programmatic dependent launch `norm` starts 2 us into `gemv` and waits for it:
    its span is 13 us, its own time 5. Per-kernel times add up to the busy union."""
    gemv, norm, add = event("gemv", 0, 10), event("norm", 2, 15), event("add", 15, 16)
    gap = event("gemv", 20, 30)  # the next call's, after the device went idle
    assert _exclusive_us([norm, add, gemv, gap]) == [
        ("gemv", 10), ("norm", 5), ("add", 1), ("gemv", 10)]
    top = _top(_exclusive_us([gemv, norm, add, gap]), None, n=2, k=5, cuda=True)
    assert top == [("gemv", 0.01, 1.0), ("norm", 0.0025, 0.5), ("add", 0.0005, 0.5)]


def test_a_kernel_wholly_inside_another_counts_nothing():
    """A copy on another stream that runs entirely inside a kernel adds no device time."""
    assert _exclusive_us([event("kernel", 0, 10), event("copy", 3, 4)]) == [
        ("kernel", 10), ("copy", 0)]


def traced(name: str, start: float, end: float, ident: int, linked: int = 0) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           id=ident, linked_correlation_id=linked)


def test_idle_gaps_are_named_by_the_launch_that_ended_them_and_a_read_before_it():
    """A step: a graph runs 0-100 us and its read returns at 101; the host launches an input
    copy at 130 (device 140-141) and the next graph at 150 (device 160-260, then a node at
    270-280: a gap inside work queued before it). A kernel launched during the first graph
    adds no gap. Ids: runtime calls share CUPTI ids with their device
    events (7, 8, 9, 10); the copy's runtime call links to its CPU op (id 7, as a runtime id
    does: the two number apart)."""
    graph, kernel = traced("graph kernel", 0, 100, 7), traced("kernel", 50, 60, 8)
    copy, graph2 = traced("Memcpy HtoD", 140, 141, 9), traced("graph kernel", 160, 260, 10)
    node = traced("graph kernel", 270, 280, 10)  # the same graph's next node, 10 us later
    device = [graph, kernel, copy, graph2, node]
    host = [traced("cudaGraphLaunch", -5, -1, 7), traced("cudaLaunchKernel", 10, 12, 8),
            traced("cudaEventSynchronize", 20, 101, 11),
            traced("aten::copy_", 128, 133, 7), traced("cudaMemcpyAsync", 130, 132, 9, 7),
            traced("cudaGraphLaunch", 150, 155, 10)]
    assert idle_gaps(host + device, device, calls=1) == [
        ("cudaMemcpyAsync (aten::copy_), waited for, after a sync", 0.040, 1.0),
        ("cudaGraphLaunch, waited for", 0.019, 1.0),
        ("cudaGraphLaunch, queued before", 0.010, 1.0)]
    assert idle_gaps(host + device, device, calls=1, min_us=15) == [
        ("cudaMemcpyAsync (aten::copy_), waited for, after a sync", 0.040, 1.0),
        ("cudaGraphLaunch, waited for", 0.019, 1.0)]


def test_the_windows_own_functions_are_this_projects_by_time_with_callees():
    """`ours_with_callees` lists the package's functions alone (not this test's, nor built-ins),
    largest time with callees first."""
    def busy() -> None:  # this file's: a caller of the package and of built-ins
        sorted(range(200_000), key=lambda v: -v)
        lists_to_device([[1, 2, 3], [4]], torch.device("cpu"))

    prof = cProfile.Profile()
    prof.enable()
    busy()
    prof.disable()
    everything = _function_rows(prof, 1, 100)
    ours = _function_rows(prof, 1, 100, ours_with_callees=True)
    assert any(name.startswith("~") for name, _, _ in everything)  # built-ins were profiled
    assert ours and all(name.startswith("transfer.py:") for name, _, _ in ours)
    assert [cum for _, _, cum in ours] == sorted((cum for _, _, cum in ours), reverse=True)
