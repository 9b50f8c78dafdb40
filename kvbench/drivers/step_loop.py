"""The timed driver for in-process engines that expose a step loop, on the wall clock or a step clock.

Requests are released at their workload arrival times (open loop), or kept ``concurrency`` in
flight (closed loop: a request "arrives" when a slot frees), by the rule every driver shares
(:class:`~kvbench.drivers.release.ReleaseSchedule`). Between steps the driver aborts requests whose
``abort_at`` has passed. After each step it records tokens, admissions,
preemptions, resumes and finishes per request, and queue lengths, KV usage and tokens scheduled
per step, into a :class:`~kvbench.core.trace.TraceRecorder`.

Two clocks decide *when* a request is released or aborted (one loop, :func:`drive`, with the clock's
three differences in a small object each: where a release point lies, what an idle engine's driver
does, and what a step's ``virtual_t`` is):

* **wall clock** (``step_seconds=None``): arrival ``t`` is released once ``t`` seconds have passed
  since the run began. What a step finds in the queue then depends on how fast the machine is,
  so counts (preemptions, recomputed tokens, swaps, prefix hits) vary from run to run. An idle
  engine's next arrival is waited for by sleeping, and the last :data:`ARRIVAL_SPIN_S` of the wait
  by spinning on the clock: a sleep wakes late by a share of a lone request's TTFT on the tiny model,
  which the TTFT would otherwise carry as if the engine had spent it
  (docs/journal/simulator.md#2026-12-03-night-waking-up-after-idle).
* **step clock** (``step_seconds=s``): virtual time advances by ``s`` per engine step. Arrival
  ``t`` is released right before step ``floor(t / s)``; an abort ``abort_at`` seconds after a
  request's release fires before step ``release_step + floor(abort_at / s)``. When the engine is
  idle the virtual clock jumps to the next arrival (no sleeping). The engine sees the same
  requests before the same steps on every run, so a deterministic engine produces identical
  counts run after run. Timings keep the wall clock: every time in the trace (arrival = the
  moment of release, tokens, finishes, step ends and durations) is measured as on the wall
  clock; each :class:`~kvbench.core.trace.StepRecord` also carries its ``virtual_t`` and the trace
  its ``step_seconds``, so :func:`workload_time` can map a trace time back onto the workload's
  clock (for claims such as "preemptions after the surge began").

An engine that cannot be stepped from outside (a server, an engine with its own loop thread)
cannot use the step clock: its adapter declares ``steppable = False`` and its counts are gated
with the same statistics as times (:mod:`kvbench.bench.gate`).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbench.core.liveness import DriverWatchdog, Liveness
from kvbench.core.trace import StepRecord, Trace, TraceRecorder
from kvbench.drivers.release import Release, ReleaseSchedule, record_arrival, step_index

#: the end of an idle engine's wait for its next arrival that the wall-clock driver spins through
#: instead of sleeping (seconds): longer than a sleep here overshoots
#: (docs/journal/simulator.md#2026-12-03-night-waking-up-after-idle).
ARRIVAL_SPIN_S = 0.001


@dataclass
class StepReport:
    """What a steppable engine tells the driver after one step."""

    new_tokens: dict[str, int]  # request id -> tokens produced this step
    finished: dict[str, str | None]  # request id -> finish reason
    admitted: list[str]
    preempted: list[tuple[str, str]]  # (request id, mode)
    resumed: list[str]
    record: StepRecord  # t and duration (and virtual_t on the step clock) are filled in by the driver
    #: request id -> its output token ids, for requests finished this step, where the engine gives them (kept
    #: in the trace only by a recorder with ``keep_outputs``: a head-to-head's cross-check of greedy outputs)
    outputs: dict[str, list[int]] = field(default_factory=dict)


class SteppableEngine(Protocol):
    def submit(self, request: Any) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepReport: ...


class VirtualClock(Protocol):
    """A simulator's clock (e.g. :class:`reference_engine.sim.pricing_runner.VirtualClock`): seconds that move
    only when the engine works (its steps advance it) or when the driver jumps an idle gap."""

    def now(self) -> float: ...
    def advance_to(self, t: float) -> None: ...


class _WallClock:
    """Releases and aborts at trace seconds (the wall clock, or a simulator's virtual clock)."""

    def __init__(self, recorder: TraceRecorder, idle_sleep: float, virtual_clock: VirtualClock | None):
        self._recorder, self._idle_sleep, self._virtual = recorder, idle_sleep, virtual_clock

    def to_point(self, seconds: float) -> float:
        return seconds

    def now(self) -> float:
        return self._recorder.now()

    def arrival(self, release: Release) -> float:
        return release.at  # open loop: the workload's arrival time, even when released late

    def idle(self, next_point: float | None, watchdog: DriverWatchdog, schedule: ReleaseSchedule) -> None:
        """Wait towards the next arrival (a virtual clock jumps to it), then let the watchdog judge the
        idle turn: requests in flight that the engine has no work for are lost, unless it recovers."""
        if next_point is not None:
            if self._virtual is not None:  # nothing happens until the next arrival: jump, do not sleep
                self._virtual.advance_to(next_point)
            else:
                _wait_for(next_point, self._recorder.now, self._idle_sleep)
        watchdog.idle()

    def virtual_t(self) -> float | None:
        return None

    def stepped(self) -> None:
        pass


class _StepClock:
    """Releases and aborts by engine step index; virtual time is ``step index x step_seconds``."""

    def __init__(self, recorder: TraceRecorder, step_seconds: float):
        self._recorder, self.step_seconds = recorder, step_seconds
        self.k = 0  # the index of the next engine step

    def to_point(self, seconds: float) -> int:
        return step_index(seconds, self.step_seconds)

    def now(self) -> int:
        return self.k

    def arrival(self, release: Release) -> float:
        return self._recorder.now()  # times stay on the recorder's clock; virtual_t maps them back

    def idle(self, next_point: float | None, watchdog: DriverWatchdog, schedule: ReleaseSchedule) -> None:
        """Jump to the next release (no sleeping). With nothing to jump to, no step will ever come, so
        requests still in flight can never finish: fail now rather than loop."""
        if next_point is not None:
            self.k = max(self.k, int(next_point))
        elif schedule.in_flight:
            raise RuntimeError(f"step clock: the engine reports no work but {len(schedule.in_flight)} requests "
                               f"never finished: {sorted(schedule.in_flight)[:5]}")

    def virtual_t(self) -> float:
        return self.k * self.step_seconds

    def stepped(self) -> None:
        self.k += 1


def drive(engine: SteppableEngine, requests: Sequence[Any], recorder: TraceRecorder, concurrency: int | None = None,
          progress: Callable[[int], None] | None = None, idle_sleep: float = 0.001,
          step_seconds: float | None = None, liveness: Liveness | None = None,
          virtual_clock: VirtualClock | None = None) -> None:
    """Serve ``requests`` (WorkloadRequest-like) on ``engine`` until all have finished or been aborted,
    released by :class:`~kvbench.drivers.release.ReleaseSchedule` (open loop, or ``concurrency`` in flight).

    ``step_seconds``: None for the wall clock; a positive number for the step clock (see the module
    docstring). Raises ValueError for a non-positive ``step_seconds``.
    ``virtual_clock``: a simulated engine's own clock. Every time is then read from it (the recorder's
    included, so the trace holds simulated seconds) instead of the wall clock, and an idle engine jumps
    it to the next arrival instead of sleeping: the wall-clock loop run on simulated time. With
    ``step_seconds`` too, releases follow the step clock and times the virtual clock.
    ``liveness``: the no-progress watchdog's limits (default :data:`~kvbench.core.liveness.DEFAULT_LIVENESS`);
    raises :class:`~kvbench.core.liveness.LivenessError` naming the stuck requests when one is passed.
    """
    watchdog = DriverWatchdog(liveness)
    if virtual_clock is not None:
        recorder.use_clock(virtual_clock.now)
    clock: _WallClock | _StepClock
    if step_seconds is None:
        clock = _WallClock(recorder, idle_sleep, virtual_clock)
    else:
        if not (isinstance(step_seconds, int | float) and math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"step_seconds must be a positive number of seconds or None, got {step_seconds!r}")
        clock = _StepClock(recorder, float(step_seconds))
        recorder.trace.step_seconds = float(step_seconds)
    schedule = ReleaseSchedule(requests, concurrency, to_point=clock.to_point)
    recorder.restart_clock()
    while not schedule.done:
        now = clock.now()
        for release in schedule.release_due(now):
            record_arrival(recorder, release.request, clock.arrival(release))
            engine.submit(release.request)
            watchdog.submitted(release.request_id)
        for rid in schedule.aborts_due(now):
            engine.abort(rid)
            watchdog.abort_sent(rid)
        if not engine.has_work():
            clock.idle(schedule.next_point(), watchdog, schedule)
            continue
        _record_step(engine, recorder, schedule, progress, virtual_t=clock.virtual_t(), watchdog=watchdog)
        clock.stepped()


def _wait_for(t: float, now: Callable[[], float], idle_sleep: float) -> None:
    """Wait towards ``t`` on the clock ``now``: sleep, for at most 50 ms (the caller looks at aborts and
    its watchdog between waits), until :data:`ARRIVAL_SPIN_S` before it, then spin until ``t``. Never
    returns early unless ``t`` has passed; a ``t`` already past sleeps ``idle_sleep``."""
    wait = t - now()
    if wait <= 0:
        time.sleep(idle_sleep)
    elif wait > ARRIVAL_SPIN_S:
        time.sleep(min(wait - ARRIVAL_SPIN_S, 0.05))
    else:
        while now() < t:
            pass


def record_scheduling(recorder: TraceRecorder, report: Any, t: float) -> None:
    """Record a step report's admissions, preemptions (with their mode) and resumptions at time ``t``."""
    for rid in report.admitted:
        recorder.admitted(rid, t)
    for rid, mode in report.preempted:
        recorder.preempted(rid, t, mode)
    for rid in report.resumed:
        recorder.resumed(rid, t)


def _record_step(engine: SteppableEngine, recorder: TraceRecorder, schedule: ReleaseSchedule,
                 progress: Callable[[int], None] | None, virtual_t: float | None,
                 watchdog: DriverWatchdog | None = None) -> None:
    """Run one engine step and record what it did at the wall-clock time it ended."""
    started = recorder.now()
    report = engine.step()
    t = recorder.now()
    record_scheduling(recorder, report, t)
    for rid, n in report.new_tokens.items():
        recorder.tokens(rid, t, n)
    for rid, ids in report.outputs.items():
        recorder.output(rid, ids, None)
    for rid, reason in report.finished.items():
        recorder.finished(rid, t, reason)
        schedule.finished(rid)
        if progress is not None:
            progress(1)
    report.record.t, report.record.duration = t, t - started
    report.record.virtual_t = virtual_t
    recorder.step(report.record)
    if watchdog is not None:
        watchdog.saw_step(report)


def workload_clock(trace: Trace) -> Callable[[float], float]:
    """A function mapping a trace time onto the workload's clock: the identity on the wall clock;
    on the step clock, the virtual time of the step during (or right before) which it happened.

    Events are recorded at the end of the step that caused them and releases right before the
    step that first sees them, so both map onto that step's virtual time; a time after the last
    step maps onto the last step's.
    """
    steps = [s for s in trace.steps if s.virtual_t is not None] if trace.step_seconds is not None else []
    if not steps:
        return lambda t: t
    ends = [s.t for s in steps]
    virtual = [float(s.virtual_t) for s in steps]  # type: ignore[arg-type]

    def to_workload(t: float) -> float:
        return virtual[min(bisect.bisect_left(ends, t), len(virtual) - 1)]

    return to_workload


def workload_time(trace: Trace, t: float) -> float:
    """One trace time on the workload's clock (see :func:`workload_clock`)."""
    return workload_clock(trace)(t)
