"""How much to speculate, per request and per step: the budget (draft nodes verified) that
maximises expected committed tokens per second of the whole batch, from a measured cost model of
the target and drafter forwards and an acceptance model built on the drafter's own path
probabilities, calibrated by each request's acceptance so far.

A request verified with budget b commits 1 + A tokens, A the accepted drafts. The drafter's
probability of a node's path is q(u) = prod_i q_i(u_i); were it calibrated, the expected A of a
candidate set is the sum of q over its nodes (the target's path passes through node u with
probability q(u)). Real drafters are not calibrated, so each request scales these sums by its
own ratio of accepted to predicted drafts (shrunk towards the batch's ratio while it has few
steps). Budgets come from a fixed ladder (`flashtree.spec.budgets`), so the step shapes stay in
the set that CUDA graphs capture; budget 0 verifies the bonus token alone (a plain decode step).

Whether a step drafts at all is decided first, for the batch: from recent speculative steps'
measured times and acceptance against measured plain steps (`SpecPolicy.should_draft`), and in
a draining batch from when its last request is expected to end (`flashtree.spec.drain`)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from flashtree.spec.budgets import CostModel, choose_budgets, choose_one_budget
from flashtree.spec.drain import DrainWatch

POLICIES = ("adaptive", "fixed")
T = TypeVar("T")
_DECAY = 0.9  # weight of the past in the acceptance sums, per step
_PRIOR_STEPS = 2.0  # a new request's calibration counts the batch's ratio this many times
_MAX_BACKOFF = 1024  # at most this many plain steps between two probes of speculation, unless
_PROBE_SHARE = 1 / 32  # a probe's extra time would be more than this share of its back-off
# Weight of the newest speculative step in RecentSpeculation: a step's accepted drafts vary
# a lot (0 to the whole block), and a forecast that drifts with them holds speculation off where
# it pays by a tenth; this averages over a few hundred steps.
_RECENT_RATE = 0.005
_CONFIDENCE = 1.5  # standard errors of benefit of the doubt (see optimistic_accepted)
# Consecutive steps' accepted drafts are correlated (the same requests, text the drafter drafts
# well or badly for a while): in H200 bench runs at 1 and 4 requests, means of 64 steps varied
# 2.8-4.5x as much as independent steps' would (16 steps: 2.3-3.7x). Until the acceptance
# averages have spanned their window, their standard error counts this many steps as one
# sample: counted one by one, the first 15 speculative steps of an engine at 4 requests, which
# accepted 1.20 drafts per request (1.39 over the run), bounded it at 1.35, and a verdict
# against speculation where it paid 9% held it off for 1100 steps (back-offs of 155, 310, 620
# steps, each probe's few steps in the same young average). In `benchmarks/policy_simulation.py`
# (independent steps, so it shows the cost alone) this gives up 1.0-1.4% of plain decoding's
# speed where speculation loses a tenth and gains 0.1-0.5% where it pays; counted so for the
# whole run, the bound gave up 3.3% there.
_CORRELATED_STEPS = 4
# The weight, in speculative steps, that the acceptance averages keep when a probe begins
# (`RecentSpeculation.restart`): they are as old as the back-off before it, and a drafter's
# acceptance moves with the text. At _RECENT_RATE a probe's steps weighed 1/200 each and the
# doubt granted stayed that of 400 steps, so a verdict taken in a stretch the drafter drafted
# badly stood through the good stretches after it (`benchmarks/policy_simulation.py`: 0.87
# of the full tree's speed where it paid 28%, now 0.98). Smaller weights resume speculation
# sooner after such a stretch and more often where it loses (8 gave up 1.6% of plain
# decoding's speed where speculation loses 11%, 64 0.2%). On an H200 at 4 requests, where
# speculation gains ~20%, 303 of 328 steps ran plain after two back-offs
# (`benchmarks/spec_step_paired.py`); whether for this reason is not measured.
_PROBE_PRIOR_STEPS = 64
# The share by which the forecast must favour speculation for a batch size to start (or
# resume) speculating: speculating costs more than its steps' times (the drafter's catch-up
# after plain steps; requests that end apart, each end then stalling the batch for a prompt
# step, where plain decoding's requests end together), and the forecast's inputs are noisy.
# Where the forecast's gain is smaller, decoding plain gives up at most that much. Once
# speculating, a batch size goes on while the forecast breaks even (no back-and-forth on
# noise).
_MARGIN = 0.05
# Steps whose median measured/predicted ratio corrects the profile. The forecast is re-tested
# every step: over a few steps, jitter in step times (10% on a GPU's host) would cross a
# threshold that speculation clears by a tenth often, and every crossing costs a back-off.
_SCALE_SAMPLES = 32
_PLAIN_PROBE = 64  # speculative steps in a row before one plain step re-measures plain decoding
# The speculative steps between two such plain steps double, up to this many times, while
# the forecast after each plain step favours speculation by _WIDE_GAIN. Each costs a few
# tenths of a percent where speculation pays (it commits one token, and the drafter's next
# step runs cold, 10-20% slower on an H200), and a plain time some hundred steps old cannot
# turn a forecast that clears break-even by a tenth unless plain steps alone sped up by as
# much (speculative steps are timed, and their acceptance followed, every step).
_PLAIN_PROBE_DOUBLINGS = 3
_WIDE_GAIN = 0.1
_TRUSTED_PLAIN = 8  # plain steps from which a bucket's own plain step time is used; a
# recheck (`SpecPolicy.recheck`) times as many
# Speculative steps after plain ones whose times are not counted: the first one injects the
# context rows plain steps deferred (eager engines) and runs the drafter cold. Forced runs of
# 40 plain then 8 speculative steps on an H200 (`benchmarks/step_breakdown.py --forced-runs
# 40,8`) put that one 10-20% above the run's steady time, the next ones within 3%: 3.89 ms,
# then 3.18-3.23 at 1 request; 4.43, then 4.14, 4.14 and 4.04-3.98 at 16.
_WARM_STEPS = 1
# Plain steps after speculative ones whose times are not counted, for the same reason. In step
# censuses on an H200 (`benchmarks/results/bench_gpu_sweep_2026-12-03/`) the first plain step
# after speculative ones took 11% more than plain steps after plain ones at 16 and 64 requests
# (medians of 7 and 5 such steps: 1.74 against 1.57 ms, 2.33 against 2.10; the second one
# took what the others did). A plain probe (one plain step every _PLAIN_PROBE or more
# speculative ones) timed only such steps, and plain decoding looked slower than it was: at
# 16 requests, where speculation loses ~15% a token, the plain times taken right after runs
# of it read 1.17-1.28x the profile where a back-off's read 0.90-0.92x (a slow stretch of
# the machine is part of it), speculation went on for ~300 steps, and benchmark rounds lost
# 10-20% to `none`. Every re-timing of plain decoding after speculative steps (a plain probe,
# a recheck, a back-off) runs this many plain steps more.
_COLD_PLAIN_STEPS = 1
# Plain steps after the first verdict against speculation: the first untimed, then
# _TRUSTED_PLAIN that re-time plain decoding.
_MIN_BACKOFF = _COLD_PLAIN_STEPS + _TRUSTED_PLAIN
# A probe's speculative steps: three of them are timed, and the verdict after a back-off's
# probe may rest on these times alone (`BatchSizeState.end_probe`); their median holds through
# one hiccup, where that of two (a mean) did not.
_PROBE_STEPS = _WARM_STEPS + 3


@dataclass
class Calibration:
    """Decayed sums of accepted and predicted drafts (one request's, or the batch's)."""

    accepted: float = 0.0
    predicted: float = 0.0

    def add(self, accepted: int, predicted: float) -> None:
        self.accepted = _DECAY * self.accepted + accepted
        self.predicted = _DECAY * self.predicted + predicted


@dataclass
class StepOutcome:
    """What a speculative step's verification showed the policy (`SpecPolicy.hand_over`).
    After a steady step the policy takes it in while the device runs the next speculative
    step's target forward, where the host would otherwise wait: the policy's bookkeeping is
    host work, and a small model's decode steps are bound by host work."""

    requests: int
    verified: int  # drafts verified over the batch
    accepted: int  # drafts accepted over the batch
    paces: list[tuple[int, int]]  # (seq_id, accepted drafts), every request
    # (seq_id, accepted drafts, the raw expected accepted drafts of its candidates), for the
    # requests whose expectation is known (chains', and trees' on a step that chose)
    calibrations: list[tuple[int, int, float]]
    reach: dict[int, list[float]]  # seq_id -> its tree's raw gains per level (`note_reach`)


