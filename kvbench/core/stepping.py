"""The timed driver for in-process engines that expose a step loop.

Requests are released at their workload arrival times on the wall clock (open loop), or kept
``concurrency`` in flight (closed loop: a request "arrives" when a slot frees). Between steps the
driver aborts requests whose ``abort_at`` has passed. After each step it records tokens,
admissions, preemptions, resumes and finishes per request, and queue lengths, KV usage and
tokens scheduled per step, into a :class:`~kvbench.core.trace.TraceRecorder`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvbench.core.trace import StepRecord, TraceRecorder


@dataclass
class StepReport:
    """What a steppable engine tells the driver after one step."""

    new_tokens: dict[str, int]  # request id -> tokens produced this step
    finished: dict[str, str | None]  # request id -> finish reason
    admitted: list[str]
    preempted: list[tuple[str, str]]  # (request id, mode)
    resumed: list[str]
    record: StepRecord  # t and duration are filled in by the driver


class SteppableEngine(Protocol):
    def submit(self, request: Any) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepReport: ...


def drive(engine: SteppableEngine, requests: Sequence[Any], recorder: TraceRecorder, concurrency: int | None = None,
          progress: Callable[[int], None] | None = None, idle_sleep: float = 0.001) -> None:
    """Serve ``requests`` (WorkloadRequest-like) on ``engine`` until all have finished or been aborted."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    next_index = 0
    in_flight: dict[str, float | None] = {}  # request id -> absolute abort deadline
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
            in_flight[req.request_id] = None if req.abort_at is None else arrival + req.abort_at
            next_index += 1
        for rid, deadline in list(in_flight.items()):
            if deadline is not None and deadline <= now:
                engine.abort(rid)
        if not engine.has_work():
            if next_index < len(pending) and concurrency is None:
                time.sleep(max(0.0, min(pending[next_index].arrival_time - recorder.now(), 0.05)) or idle_sleep)
            continue
        started = recorder.now()
        report = engine.step()
        t = recorder.now()
        for rid in report.admitted:
            recorder.admitted(rid, t)
        for rid, mode in report.preempted:
            recorder.preempted(rid, t, mode)
        for rid in report.resumed:
            recorder.resumed(rid, t)
        for rid, n in report.new_tokens.items():
            recorder.tokens(rid, t, n)
        for rid, reason in report.finished.items():
            recorder.finished(rid, t, reason)
            in_flight.pop(rid, None)
            if progress is not None:
                progress(1)
        report.record.t, report.record.duration = t, t - started
        recorder.step(report.record)
