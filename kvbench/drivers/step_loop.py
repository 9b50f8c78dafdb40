"""The timed driver for in-process engines that expose a step loop, on the wall clock or a step clock.

Requests are released at their workload arrival times (open loop), or kept ``concurrency`` in
flight (closed loop: a request "arrives" when a slot frees). Between steps the driver aborts
requests whose ``abort_at`` has passed. After each step it records tokens, admissions,
preemptions, resumes and finishes per request, and queue lengths, KV usage and tokens scheduled
per step, into a :class:`~kvbench.core.trace.TraceRecorder`.

Two clocks decide *when* a request is released or aborted:

* **wall clock** (``step_seconds=None``): arrival ``t`` is released once ``t`` seconds have passed
  since the run began. What a step finds in the queue then depends on how fast the machine is,
  so counts (preemptions, recomputed tokens, swaps, prefix hits) vary from run to run. An idle
  engine's next arrival is waited for by sleeping, and the last :data:`ARRIVAL_SPIN_S` of the wait
  by spinning on the clock: a sleep here wakes 0.1-0.4 ms late, which a lone request's TTFT (2-3 ms
  on the tiny model) would otherwise carry as if the engine had spent it.
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
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvbench.core.liveness import DriverWatchdog, Liveness
from kvbench.core.trace import StepRecord, Trace, TraceRecorder

#: the end of an idle engine's wait for its next arrival that the wall-clock driver spins through
#: instead of sleeping (seconds): longer than a sleep here overshoots (0.1-0.4 ms on the 2-core VM).
ARRIVAL_SPIN_S = 0.001

#: tolerance when turning virtual seconds into a step index, so 0.3 / 0.1 counts as step 3, not 2
_EPS = 1e-9


@dataclass
class StepReport:
    """What a steppable engine tells the driver after one step."""

    new_tokens: dict[str, int]  # request id -> tokens produced this step
    finished: dict[str, str | None]  # request id -> finish reason
    admitted: list[str]
    preempted: list[tuple[str, str]]  # (request id, mode)
    resumed: list[str]
    record: StepRecord  # t and duration (and virtual_t on the step clock) are filled in by the driver


class SteppableEngine(Protocol):
    def submit(self, request: Any) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepReport: ...


def step_index(t: float, step_seconds: float) -> int:
    """The step before which virtual time ``t`` (seconds) is reached on a clock of ``step_seconds``."""
    return max(0, math.floor(t / step_seconds + _EPS))


class VirtualClock(Protocol):
    """A simulator's clock (e.g. :class:`reference_engine.sim.pricing_runner.VirtualClock`): seconds that move
    only when the engine works (its steps advance it) or when the driver jumps an idle gap."""

    def now(self) -> float: ...
    def advance_to(self, t: float) -> None: ...


def drive(engine: SteppableEngine, requests: Sequence[Any], recorder: TraceRecorder, concurrency: int | None = None,
          progress: Callable[[int], None] | None = None, idle_sleep: float = 0.001,
          step_seconds: float | None = None, liveness: Liveness | None = None,
          virtual_clock: VirtualClock | None = None) -> None:
    """Serve ``requests`` (WorkloadRequest-like) on ``engine`` until all have finished or been aborted.

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
    if step_seconds is not None:
        if not (isinstance(step_seconds, int | float) and math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"step_seconds must be a positive number of seconds or None, got {step_seconds!r}")
        _drive_step_clock(engine, requests, recorder, concurrency, progress, float(step_seconds), watchdog)
        return
    pending = sorted(requests, key=lambda r: r.arrival_time)
    next_index = 0
    in_flight: dict[str, None] = {}  # requests submitted and not yet finished
    # (abort time, order, request id), soonest first: only requests that will be aborted are ever looked at,
    # so thousands of requests in flight cost nothing per step
    aborts_due: list[tuple[float, int, str]] = []
    recorder.restart_clock()
    while next_index < len(pending) or in_flight:
        now = recorder.now()
        while next_index < len(pending):
            req = pending[next_index]
            if concurrency is not None:
                if len(in_flight) >= concurrency:
                    break
            elif req.arrival_time > now:
                break
            arrival = now if concurrency is not None else req.arrival_time
            recorder.arrived(req.request_id, arrival, len(req.prompt_token_ids), req.max_tokens, req.priority)
            engine.submit(req)
            watchdog.submitted(req.request_id)
            in_flight[req.request_id] = None
            if req.abort_at is not None:
                heapq.heappush(aborts_due, (arrival + req.abort_at, next_index, req.request_id))
            next_index += 1
        _send_aborts(engine, watchdog, aborts_due, in_flight, now)
        if not engine.has_work():
            if next_index < len(pending) and concurrency is None:
                if virtual_clock is not None:  # nothing happens until the next arrival: jump, do not sleep
                    virtual_clock.advance_to(pending[next_index].arrival_time)
                else:
                    _wait_for(pending[next_index].arrival_time, recorder.now, idle_sleep)
            watchdog.idle()  # requests in flight that the engine has no work for: lost, unless it recovers
            continue
        _record_step(engine, recorder, in_flight, progress, virtual_t=None, watchdog=watchdog)


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