class ScaleLayout:
    """A count of the changes that can move `SpecPolicy._factor`'s choice of bucket: a step
    scale made (a new bucket's, or one that replaces older times) or given one of its first
    _TRUSTED_PLAIN samples (whether it is seen, and trusted, depends on no later one). The
    choice is remembered until the count moves: the forecast reads it twice a step, and the
    search over buckets took a fifth to a third of the policy's host time per speculative
    step (`benchmarks/policy_host_time.py --against`)."""

    version = 0


def _remembered(memo: dict[tuple, tuple[int, T]], asked: tuple, answer: Callable[..., T]) -> T:
    """answer(*asked), remembered in `memo` with the ScaleLayout version it holds for."""
    known = memo.get(asked)
    if known is None or known[0] != ScaleLayout.version:
        known = memo[asked] = (ScaleLayout.version, answer(*asked))
    return known[1]


@dataclass
class StepScale:
    """Measured over predicted seconds of recent engine steps of one kind (speculative or
    plain): corrects the profile for what it does not see (host work, tree building, sampling)
    and for a profile measured while the machine was busier or idler than now. The median of
    the last _SCALE_SAMPLES steps, so that one cold step (first-call allocations, a preempted
    process) does not hold speculation off for the hundreds of plain steps the back-off
    waits."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=_SCALE_SAMPLES))
    _median: float | None = None  # the samples' median, once asked for since the last add

    @property
    def seen(self) -> bool:
        return bool(self.samples)

    @property
    def factor(self) -> float:
        """The samples' median (1 before any): computed when read, not at every add, as
        plain steps during a back-off are timed but read none."""
        if self._median is None:
            self._median = statistics.median(self.samples) if self.samples else 1.0
        return self._median

    def __post_init__(self) -> None:
        ScaleLayout.version += 1

    def add(self, measured: float, predicted: float) -> None:
        self.samples.append(measured / max(predicted, 1e-9))
        self._median = None
        if len(self.samples) <= _TRUSTED_PLAIN:
            ScaleLayout.version += 1


@dataclass
class RecentSpeculation:
    """Moving averages, per request and speculative step, of the drafts verified and accepted:
    what a step at the current drafter quality commits, before any drafting. The plain mean
    while there are fewer than 1 / _RECENT_RATE steps (the first steps do not weigh more)."""

    verified: float = 0.0
    accepted: float = 0.0
    accepted_sq: float = 0.0  # the average of its square
    steps: int = 0  # the steps the averages weigh as (fewer after a `restart`)
    spanned: bool = False  # the averages have spanned their whole window once

    @property
    def seen(self) -> bool:
        return self.steps > 0

    def add(self, verified: float, accepted: float) -> None:
        self.steps += 1
        self.spanned = self.spanned or self.steps >= round(1 / _RECENT_RATE)
        rate = max(_RECENT_RATE, 1 / self.steps)
        self.verified += rate * (verified - self.verified)
        self.accepted += rate * (accepted - self.accepted)
        self.accepted_sq += rate * (accepted * accepted - self.accepted_sq)

    def restart(self) -> None:
        """Weigh the averages as _PROBE_PRIOR_STEPS steps (at most): the steps that follow
        then count as a run's first steps do, and the benefit of the doubt widens to match."""
        self.steps = min(self.steps, _PROBE_PRIOR_STEPS)

    def optimistic_accepted(self) -> float:
        """The accepted average plus _CONFIDENCE standard errors (over as many steps as the
        average spans; _CORRELATED_STEPS of them a sample until it has spanned its window).
        A verdict against speculation stops the steps that would correct it, so an average
        that happens to be low would hold speculation off for good where it pays; the
        forecast gives it the benefit of the doubt that its noise leaves."""
        variance = max(0.0, self.accepted_sq - self.accepted * self.accepted)
        samples = min(self.steps, 2 / _RECENT_RATE) / (1 if self.spanned else _CORRELATED_STEPS)
        return self.accepted + _CONFIDENCE * math.sqrt(variance / samples)


