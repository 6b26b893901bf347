"""When to speculate, and how much. The engine asks the policy once per decode step, before
drafting (`plan`: the draft budget, 0 for a plain step), and tells it the step's outcome after
(`observe`).

`FixedPolicy` verifies the full block or tree every step (the reference implementations'
behaviour). `AdaptivePolicy` speculates where it is measured to be faster: per size class of
batches (the batch sizes up to one power of two) it picks the draft budget (a DDTree engine's
`SpecConfig.budgets`) that commits the most tokens per second, and compares that with plain
steps, all timed whole on this machine; it backs off exponentially (with probes) where
speculation loses. A step at a DDTree budget also tells what every smaller budget's tree would
have committed (those trees are subtrees of its tree), so acceptance is known for the budgets
below the one run; each budget is timed where it runs. A new size class starts from its
neighbours' verdicts: backed off above one where speculation lost, speculating below one where
it won (plain steps timed later).
Measurements behind the constants: docs/speculation.md."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
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

    budget: int  # the step's draft budget (0: a plain step)
    requests: int
    committed: int  # tokens the step committed over the batch
    seconds: float  # wall time of the whole step, scheduling included
    # Tokens the batch would have committed at each budget up to the step's own (that one
    # included), where the step can tell (best-first trees); None: its own only.
    committed_at: Mapping[int, int] | None = None

    @property
    def speculative(self) -> bool:
        return self.budget > 0


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
        return FollowedPolicy({k: self.budget for k in _CLASSES})


@dataclass(frozen=True)
class FollowedPolicy:
    """Another policy's decisions for the next steps: the budget at each size class (absent:
    a plain step). Step times differ between tensor-parallel ranks, so rank 0's policy decides
    for all: each step's command carries its `decisions()`, and the other ranks plan by
    them."""

    budgets: Mapping[int, int]

    def plan(self, requests: int) -> int:
        return self.budgets.get(size_class_of(requests), 0)

    def observe(self, result: StepResult) -> None:
        pass

    def decisions(self) -> FollowedPolicy:
        return self


def size_class_of(requests: int) -> int:
    """The size class of a batch of `requests`, the power of two at or above it: batch sizes
    measured and judged together."""
    return 1 << (requests - 1).bit_length()


@dataclass
class _Budget:
    """What one draft budget has measured within a size class."""

    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMED_STEPS))
    accepted: float = 0.0  # moving average of tokens committed per request per step
    steps: int = 0  # steps that told its acceptance (the average's weight while young)

    def observe_accepted(self, per_request: float) -> None:
        self.steps += 1
        self.accepted += (per_request - self.accepted) / min(self.steps, _ACCEPT_WINDOW)

    def timed(self) -> bool:
        return len(self.seconds) >= _MIN_TIMED

    def tokens_per_second(self, accepted: float) -> float:
        return accepted / statistics.median(self.seconds)


@dataclass
class _SizeClass:
    """What one size class of batches has measured, and its back-off. Its budgets climb the
    ladder (largest first) from `start`: the best timed budget's untimed neighbours are timed
    next, the smaller first, so a budget two rungs below one that lost to its neighbour is
    never tried (tokens per second rise, then fall, along the ladder)."""

    budgets: dict[int, _Budget]  # the ladder, largest first
    start: int  # the budget run before any is timed
    plain_s: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMED_STEPS))
    plain_left: int = 1 + _MIN_TIMED  # plain steps to run before the next speculative one
    backoff: int = 0
    since_plain: int = 0  # speculative steps since the last plain one
    stretches: int = 0  # speculative stretches that held their own (each ends in a re-time)
    retime: list[int] = field(default_factory=list)  # budgets to time once more, next steps
    # (best, the budget to run, speculation_loses) until the next observation: decisions()
    # asks every step.
    _verdict: tuple[int, int, bool | None] | None = None

    def observed(self) -> None:
        """Its measurements changed."""
        self._verdict = None

    def best(self) -> int:
        """The timed budget that commits the most tokens per second (`start` until one is)."""
        return self._judged()[0]

    def speculation_loses(self) -> bool | None:
        """Whether the best budget's steps commit fewer tokens per second than plain ones
        (None until plain steps, the best budget and its neighbours are timed)."""
        return self._judged()[2]

    def neighbours(self, budget: int) -> list[int]:
        """The budgets beside `budget` on the ladder, the smaller first."""
        ladder = list(self.budgets)
        i = ladder.index(budget)
        return [ladder[j] for j in (i + 1, i - 1) if 0 <= j < len(ladder)]

    def accepted(self) -> dict[int, float]:
        """Each budget's tokens committed per request per step: its average, or a smaller
        budget's where that is higher (a larger tree holds the smaller one's, so it accepts at
        least as much; a budget run a few times only can read low by chance)."""
        out, floor = {}, 0.0
        for b in reversed(self.budgets):  # smallest first
            m = self.budgets[b]
            floor = max(floor, m.accepted) if m.steps else floor
            out[b] = floor
        return out

    def _judged(self) -> tuple[int, int, bool | None]:
        if self._verdict is None:
            accepted = self.accepted()
            rate = {b: m.tokens_per_second(accepted[b]) for b, m in self.budgets.items()
                    if m.timed()}
            best = max(rate, key=rate.__getitem__, default=None)
            if best is None:
                self._verdict = self.start, self.start, None
            elif untimed := [b for b in self.neighbours(best) if not self.budgets[b].timed()]:
                self._verdict = best, untimed[0], None
            else:
                loses = None if len(self.plain_s) < _MIN_TIMED else (
                    rate[best] < 1 / statistics.median(self.plain_s))
                self._verdict = best, best, loses
        return self._verdict

    def next_budget(self) -> int:
        """The next step's budget (0: plain)."""
        if self.retime:
            return self.retime[0]
        return 0 if self.plain_left > 0 else self._judged()[1]

    def to_retime(self) -> list[int]:
        """The best budget's neighbours due a timed step at the end of this stretch: one that
        costs k times the best budget's step is due every k-th stretch, so each re-time costs
        about one step of the best budget."""
        best = self.best()
        ratio = {b: statistics.median(self.budgets[b].seconds)
                 / statistics.median(self.budgets[best].seconds) for b in self.neighbours(best)}
        return [b for b, k in ratio.items() if self.stretches % max(1, round(k)) == 0]

    def probe_steps(self) -> float:
        """What a probe's speculative steps cost, in plain steps."""
        spec_s = self.budgets[self.best()].seconds
        return (1 + _MIN_TIMED) * statistics.median(spec_s) / statistics.median(self.plain_s)