def _drive_step_clock(engine: SteppableEngine, requests: Sequence[Any], recorder: TraceRecorder,
                      concurrency: int | None, progress: Callable[[int], None] | None, step_seconds: float,
                      watchdog: DriverWatchdog) -> None:
    """The step-clock loop: releases and aborts keyed by step index, never by the wall clock."""
    # sorted() is stable: requests arriving in the same step are submitted in workload order
    pending = sorted(requests, key=lambda r: r.arrival_time)
    release_at = [0 if concurrency is not None else step_index(r.arrival_time, step_seconds) for r in pending]
    next_index = 0
    k = 0  # the index of the next engine step; virtual time k * step_seconds
    in_flight: dict[str, None] = {}  # requests submitted and not yet finished
    aborts_due: list[tuple[int, int, str]] = []  # (step before which to abort, order, request id), soonest first
    recorder.trace.step_seconds = step_seconds
    recorder.restart_clock()
    while next_index < len(pending) or in_flight:
        while next_index < len(pending):
            req = pending[next_index]
            if concurrency is not None:
                if len(in_flight) >= concurrency:
                    break
            elif release_at[next_index] > k:
                break
            recorder.arrived(req.request_id, recorder.now(), len(req.prompt_token_ids), req.max_tokens, req.priority)
            engine.submit(req)
            watchdog.submitted(req.request_id)
            in_flight[req.request_id] = None
            if req.abort_at is not None:
                heapq.heappush(aborts_due, (k + step_index(req.abort_at, step_seconds), next_index, req.request_id))
            next_index += 1
        _send_aborts(engine, watchdog, aborts_due, in_flight, k)
        if not engine.has_work():
            if next_index < len(pending) and concurrency is None:
                k = max(k, release_at[next_index])  # nothing happens until then: jump, do not sleep
                continue
            if in_flight:
                raise RuntimeError(f"step clock: the engine reports no work but {len(in_flight)} requests never "
                                   f"finished: {sorted(in_flight)[:5]}")
            continue
        _record_step(engine, recorder, in_flight, progress, virtual_t=k * step_seconds, watchdog=watchdog)
        k += 1


def _send_aborts(engine: SteppableEngine, watchdog: DriverWatchdog, aborts_due: list[tuple[Any, int, str]],
                 in_flight: dict[str, None], now: float) -> None:
    """Abort every request whose abort time has come and that is still in flight (each once: the
    engine reports the finish on a later step)."""
    while aborts_due and aborts_due[0][0] <= now:
        _, _, rid = heapq.heappop(aborts_due)
        if rid in in_flight:
            engine.abort(rid)
            watchdog.abort_sent(rid)


def record_scheduling(recorder: TraceRecorder, report: Any, t: float) -> None:
    """Record a step report's admissions, preemptions (with their mode) and resumptions at time ``t``."""
    for rid in report.admitted:
        recorder.admitted(rid, t)
    for rid, mode in report.preempted:
        recorder.preempted(rid, t, mode)
    for rid in report.resumed:
        recorder.resumed(rid, t)


def _record_step(engine: SteppableEngine, recorder: TraceRecorder, in_flight: dict[str, Any],
                 progress: Callable[[int], None] | None, virtual_t: float | None,
                 watchdog: DriverWatchdog | None = None) -> None:
    """Run one engine step and record what it did at the wall-clock time it ended."""
    started = recorder.now()
    report = engine.step()
    t = recorder.now()
    record_scheduling(recorder, report, t)
    for rid, n in report.new_tokens.items():
        recorder.tokens(rid, t, n)
    for rid, reason in report.finished.items():
        recorder.finished(rid, t, reason)
        in_flight.pop(rid, None)
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
