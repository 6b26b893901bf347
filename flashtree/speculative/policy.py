"""When to speculate. The engine asks the policy once per decode step, before drafting
(`plan`: the draft budget, 0 for a plain step), and tells it the step's outcome after
(`observe`).

`FixedPolicy` verifies the full block or tree every step (the reference implementations'
behaviour). `AdaptivePolicy` speculates where it is measured to be faster: per size class of
batches (the batch sizes up to one power of two) it compares committed tokens per second of
speculative steps with those of plain steps, both timed whole on this machine, and backs off
exponentially (with probes) where speculation loses. A new size class starts from its
neighbours' verdicts: backed off above one where speculation lost, speculating below one where
it won (plain steps timed later).
Measurements behind the constants: docs/speculation.md."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

_TIMED_STEPS = 16  # recent step times per kind and size class; their median is the step's time
_MIN_TIMED = 4  # timed steps of each kind before a verdict
_ACCEPT_WINDOW = 64  # speculative steps the acceptance average spans (acceptance is noisy)
# Plain steps after a verdict against speculation: long enough that the probe after them costs
# at most _PROBE_SHARE of their time, doubling while speculation keeps losing, at most
# _MAX_BACKOFF.
_PROBE_SHARE = 1 / 32
_MAX_BACKOFF = 1024
_RETIME_EVERY = 64  # speculative steps between two plain steps that re-time plain decoding
_CLASSES = tuple(1 << i for i in range(13))  # the size classes a decision covers: 1 .. 4096


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

    def decisions(self) -> FollowedPolicy:
        """What this policy's next step plans at each size class, for other ranks to follow."""
        ...


@dataclass
class FixedPolicy:
    budget: int

    def plan(self, requests: int) -> int:
        return self.budget

    def observe(self, result: StepResult) -> None:
        pass

    def decisions(self) -> FollowedPolicy:
        return FollowedPolicy(self.budget, frozenset(_CLASSES))


@dataclass(frozen=True)
class FollowedPolicy:
    """Another policy's decisions for the next steps: its budget at the size classes in
    `speculating`, a plain step at the others. Step times differ between tensor-parallel ranks,
    so rank 0's policy decides for all: each step's command carries its `decisions()`, and the
    other ranks plan by them."""

    budget: int
    speculating: frozenset[int]

    def plan(self, requests: int) -> int:
        return self.budget if size_class_of(requests) in self.speculating else 0

    def observe(self, result: StepResult) -> None:
        pass

    def decisions(self) -> FollowedPolicy:
        return self


def size_class_of(requests: int) -> int:
    """The size class of a batch of `requests`, the power of two at or above it: batch sizes
    measured and judged together."""
    return 1 << (requests - 1).bit_length()


@dataclass
class _SizeClass:
    """What one size class of batches has measured, and its back-off."""

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
        self.size_classes: dict[int, _SizeClass] = {}
        self._last_speculative: bool | None = None

    def at(self, requests: int) -> _SizeClass:
        key = size_class_of(requests)
        if key not in self.size_classes:
            self.size_classes[key] = self._new_size_class(key)
        return self.size_classes[key]

    def _new_size_class(self, key: int) -> _SizeClass:
        """A size class not seen before. Speculation gains less as the batch grows, so above a
        class where it lost the new one starts backed off as that one is, and below a class
        where it won the new one starts speculating, instead of paying a first probe of its own
        (a batch that drains passes through every class below its own)."""
        below = [k for k in self.size_classes if k < key]
        if below:
            nearest = self.size_classes[max(below)]
            if nearest.backoff:
                return _SizeClass(plain_left=nearest.backoff, backoff=nearest.backoff)
        above = [k for k in self.size_classes if k > key]
        if above and self.size_classes[min(above)].speculation_loses() is False:
            return _SizeClass(plain_left=0)
        return _SizeClass()

    def decisions(self) -> FollowedPolicy:
        """What the next step plans at each size class (a new class as `at` would start it,
        without keeping it)."""
        return FollowedPolicy(self.budget, frozenset(
            k for k in _CLASSES if self.size_classes.get(k, self._new_size_class(k)).plain_left
            == 0))

    def plan(self, requests: int) -> int:
        size_class = self.at(requests)
        speculate = size_class.plain_left == 0
        if not speculate:
            size_class.plain_left = max(0, size_class.plain_left - 1)
        return self.budget if speculate else 0

    def observe(self, result: StepResult) -> None:
        size_class = self.at(result.requests)
        # The first step after a switch runs cold (caches, the drafter's catch-up): untimed.
        if result.speculative == self._last_speculative:
            times = size_class.spec_s if result.speculative else size_class.plain_s
            times.append(result.seconds)
        self._last_speculative = result.speculative
        if not result.speculative:
            return
        size_class.spec_steps += 1
        rate = 1 / min(size_class.spec_steps, _ACCEPT_WINDOW)
        size_class.accepted += rate * (result.committed / result.requests - size_class.accepted)
        size_class.since_plain += 1
        loses = size_class.speculation_loses()
        if loses:
            longer = max(2 * size_class.backoff, math.ceil(size_class.probe_steps() / _PROBE_SHARE))
            size_class.backoff = min(longer, _MAX_BACKOFF)
            size_class.plain_left = size_class.backoff
            size_class.spec_s.clear()  # the probe after the back-off times speculation afresh
            size_class.since_plain = 0
        elif size_class.since_plain >= _RETIME_EVERY:
            if loses is False:
                size_class.plain_left = 2  # one cold, one timed
                size_class.backoff = 0  # speculation held its own for a whole stretch
            else:  # a class that started speculating: time plain decoding for a verdict
                size_class.plain_left = 1 + _MIN_TIMED - len(size_class.plain_s)
            size_class.since_plain = 0
