"""The cost model of the target and drafter forwards, and the budget choice that it and the
expected accepted drafts make: per request (`choose_budgets`) or one for the whole step
(`choose_one_budget`), from a fixed ladder of budgets (`budget_levels`) so that step shapes stay
in the set that CUDA graphs capture. `flashtree.spec.policy` decides when to draft and feeds
these the calibrated gains."""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field


def budget_levels(max_budget: int) -> tuple[int, ...]:
    """0, 1, 2, 4, ... below `max_budget`, then `max_budget` itself."""
    levels, b = [0], 1
    while b < max_budget:
        levels.append(b)
        b *= 2
    return (*levels, max_budget)


@dataclass(frozen=True)
class CostModel:
    """Seconds of one forward as a function of its size, linear between measured points and
    beyond the last one along the last segment's slope."""

    target: tuple[tuple[int, float], ...]  # (tokens in the target forward, seconds), ascending
    draft: tuple[tuple[int, float], ...]  # (requests drafting one block each, seconds)
    # Values already interpolated, by size: the policy asks for the same few sizes every step,
    # between two forwards (the device idles while the host works out the next step).
    _target_memo: dict[int, float] = field(default_factory=dict, init=False, compare=False,
                                           repr=False)
    _draft_memo: dict[int, float] = field(default_factory=dict, init=False, compare=False,
                                          repr=False)

    def target_s(self, tokens: int) -> float:
        return _memoized(self._target_memo, self.target, tokens)

    def draft_s(self, requests: int) -> float:
        return _memoized(self._draft_memo, self.draft, requests) if requests else 0.0


def _memoized(memo: dict[int, float], points: tuple[tuple[int, float], ...], x: int) -> float:
    """_interpolate(points, x), computed once per x."""
    seconds = memo.get(x)
    if seconds is None:
        seconds = memo[x] = _interpolate(points, x)
    return seconds


def _interpolate(points: tuple[tuple[int, float], ...], x: int) -> float:
    assert points, "a cost curve needs at least one measured point"
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    if len(points) == 1:
        return points[0][1] * max(x, 1) / max(points[0][0], 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def choose_budgets(
    gains: list[list[float]], levels: tuple[int, ...], cost: CostModel, draft_s: float
) -> tuple[list[int], float]:
    """Per request, an index into `levels`, maximising
    (N + sum_r gains[r][j_r]) / (draft_s + T(N + sum_r levels[j_r])) for N requests whose
    expected accepted drafts at level j are gains[r][j] (gains[r][0] == 0, budget 0), with at
    least one draft verified (whether to draft at all is decided before, by measured steps).
    Greedy: upgrades are taken in order of gain per extra verified token, and the best
    non-empty prefix of that order is kept. Returns (the chosen level indices, the expected
    tokens per second)."""
    n = len(gains)
    chosen = [0] * n
    tokens, expected = n, float(n)
    best_value = -1.0
    best_prefix: list[tuple[int, int]] = []
    taken: list[tuple[int, int]] = []
    heap = [(-_rate(g, levels, 0), r) for r, g in enumerate(gains) if len(levels) > 1]
    heapq.heapify(heap)
    while heap:
        _, r = heapq.heappop(heap)
        j = chosen[r]
        chosen[r] = j + 1
        tokens += levels[j + 1] - levels[j]
        expected += gains[r][j + 1] - gains[r][j]
        taken.append((r, j + 1))
        value = expected / (draft_s + cost.target_s(tokens))
        if value > best_value:
            best_value, best_prefix = value, list(taken)
        if j + 2 < len(levels):
            heapq.heappush(heap, (-_rate(gains[r], levels, j + 1), r))
    result = [0] * n
    for r, j in best_prefix:
        result[r] = j
    return result, best_value


def choose_one_budget(gains: list[list[float]], levels: tuple[int, ...], cost: CostModel,
                      draft_s: float) -> int:
    """The index j >= 1 into `levels` maximising (N + sum_r gains[r][j]) /
    (draft_s + T(N * (1 + levels[j]))): one budget for every request of the step."""
    n = len(gains)
    totals = [sum(column) for column in zip(*gains)]  # expected accepted drafts per level
    return max(range(1, len(levels)), key=lambda j: (n + totals[j])
               / (draft_s + cost.target_s(n * (1 + levels[j]))))


def _rate(gain: list[float], levels: tuple[int, ...], j: int) -> float:
    return (gain[j + 1] - gain[j]) / (levels[j + 1] - levels[j])
