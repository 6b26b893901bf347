"""Where the device waits within a profiled run: each gap between its busy intervals, named by
what ended it (the runtime call that launched the next device event, and the CPU op that
made that call), by whether that call was still to come when the device went idle (the
device waited for the host) or had been made before (work already queued: a graph's nodes,
where the profiler's own tracing also opens gaps), and by whether the host had been waiting
on a sync that returned in the gap (a device read: the gap is then the host's work after
it)."""

from __future__ import annotations

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
    end = None
    for e in sorted(device_events, key=lambda e: e.time_range.start):
        start = e.time_range.start
        if end is not None and start - end >= min_us:
            after_sync = any(end < s <= start for s in syncs)
            row = table.setdefault(_cause(e, runtime, ops, end, after_sync), [0.0, 0])
            row[0] += (start - end) / 1e3
            row[1] += 1
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])
    return [(key, ms / calls, count / calls) for key, (ms, count) in rows]


def _cause(device_event, runtime: dict, ops: dict, idle_from: float, after_sync: bool) -> str:
    call = runtime.get(device_event.id)
    if call is None:
        return "unknown launch" + (", after a sync" if after_sync else "")
    op = ops.get(getattr(call, "linked_correlation_id", None))  # newer torch only
    waited = call.time_range.end > idle_from  # the launch returned after the device went idle
    return (call.name + (f" ({op.name})" if op is not None else "")
            + (", waited for" if waited else ", queued before")
            + (", after a sync" if after_sync else ""))
