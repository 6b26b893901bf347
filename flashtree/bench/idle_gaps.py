"""Where the device waits within a profiled run: each gap between its busy intervals, named by
what ended it (the runtime call that launched the next device event, and the CPU op that
made that call), by whether that call was still to come when the device went idle (the
device waited for the host) or had been made before (work already queued: a graph's nodes,
where the profiler's own tracing also opens gaps), and by whether the host had been waiting
on a sync that returned in the gap (a device read: the gap is then the host's work after
it)."""

from __future__ import annotations

from collections.abc import Iterator

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def idle_gaps(events: list, device_events: list, calls: int, min_us: float = 1.0
              ) -> list[tuple[str, float, float]]:
    """(what ended the gaps, idle ms per call, gaps per call), longest first, from a profile's
    `events` (torch.profiler FunctionEvents: a device event shares its CUPTI correlation id
    with the runtime call that launched it, which links to the CPU op that made the call)
    and its `device_events`; gaps under `min_us` are not counted."""
    on_device = {id(e) for e in device_events}
    host = [e for e in events if id(e) not in on_device]
    # Runtime calls and CPU ops number their correlation ids apart: keep two maps.
    runtime = {e.id: e for e in host if e.name.startswith("cu")}
    ops = {e.id: e for e in host if not e.name.startswith("cu")}
    syncs = [e.time_range.end for e in host if e.name in SYNCS]
    table: dict[str, list[float]] = {}
    for e, _, gap in busy_walk(device_events):
        if gap >= min_us:
            idle_from = e.time_range.start - gap
            after_sync = any(idle_from < s <= e.time_range.start for s in syncs)
            row = table.setdefault(_cause(e, runtime, ops, idle_from, after_sync), [0.0, 0])
            row[0] += gap / 1e3
            row[1] += 1
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])
    return [(key, ms / calls, count / calls) for key, (ms, count) in rows]


def busy_walk(device_events: list) -> Iterator[tuple[object, float, float]]:
    """The device events in start order, each with its own time (microseconds past every
    event that started before it: the busy union split among them) and the idle gap before
    it (0 for the first)."""
    end = None
    for e in sorted(device_events, key=lambda e: e.time_range.start):
        a, b = e.time_range.start, e.time_range.end
        if end is None:
            yield e, b - a, 0.0
            end = b
            continue
        yield e, max(0.0, b - max(a, end)), max(0.0, a - end)
        end = max(end, b)


def _cause(device_event, runtime: dict, ops: dict, idle_from: float, after_sync: bool) -> str:
    call = runtime.get(device_event.id)
    if call is None:
        return "unknown launch" + (", after a sync" if after_sync else "")
    op = ops.get(getattr(call, "linked_correlation_id", None))  # newer torch only
    waited = call.time_range.end > idle_from  # the launch returned after the device went idle
    return (call.name + (f" ({op.name})" if op is not None else "")
            + (", waited for" if waited else ", queued before")
            + (", after a sync" if after_sync else ""))