def batch_bucket(requests: int) -> int:
    """The power of two at or above `requests`: batch sizes measured and judged together."""
    return 1 << (requests - 1).bit_length()


@dataclass
class BatchSizeState:
    """The policy's step times and back-off at one bucket of batch sizes (`batch_bucket`):
    how far measured steps are from the profile depends on the batch (host work weighs more
    in small steps), and so does whether speculation pays."""

    plain_scale: StepScale = field(default_factory=StepScale)
    spec_scale: StepScale = field(default_factory=StepScale)
    # The speculative step times from before a back-off's probe, set aside while the probe
    # times its own (`BatchSizeState.end_probe` keeps them or not).
    spec_before_probe: StepScale | None = None
    backoff: int = 0
    plain_steps_left: int = 0
    probe_steps_left: int = 0  # speculative steps the current or next probe still runs
    probe_seconds: float | None = None  # the running probe's steps' seconds so far
    probe_extra: float = 0.0  # the last whole probe's time beyond as many plain steps', in those
    spec_steps: int = 0  # speculative steps since the last plain probe
    plain_probe_doublings: int = 0  # of the _PLAIN_PROBE speculative steps between them
    plain_probed: bool = False  # the last plain step was a plain probe (`should_draft`)
    # Speculation runs here (the last verdict was for it, or a recheck of one against it is
    # under way): it goes on while the forecast breaks even, where starting (or resuming
    # after a back-off) takes a forecast gain of _MARGIN.
    speculating: bool = False
    rechecking: bool = False  # plain steps re-timed before a verdict against is final
    # Speculation resumed after a back-off, on the plain times of its last steps: the next
    # plain probe re-times _TRUSTED_PLAIN plain steps instead of one (`SpecPolicy.should_draft`).
    retime_plain: bool = False

    def end_probe(self) -> None:
        """A back-off's probe is over: its speculative step times replace the older ones
        where they are faster (those were a slow stretch's, the verdict against speculation
        taken in it), and join them where not (a probe's few steps could be slow by chance: a
        verdict against stands until the next probe, one for is corrected by the steps after
        it, so the older times keep the benefit of the doubt)."""
        before, probe = self.spec_before_probe, self.spec_scale
        assert before is not None, "no probe set the older speculative step times aside"
        self.spec_before_probe = None
        if before.seen and (not probe.seen or before.factor <= probe.factor):
            self.spec_scale = StepScale(deque([*before.samples, *probe.samples],
                                              maxlen=_SCALE_SAMPLES))

    def retime_plain_steps(self) -> None:
        """The next _COLD_PLAIN_STEPS + _TRUSTED_PLAIN steps run plain and the last
        _TRUSTED_PLAIN time plain decoding afresh (the older plain times are dropped); they
        count as a plain probe."""
        self.plain_scale = StepScale()
        self.plain_steps_left = _COLD_PLAIN_STEPS + _TRUSTED_PLAIN
        self.spec_steps, self.retime_plain, self.plain_probe_doublings = 0, False, 0