class AdaptivePolicy:
    """Speculate (at the fastest of `budgets`) while measured speculative tokens/s beat plain
    tokens/s."""

    def __init__(self, budgets: int | Sequence[int]) -> None:
        self.budgets = (budgets,) if isinstance(budgets, int) else tuple(sorted(budgets)[::-1])
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
        (a batch that drains passes through every class below its own). Its budgets climb from
        the nearest class's best (the largest budget for the first class)."""
        backoff, speculating, start = self._start_of(key)
        fresh = _SizeClass({b: _Budget() for b in self.budgets}, start)
        fresh.plain_left = 0 if speculating else (backoff or fresh.plain_left)
        fresh.backoff = backoff
        return fresh

    def _start_of(self, key: int) -> tuple[int, bool, int]:
        """A new size class's back-off, whether it speculates at once and its starting budget
        (`_new_size_class`)."""
        below = [k for k in self.size_classes if k < key]
        above = [k for k in self.size_classes if k > key]
        nearest = min(below + above, key=lambda k: abs(math.log2(k / key)), default=None)
        start = self.budgets[0] if nearest is None else self.size_classes[nearest].best()
        if below and (backoff := self.size_classes[max(below)].backoff):
            return backoff, False, start
        speculating = bool(above) and self.size_classes[min(above)].speculation_loses() is False
        return 0, speculating, start

    def decisions(self) -> FollowedPolicy:
        """What the next step plans at each size class (a new class as `at` would start it)."""
        planned = {}
        for k in _CLASSES:
            if (c := self.size_classes.get(k)) is not None:
                planned[k] = c.next_budget()
            else:
                _, speculating, start = self._start_of(k)
                planned[k] = start if speculating else 0
        return FollowedPolicy({k: b for k, b in planned.items() if b})

    def plan(self, requests: int) -> int:
        size_class = self.at(requests)
        budget = size_class.next_budget()
        if size_class.retime:
            size_class.retime.pop(0)
        elif budget == 0:
            size_class.plain_left -= 1
        return budget

    def observe(self, result: StepResult) -> None:
        size_class = self.at(result.requests)
        size_class.observed()
        # The first step after a switch runs cold (caches, the drafter's catch-up): untimed.
        if result.speculative == self._last_speculative:
            times = (size_class.budgets[result.budget].seconds if result.speculative
                     else size_class.plain_s)
            times.append(result.seconds)
        self._last_speculative = result.speculative
        if not result.speculative:
            return
        committed_at = result.committed_at or {result.budget: result.committed}
        for budget, committed in committed_at.items():
            if budget in size_class.budgets:
                size_class.budgets[budget].observe_accepted(committed / result.requests)
        size_class.since_plain += 1
        loses = size_class.speculation_loses()
        if loses:
            longer = max(2 * size_class.backoff, math.ceil(size_class.probe_steps() / _PROBE_SHARE))
            size_class.backoff = min(longer, _MAX_BACKOFF)
            size_class.plain_left = size_class.backoff
            # The probe after the back-off times the best budget afresh.
            size_class.budgets[size_class.best()].seconds.clear()
            size_class.observed()
            size_class.since_plain = 0
        elif size_class.since_plain >= _RETIME_EVERY:
            if loses is False:
                size_class.plain_left = 2  # one cold, one timed
                size_class.backoff = 0  # speculation held its own for a whole stretch
                # The best budget's neighbours are timed once more, before the plain steps
                # (whose first speculative step after runs cold).
                size_class.stretches += 1
                size_class.retime = size_class.to_retime()
            else:  # a class that started speculating: time plain decoding for a verdict
                size_class.plain_left = max(0, 1 + _MIN_TIMED - len(size_class.plain_s))
            size_class.since_plain = 0
