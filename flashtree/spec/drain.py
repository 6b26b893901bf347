"""Whether speculation pays in a draining batch: one whose finished requests are not replaced
(nothing waits, and the batch shrank since it last grew), as at the end of a burst of load.

There, what counts is the time until the last request finishes, not tokens per step: plain
decoding's requests with equal tokens left all end at one step, while speculative requests
commit at different paces and end apart, and each step the stragglers still take costs
nearly a whole step (on a GPU a small model's step costs about the same at 1 request as at 8).
On an H200, 8 such requests that each committed 2.5 tokens per speculative step, at 2.2x a
plain step's time, took about 7% longer than plain decoding from 128 tokens left: the last
of them finished a fifth of the steps after the mean.

`DrainWatch.speculation_pays` compares the expected time until the last request ends, plain
against speculative, drawing each request's pace (steps per committed token) from the paces of
recent requests' speculative steps: the spread of those is what makes requests end apart."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

_PACE_MIN_STEPS = 8  # speculative steps of a request before its pace is a sample
_PACES = 64  # finished requests' paces kept
_MIN_PACES = 8  # samples before a drain is judged (before, speculation is not held off)
_DRAWS = 512  # paces drawn per verdict, over all scenarios (at least _MIN_SCENARIOS)
_MIN_SCENARIOS = 8
_KEPT_STEPS = 8  # decode steps a verdict is kept for while the batch size stays


def finish_seconds(finish_steps: list[float], step_s: Callable[[int], float]) -> float:
    """Seconds until the last request is done when request i is done after finish_steps[i]
    steps and a step of n running requests takes step_s(n) seconds."""
    seconds, done, n = 0.0, 0.0, len(finish_steps)
    for i, finish in enumerate(sorted(finish_steps)):
        seconds += (finish - done) * step_s(n - i)
        done = finish
    return seconds


def expected_finish_seconds(remaining: list[int], paces: list[float],
                            step_s: Callable[[int], float]) -> float:
    """The mean of finish_seconds over scenarios where request i needs remaining[i] x a pace
    drawn from `paces` steps. The draws are fixed (seeded by the batch size), so that a
    verdict does not flicker on draw noise; _DRAWS paces in all keep it cheap."""
    n = len(remaining)
    memo: dict[int, float] = {}

    def memo_step_s(k: int) -> float:
        if k not in memo:
            memo[k] = step_s(k)
        return memo[k]

    rng = random.Random(n)
    scenarios = max(_MIN_SCENARIOS, _DRAWS // n)
    return sum(finish_seconds([r * p for r, p in zip(remaining, rng.choices(paces, k=n))],
                              memo_step_s) for _ in range(scenarios)) / scenarios


@dataclass
class RequestPace:
    """A live request's speculative steps and the tokens they committed (accepted drafts +
    the bonus token, also for a probe's steps, which keep only the bonus)."""

    steps: int = 0
    tokens: int = 0


@dataclass
class DrainWatch:
    """Whether the batch drains, the paces requests speculate at, and the last verdict."""

    paces: deque[float] = field(default_factory=lambda: deque(maxlen=_PACES))  # finished ones'
    live: dict[int, RequestPace] = field(default_factory=dict)
    draining: bool = False
    last_batch: int = 0
    _verdict: bool = True
    _verdict_batch: int = 0  # the batch size the verdict is for (0: none)
    _verdict_steps_left: int = 0

    def note_batch(self, requests: int, others_wait: bool) -> None:
        """A decode step of `requests`; `others_wait`: admitted requests are waiting for
        room, so any that finishes is replaced."""
        self._verdict_steps_left = max(0, self._verdict_steps_left - 1)
        if others_wait or requests > self.last_batch:
            self.draining = False
        elif requests < self.last_batch and not self.draining:
            self.draining = True
            self._verdict_steps_left = 0  # a new drain: no verdict of an earlier one holds
        self.last_batch = requests

    def count(self, seq_id: int, committed: int) -> None:
        """One speculative step of a request that committed (or would have) `committed`
        tokens."""
        pace = self.live.get(seq_id)
        if pace is None:
            pace = self.live[seq_id] = RequestPace()
        pace.steps += 1
        pace.tokens += committed

    def forget(self, live: set[int]) -> None:
        """Requests that are gone: their paces become samples."""
        for seq_id in [s for s in self.live if s not in live]:
            pace = self.live.pop(seq_id)
            if pace.steps >= _PACE_MIN_STEPS:
                self.paces.append(pace.steps / pace.tokens)

    def samples(self) -> list[float]:
        """Steps per committed token of recent requests, finished and live."""
        return [*self.paces, *(p.steps / p.tokens for p in self.live.values()
                               if p.steps >= _PACE_MIN_STEPS)]

    def speculation_pays(self, remaining: list[int], spec_s: Callable[[int], float],
                         plain_s: Callable[[int], float]) -> bool:
        """Whether speculating until the draining batch ends is expected to end it sooner
        than decoding plain; remaining[i]: tokens request i may still generate; spec_s(n),
        plain_s(n): seconds of a step of n requests. True with one request (nothing ends
        apart) or too few paces measured. A verdict is kept for _KEPT_STEPS decode steps
        (`note_batch` counts them) while the batch size stays."""
        n = len(remaining)
        if n == self._verdict_batch and self._verdict_steps_left > 0:
            return self._verdict
        paces = self.samples()
        if n < 2 or len(paces) < _MIN_PACES:
            return True
        spec = expected_finish_seconds(remaining, paces, spec_s)
        self._verdict = spec <= finish_seconds([float(r) for r in remaining], plain_s)
        self._verdict_batch, self._verdict_steps_left = n, _KEPT_STEPS
        return self._verdict
