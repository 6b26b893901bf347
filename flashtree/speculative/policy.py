"""When to speculate. The engine asks the policy once per decode step, before drafting
(`plan`: the draft budget, 0 for a plain step), and tells it the step's outcome after
(`observe`).

`FixedPolicy` verifies the full block or tree every step (the reference implementations'
behaviour). `AdaptivePolicy` speculates where it is measured to be faster: per power-of-two
bucket of batch sizes it compares committed tokens per second of speculative steps with those
of plain steps, both timed whole on this machine, and backs off exponentially (with probes)
where speculation loses. A new bucket starts from its neighbours' verdicts: backed off above a
bucket where speculation lost, speculating below one where it won (plain steps timed later).
Measurements behind the constants: docs/speculation.md."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from flashtree.distributed import tp_broadcast_object, tp_group_active

_TIMED_STEPS = 16  # recent step times per kind and bucket; their median is the step's time
_MIN_TIMED = 4  # timed steps of each kind before a verdict
_ACCEPT_WINDOW = 64  # speculative steps the acceptance average spans (acceptance is noisy)
# Plain steps after a verdict against speculation: long enough that the probe after them costs
# at most _PROBE_SHARE of their time, doubling while speculation keeps losing, at most
# _MAX_BACKOFF.
_PROBE_SHARE = 1 / 32
_MAX_BACKOFF = 1024
_RETIME_EVERY = 64  # speculative steps between two plain steps that re-time plain decoding


@dataclass(frozen=True)
class StepResult:
    """A decode step as the policy sees it."""

    speculative: bool
    requests: int
    committed: int  # tokens the step committed over the batch
    seconds: float  # wall time of the whole step, scheduling included


class SpecPolicy(Protocol):
    def plan(self, requests: int) -> int:
        """Draft budget for a decode step of `requests` requests (0: decode plainly)."""
        ...

    def observe(self, result: StepResult) -> None: ...


@dataclass
class FixedPolicy:
    budget: int

    def plan(self, requests: int) -> int:
        return self.budget

    def observe(self, result: StepResult) -> None:
        pass


def batch_bucket(requests: int) -> int:
    """The power of two at or above `requests`: batch sizes measured and judged together."""
    return 1 << (requests - 1).bit_length()


@dataclass
class _Bucket:
    """What one bucket of batch sizes has measured, and its back-off."""

    plain_s: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMED_STEPS))
    spec_s: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMED_STEPS))
    accepted: float = 0.0  # moving average of tokens committed per request per speculative step
    spec_steps: int = 0  # speculative steps seen (the average's weight while young)
    plain_left: int = 1 + _MIN_TIMED  # plain steps to run before the next speculative one
    backoff: int = 0
    since_plain: int = 0  # speculative steps since the last plain one

    def probe_steps(self) -> float:
        """What a probe's speculative steps cost, in plain steps."""
        return (1 + _MIN_TIMED) * statistics.median(self.spec_s) / statistics.median(self.plain_s)

    def speculation_loses(self) -> bool | None:
        """Whether speculative steps commit fewer tokens per second than plain ones (None
        until both kinds have been timed often enough)."""
        if len(self.plain_s) < _MIN_TIMED or len(self.spec_s) < _MIN_TIMED:
            return None
        return self.accepted / statistics.median(self.spec_s) < 1 / statistics.median(
            self.plain_s)


class AdaptivePolicy:
    """Speculate (at `budget`) while measured speculative tokens/s beat plain tokens/s."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buckets: dict[int, _Bucket] = {}
        self._last_speculative: bool | None = None
        # Step times differ between tensor-parallel ranks: rank 0 decides for all of them.
        self._broadcast = tp_group_active()

    def at(self, requests: int) -> _Bucket:
        key = batch_bucket(requests)
        if key not in self.buckets:
            self.buckets[key] = self._new_bucket(key)
        return self.buckets[key]

    def _new_bucket(self, key: int) -> _Bucket:
        """A bucket not seen before. Speculation gains less as the batch grows, so above a
        bucket where it lost the new one starts backed off as that one is, and below a bucket
        where it won the new one starts speculating, instead of paying a first probe of its own
        (a batch that drains passes through every bucket below its own)."""
        below = [k for k in self.buckets if k < key]
        if below:
            nearest = self.buckets[max(below)]
            if nearest.backoff:
                return _Bucket(plain_left=nearest.backoff, backoff=nearest.backoff)
        above = [k for k in self.buckets if k > key]
        if above and self.buckets[min(above)].speculation_loses() is False:
            return _Bucket(plain_left=0)
        return _Bucket()

    def plan(self, requests: int) -> int:
        bucket = self.at(requests)
        speculate = bucket.plain_left == 0
        if self._broadcast:
            speculate = tp_broadcast_object(speculate, usual=True)
        if not speculate:
            bucket.plain_left = max(0, bucket.plain_left - 1)
        return self.budget if speculate else 0

    def observe(self, result: StepResult) -> None:
        bucket = self.at(result.requests)
        # The first step after a switch runs cold (caches, the drafter's catch-up): untimed.
        if result.speculative == self._last_speculative:
            times = bucket.spec_s if result.speculative else bucket.plain_s
            times.append(result.seconds)
        self._last_speculative = result.speculative
        if not result.speculative:
            return
        bucket.spec_steps += 1
        rate = 1 / min(bucket.spec_steps, _ACCEPT_WINDOW)
        bucket.accepted += rate * (result.committed / result.requests - bucket.accepted)
        bucket.since_plain += 1
        loses = bucket.speculation_loses()
        if loses:
            longer = max(2 * bucket.backoff, math.ceil(bucket.probe_steps() / _PROBE_SHARE))
            bucket.backoff = min(longer, _MAX_BACKOFF)
            bucket.plain_left = bucket.backoff
            bucket.spec_s.clear()  # the probe after the back-off times speculation afresh
            bucket.since_plain = 0
        elif bucket.since_plain >= _RETIME_EVERY:
            if loses is False:
                bucket.plain_left = 2  # one cold, one timed
                bucket.backoff = 0  # speculation held its own for a whole stretch
            else:  # a bucket that started speculating: time plain decoding for a verdict
                bucket.plain_left = 1 + _MIN_TIMED - len(bucket.plain_s)
            bucket.since_plain = 0
