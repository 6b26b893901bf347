"""The profiler's device-time attribution, on recorded event intervals (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

from flashtree.bench.profile import _exclusive_us, _top


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