def _spec_scale(size: BatchSizeState) -> StepScale:
    return size.spec_scale


def _plain_scale(size: BatchSizeState) -> StepScale:
    return size.plain_scale


@dataclass
class SpecPolicy:
    """The adaptive policy's state: calibrations, measured step-time corrections, and when to probe
    speculation again after a step where drafting did not pay for itself.

    Whether a step drafts at all is judged by measured steps (the forecast), per bucket of
    batch sizes: a verdict against speculation is only as good as the speculative steps timed
    before it, so speculation is judged after probes, runs of _PROBE_STEPS speculative steps,
    the first _WARM_STEPS untimed. A bucket's first steps time its own plain steps; the
    engine's first speculative steps are a probe (when steps are timed; a bucket not measured
    yet borrows the nearest one's speculative step times), and one follows every back-off: the
    plain steps after a verdict against speculation, doubling while verdicts keep coming.
    The verdict after a back-off's probe takes the probe's speculative step times alone where
    they are faster than those before it (`BatchSizeState.end_probe`): step times drift in
    stretches (at one request on an H200, verdicts came where speculative steps ran at 1.2x
    their usual time for tens of steps), and a probe's few times joined to such a stretch's in
    one median left its verdict standing for thousands of steps. A probe measures speculation
    without using it: its steps commit one token per request, as plain steps would. Were they
    to commit their accepted drafts, the requests they speed up would finish at other steps
    than they would have, and the admissions after them (a prefill step each, costing many
    decode steps on a GPU) would come apart: a probe at a wide batch cost a benchmark run of
    800 steps a third of its throughput that way, against the 3% its own steps cost. The
    budgets of a step that drafts are the choice's (`choose`)."""

    cost: CostModel
    levels: tuple[int, ...]
    timed: bool = True  # steps' wall times are observed (not under TP, where ranks' differ)
    # Every request of a step gets the same budget: where verify steps replay CUDA graphs,
    # which pad each request's candidates to the step's largest budget (a smaller budget for
    # some requests saves nothing there, and mixed trees leave the on-device DDTree path).
    one_budget: bool = False
    probing: bool = False  # the step should_draft last allowed is a probe's
    probe_steps_before: int = 0  # its bucket's probe_steps_left before that step
    batch: Calibration = field(default_factory=Calibration)
    requests: dict[int, Calibration] = field(default_factory=dict)
    sizes: dict[int, BatchSizeState] = field(default_factory=dict)  # by batch_bucket
    recent: RecentSpeculation = field(default_factory=RecentSpeculation)
    predicted_s: float = 0.0  # forward seconds the last choice expects (draft + verify)
    run_length: int = 0  # speculative steps in a row up to the last observed one
    plain_run: int = _COLD_PLAIN_STEPS  # plain steps since the last observed speculative one
    reach: dict[int, list[float]] = field(default_factory=dict)  # per request: its last tree's
    recent_reach: list[float] | None = None  # raw gains per level, and their recent average
    drain: DrainWatch = field(default_factory=DrainWatch)
    decisions: int = 0  # should_draft calls so far
    # The last decision let the step speculate on the forecast's word (no probe, no drain
    # verdict): its outcome and the next forecast wait for the next step (`hand_over`).
    steady: bool = False
    _pending: StepOutcome | None = field(default=None, init=False, repr=False, compare=False)
    # The forecast of a decision worked out before it (`prepare_forecast`): the decision it
    # is for, its batch size, and `_forecast_seconds`' two sides.
    _prepared_forecast: tuple[int, int, float, float] | None = field(
        default=None, init=False, repr=False, compare=False)
    choice_inputs: int = 0  # changes to what `choose` reads (tree reach, calibrations) so far
    # The choice of `prepare_choice`: `choice_inputs` when it was made, its requests, and
    # `_best_budgets`' answer.
    _prepared_choice: tuple[int, list[int], tuple[list[int], float]] | None = field(
        default=None, init=False, repr=False, compare=False)
    # _factor's and _measured's answers (`_remembered`).
    _nearest: dict[tuple, tuple[int, StepScale | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _seen: dict[tuple, tuple[int, bool]] = field(default_factory=dict, init=False,
                                                 repr=False, compare=False)

    def at(self, requests: int) -> BatchSizeState:
        """The state of the bucket of a batch of `requests`."""
        bucket = batch_bucket(requests)
        size = self.sizes.get(bucket)
        if size is None:
            size = self.sizes[bucket] = BatchSizeState()
        return size

    def should_draft(self, requests: int,
                     remaining: Callable[[], list[int]] | None = None) -> bool:
        """False (the step runs plain) during a back-off, and where the forecast from recent
        speculative steps (their accepted and verified drafts and measured step times, at this
        batch size) says a draft cannot pay for itself: a verdict, before drafting. A bucket
        times _TRUSTED_PLAIN plain steps of its own before its first verdict; once
        speculative steps are being measured, plain steps are too: one before the first
        comparison and one every _PLAIN_PROBE speculative steps (each after _COLD_PLAIN_STEPS
        untimed ones), twice as many steps after each one whose forecast favours speculation
        by _WIDE_GAIN (the first after a resume from a back-off re-times _TRUSTED_PLAIN of them
        afresh: the resume was judged on the back-off's last few plain steps, and on a loaded
        machine those can be several times slower than the steps after them). Probes
        speculate without asking the forecast, and commit what a plain step would
        (`probing`). Starting to
        speculate takes a forecast gain of `_margin()`, going on a break-even; a verdict
        against running speculation is taken again on fresh plain steps (`recheck`).
        `remaining`: where no other request waits, a function giving each request's tokens
        left to generate (None where some do; called only when a draining batch's verdict
        needs them, not every step): in a draining batch, a step the forecast favours still runs
        plain where the batch is expected to end sooner that way (`DrainWatch`)."""
        self.decisions += 1
        self.steady = False
        self.drain.note_batch(requests, others_wait=remaining is None)
        size = self.at(requests)
        if size.plain_steps_left > 0:
            if size.plain_steps_left == _TRUSTED_PLAIN and size.probe_steps_left > 0:
                size.plain_scale = StepScale()  # a back-off's last steps re-time plain decoding
            size.plain_steps_left -= 1
            return False
        if size.spec_before_probe is not None and size.probe_steps_left == 0:
            size.end_probe()
        if self._unmeasured_plain(size):
            return False
        if size.spec_scale.seen and (not size.plain_scale.seen or size.spec_steps
                                     >= _PLAIN_PROBE << size.plain_probe_doublings):
            size.spec_steps, size.plain_probed = 0, True
            if size.retime_plain:
                size.retime_plain_steps()
                size.plain_steps_left -= 1  # this step is the first of them
            else:  # this step runs cold; the next ones' times are the probe's
                size.plain_steps_left = _COLD_PLAIN_STEPS
            return False
        self.probing = size.probe_steps_left > 0 or (self.timed
                                                     and not self._measured(_spec_scale))
        if self.probing:
            if size.probe_steps_left == _PROBE_STEPS:  # a back-off's probe begins
                size.probe_seconds = 0.0
                self.recent.restart()
                size.spec_before_probe, size.spec_scale = size.spec_scale, StepScale()
            for other in self.sizes.values():  # a probe cut short elsewhere is not timed:
                if other is not size:  # resumed, it would pay a second catch-up
                    other.probe_seconds = None
            self.probe_steps_before = size.probe_steps_left
            size.probe_steps_left = max(0, size.probe_steps_left - 1)
        elif self.forecast_pays(requests, 0.0 if size.speculating else self._margin()):
            if (self.drain.draining and remaining is not None
                    and not self.drain.speculation_pays(remaining(), self.spec_s, self.plain_s)):
                return False
            size.retime_plain = size.retime_plain or size.backoff > 0
            size.backoff, size.speculating, size.rechecking = 0, True, False
            self.steady = True
            if size.plain_probed:  # the first forecast on the plain probe's time
                size.plain_probed = False
                size.plain_probe_doublings = (
                    min(size.plain_probe_doublings + 1, _PLAIN_PROBE_DOUBLINGS)
                    if self.forecast_pays(requests, _WIDE_GAIN) else 0)
        elif size.speculating and not size.rechecking and self.timed:
            self.recheck(requests)
            size.plain_steps_left -= 1  # this step is the recheck's first
            return False
        else:
            size.speculating = size.rechecking = False
            self.back_off(requests)
            size.plain_steps_left -= 1  # this step is the back-off's first
            return False
        size.spec_steps += 1
        return True

    def draft_refused(self, requests: int) -> None:
        """The step of `requests` that should_draft just allowed ran plain after all (the
        engine could not reserve the pages its draft writes): it counts as a plain step, and
        a probe's step it was is still to come. Counted as the probe's, it added no time to
        the probe, and as the probe's last step it left the probe's cost unmeasured."""
        size = self.at(requests)
        size.spec_steps -= 1
        if self.probing:
            size.probe_steps_left = self.probe_steps_before
            self.probing = False

    def _unmeasured_plain(self, size: BatchSizeState) -> bool:
        """Whether a bucket that has not speculated yet still times its own plain steps
        before its first verdict (_TRUSTED_PLAIN of them; they cost what `none`'s steps do).
        Borrowed plain times mislead most here: a smaller bucket's overstate this one's (host
        work weighs more in small steps), so speculation looked like it paid where it lost,
        and a bucket's first speculative run went on until its own times showed otherwise
        (15-21 steps at 16 requests on the GPU, in benchmark runs that lost 15% to `none`)."""
        return (self.timed and not size.spec_scale.seen and size.probe_steps_left == 0
                and len(size.plain_scale.samples) < _TRUSTED_PLAIN)

    def _margin(self) -> float:
        """The forecast gain that starts speculation: _MARGIN once the acceptance average
        has spanned its whole window (1 / _RECENT_RATE steps; a probe's restart of its
        weight keeps the margin); before, its own noise outweighs the biases the margin is
        for, and the optimistic bound deals with that noise."""
        return _MARGIN if self.recent.spanned else 0.0

    def recheck(self, requests: int) -> None:
        """A first verdict against speculation while it runs at a batch of `requests`:
        _TRUSTED_PLAIN plain steps, timed afresh (the bucket's older plain times are
        dropped), before the verdict is taken again. Its plain step times are as old as its
        last plain steps (one every _PLAIN_PROBE or more speculative ones) and its speculative
        ones recent: a machine that slowed down since (another process, clocks) would otherwise
        look like speculation stopped paying, and a back-off is long where a probe costs many
        plain steps."""
        self._digest_pending()
        size = self.at(requests)
        size.rechecking = True
        size.retime_plain_steps()

    def back_off(self, requests: int) -> None:
        """A verdict against speculation at a batch of `requests`: plain steps, doubling from
        the last back-off's while verdicts keep coming, then a probe; enough plain steps that
        the probe's extra time is at most _PROBE_SHARE of theirs (where a speculative step
        costs many plain ones, as with wide batches on a CPU, a probe is rare). A probe's cost
        is the last probe's measured extra time, where there was one: its first step also
        catches the drafter up on the context of every plain step since the one before (on an
        H200 at 16 requests a probe took ~40 ms with that catch-up, ~16 plain steps more than
        the 4 it stood for, where its speculative steps' median time counted ~8). It is at
        least _PROBE_STEPS x the cheapest recent speculative step's (not any step's: cold ones
        would hold off the probes that show them to have been cold). The back-off's last
        _TRUSTED_PLAIN steps re-time plain decoding (the bucket's older plain times are
        dropped), so that the verdict after the probe compares steps of one time: plain times
        from before a back-off can be a slower machine's (a GPU's first seconds, another
        process), and such times at 16 requests on the GPU made speculation look like it paid
        a fifth where it lost up to 7%."""
        self._digest_pending()
        size = self.at(requests)
        samples = size.spec_scale.samples
        cheapest = (min(samples) if samples else self._factor(requests, _spec_scale)
                    ) * self.spec_profile_s(requests)
        probe_extra = max(_PROBE_STEPS * (cheapest / self.plain_s(requests) - 1),
                          size.probe_extra)
        size.backoff = max(min(max(_MIN_BACKOFF, 2 * size.backoff), _MAX_BACKOFF),
                           math.ceil(probe_extra / _PROBE_SHARE))
        size.plain_steps_left = size.backoff
        size.probe_steps_left = _PROBE_STEPS
        size.spec_steps, size.retime_plain = 0, False  # its plain steps re-time plain decoding
        size.plain_probe_doublings, size.plain_probed = 0, False

    def forecast_pays(self, requests: int, margin: float = 0.0) -> bool:
        """Whether a speculative step of `requests` is expected to commit tokens faster than
        a plain one by `margin` (a share), judged before drafting from recent speculative
        steps' acceptance and measured times (True before there are any)."""
        if not self.recent.seen:
            return True
        prepared = self._prepared_forecast
        if prepared is not None and prepared[:2] == (self.decisions, requests):
            committed_s, spec_s = prepared[2:]
        else:
            committed_s, spec_s = self._forecast_seconds(requests)
        return committed_s >= (1 + margin) * spec_s

    def _forecast_seconds(self, requests: int) -> tuple[float, float]:
        """Seconds of as many plain steps of `requests` as a speculative step is expected to
        commit tokens (with the benefit of the doubt), and of a speculative step."""
        return ((1 + self.recent.optimistic_accepted()) * self.plain_s(requests),
                self.spec_s(requests))

    def prepare_forecast(self, requests: int) -> None:
        """Work out the next decision's forecast for a batch of `requests` now, during a
        steady step: the next decision takes it where it is for as many requests. It then
        lacks this step's time (one of _SCALE_SAMPLES in the median) and acceptance (see
        `hand_over`). A decision after another one works it out afresh."""
        if self.recent.seen:
            self._prepared_forecast = (self.decisions + 1, requests,
                                       *self._forecast_seconds(requests))

    def spec_s(self, requests: int) -> float:
        """Expected seconds of a speculative step of `requests` that verifies as many drafts
        as recent ones did."""
        return self._factor(requests, _spec_scale) * self.spec_profile_s(requests)

    def spec_profile_s(self, requests: int) -> float:
        """The profile's seconds of such a step."""
        verified = round(requests * (1 + self.recent.verified))
        return self.cost.draft_s(requests) + self.cost.target_s(verified)

    def plain_s(self, requests: int) -> float:
        """Expected seconds of a plain decode step of `requests`: from _TRUSTED_PLAIN plain
        steps of its bucket, or the nearest bucket's that has as many. A bucket that mostly
        speculates times a plain step only every _PLAIN_PROBE or more speculative ones, and one
        old step is a noisy basis for a verdict (where a probe's speculative steps are its own
        bucket's best measure)."""
        return (self._factor(requests, _plain_scale, _TRUSTED_PLAIN, larger_first=True)
                * self.cost.target_s(requests))

    def _factor(self, requests: int, kind: Callable[[BatchSizeState], StepScale],
                trusted: int = 1, larger_first: bool = False) -> float:
        """Measured over profiled step time of one kind at this batch size: its bucket's once
        it holds `trusted` steps, else the nearest bucket's that does (else the nearest
        measured one's; 1 before any is measured). Of two as near, the smaller, or with
        `larger_first` the larger: host work weighs more in small steps, so a smaller
        bucket's factor overstates a larger one's steps (plain ones by a third, from 4 to 8
        requests on the GPU), and each tie is broken the way that errs towards decoding
        plain."""
        asked = (batch_bucket(requests), kind, trusted, larger_first)
        scale = _remembered(self._nearest, asked, self._nearest_scale)
        return 1.0 if scale is None else scale.factor

    def _nearest_scale(self, bucket: int, kind: Callable[[BatchSizeState], StepScale],
                       trusted: int, larger_first: bool) -> StepScale | None:
        """The scale whose factor `_factor` reads for a batch of this bucket."""
        bits = bucket.bit_length()
        nearest, nearest_key = None, None
        for other, size in self.sizes.items():
            scale = kind(size)
            if not scale.seen:
                continue
            key = (len(scale.samples) < trusted, abs(other.bit_length() - bits),
                   -other if larger_first else other)
            if nearest_key is None or key < nearest_key:
                nearest, nearest_key = scale, key
        return nearest

    def _measured(self, kind: Callable[[BatchSizeState], StepScale]) -> bool:
        """Whether steps of this kind have been measured at any bucket."""
        return _remembered(self._seen, (kind,), lambda kind: any(
            kind(size).seen for size in self.sizes.values()))

    def scale(self, seq_id: int) -> float:
        """Accepted per predicted draft for this request, shrunk towards the batch's ratio."""
        prior = self.batch.accepted / self.batch.predicted if self.batch.predicted > 0 else 1.0
        own = self.requests.get(seq_id)
        if own is None:
            return prior
        return (own.accepted + _PRIOR_STEPS * prior) / (own.predicted + _PRIOR_STEPS)

    def choose(self, seq_ids: list[int], raw_gains: list[list[float]]) -> list[int]:
        """Budgets (from `levels`) for a batch that drafts: what the cost and acceptance
        models expect to commit the most tokens per second, some of them 0 (with one_budget,
        one budget for all); raw_gains[r][j] is request r's sum of drafter path probabilities
        over the nodes of budget levels[j]."""
        budgets, self.predicted_s = self._best_budgets(seq_ids, raw_gains)
        return budgets

    def choose_next(self, seq_ids: list[int]) -> list[int]:
        """`choose` for these requests' next trees, before they are drafted, from
        `expected_gains`: the prepared choice (`prepare_choice`) where it is for them and
        its inputs have not changed since (it is then the same choice)."""
        prepared, self._prepared_choice = self._prepared_choice, None
        if prepared is not None and prepared[:2] == (self.choice_inputs, seq_ids):
            budgets, self.predicted_s = prepared[2]
            return budgets
        return self.choose(seq_ids, [self.expected_gains(i) for i in seq_ids])

    def prepare_choice(self, seq_ids: list[int]) -> None:
        """Work out `choose_next(seq_ids)` now, while the device runs this step's target
        forward (the host would wait there), for a next step that chooses."""
        self._prepared_choice = (self.choice_inputs, seq_ids, self._best_budgets(
            seq_ids, [self.expected_gains(i) for i in seq_ids]))

    def _best_budgets(self, seq_ids: list[int], raw_gains: list[list[float]]
                      ) -> tuple[list[int], float]:
        """`choose`'s budgets, and the forward seconds the profile expects of them."""
        gains = [[g * k for g in row] for k, row in zip(map(self.scale, seq_ids), raw_gains)]
        n = len(seq_ids)
        if self.one_budget:
            picks = [choose_one_budget(gains, self.levels, self.cost, self.cost.draft_s(n))] * n
        else:
            picks, _ = choose_budgets(gains, self.levels, self.cost, self.cost.draft_s(n))
        tokens = n + sum(self.levels[j] for j in picks)
        return ([self.levels[j] for j in picks],
                self.cost.draft_s(n) + self.cost.target_s(tokens))

    def expected_gains(self, seq_id: int) -> list[float]:
        """Raw gains per level for a request's next tree, before it is drafted (choosing after
        drafting would make the host wait for the draft): its last tree's, as a request's
        trees change little from one step to the next; else recent trees' average; else every
        node accepted (the first steps then measure what speculation gives)."""
        own = self.reach.get(seq_id)
        if own is not None:
            return own
        return self.recent_reach if self.recent_reach is not None else [float(b) for b in
                                                                         self.levels]

    def note_reach(self, reach: dict[int, list[float]]) -> None:
        """Drafted trees' raw gains per level (seq_id -> the sums of its best nodes' path
        probabilities), for the requests' next choices; their mean enters the recent
        average with the weight it would have gained one tree at a time."""
        if not reach:
            return
        self.choice_inputs += 1
        self.reach.update(reach)
        n, rows = len(reach), list(reach.values())
        mean = rows[0] if n == 1 else [sum(column) / n for column in zip(*rows)]
        old = self.recent_reach
        weight = 1 - (1 - _RECENT_RATE) ** n
        self.recent_reach = mean if old is None else [
            o + weight * (g - o) for o, g in zip(old, mean)]

    def observe_step(self, speculative: bool, requests: int, seconds: float) -> None:
        """A decode step of `requests` took `seconds` of wall time: learn how far the profile
        is from it. The first _WARM_STEPS speculative steps after plain ones are not counted:
        they run the drafter cold (and the first injects the plain steps' context rows into
        the draft cache) and cost more than the steps of a run that follow, and a
        run's steps are what the choice to keep speculating is about (probes alone would
        otherwise be judged by their switching cost, and hold speculation off where runs of
        it pay). Nor are the first _COLD_PLAIN_STEPS plain steps after speculative ones, which
        run slower than the plain steps after them. A probe's steps are summed up (`back_off`
        weighs the next probe by them)."""
        size = self.at(requests)
        if speculative and self.probing and size.probe_seconds is not None:
            size.probe_seconds += seconds
            if size.probe_steps_left == 0:  # the probe's last step
                size.probe_extra = size.probe_seconds / self.plain_s(requests) - _PROBE_STEPS
                size.probe_seconds = None
        self.run_length = self.run_length + 1 if speculative else 0
        self.plain_run = 0 if speculative else self.plain_run + 1
        if self.run_length > _WARM_STEPS:
            size.spec_scale.add(seconds, self.predicted_s)
        elif self.plain_run > _COLD_PLAIN_STEPS:
            size.plain_scale.add(seconds, self.cost.target_s(requests))

    def hand_over(self, outcome: StepOutcome) -> None:
        """What a speculative step's verification showed: taken in now, or, after a step
        that speculated on the forecast's word (`steady`), in the next speculative step
        (`meanwhile`) or when a verdict ends the speculation (`back_off`, `recheck`). The
        forecast of the step after a steady one then lacks its acceptance (one step of a
        moving average); a probe's verdict has all of its steps'."""
        self._digest_pending()  # one a step that skipped `meanwhile` left: taken in, not lost
        if self.steady:
            self._pending = outcome
        else:
            self._digest(outcome)

    def meanwhile(self, requests: int) -> None:
        """Host work that needs none of a speculative step's results, for the engine to run
        while the device runs the step's target forward (the host would wait there, and a
        small model's decode steps are bound by host work): the last steady step's outcome
        taken in, and where this step is steady, the next decision's forecast worked out
        (`prepare_forecast`)."""
        self._digest_pending()
        if self.steady:
            self.prepare_forecast(requests)

    def _digest_pending(self) -> None:
        if self._pending is not None:
            self._digest(self._pending)
            self._pending = None

    def _digest(self, outcome: StepOutcome) -> None:
        if outcome.reach:
            self.note_reach(outcome.reach)
        for seq_id, accepted, predicted in outcome.calibrations:
            self.observe(seq_id, accepted, predicted)
        for seq_id, accepted in outcome.paces:
            self.observe_pace(seq_id, accepted)
        if outcome.verified:  # a step that verified no draft says nothing about speculation
            self.observe_speculation(outcome.requests, outcome.verified, outcome.accepted)

    def observe_speculation(self, requests: int, verified: float, accepted: float) -> None:
        """A speculative step verified `verified` and accepted `accepted` drafts over
        `requests` requests (the forecast's inputs)."""
        self.recent.add(verified / requests, accepted / requests)

    def observe_pace(self, seq_id: int, accepted: int) -> None:
        """A request's speculative step accepted `accepted` drafts (a probe's too)."""
        self.drain.count(seq_id, 1 + accepted)

    def observe(self, seq_id: int, accepted: int, predicted: float) -> None:
        """After verification: `accepted` drafts of the chosen candidates, whose raw predicted
        sum was `predicted`."""
        self.choice_inputs += 1
        own = self.requests.get(seq_id)
        if own is None:
            own = self.requests[seq_id] = Calibration()
        own.add(accepted, predicted)
        self.batch.add(accepted, predicted)

    def forget(self, live: set[int]) -> None:
        """Drop the calibration of requests that are gone."""
        for seq_id in [s for s in self.requests if s not in live]:
            del self.requests[seq_id]
        for seq_id in [s for s in self.reach if s not in live]:
            del self.reach[seq_id]
        self.drain.forget(live)
