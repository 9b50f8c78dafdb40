"""Releasing a workload: which request goes to the engine when, and when each is aborted.

One rule, used by every timed driver (:mod:`~kvbench.drivers.step_loop` on the wall clock or the step
clock, :mod:`~kvbench.drivers.http_driver` over HTTP), so that the same workload means the same thing
to every engine:

* **open loop** (``concurrency=None``): a request is released once the driver's clock reaches its
  arrival time's *point* on that clock (the arrival in seconds on the wall clock; the step index on
  the step clock, :func:`step_index`). Requests arriving together go out in workload order;
* **closed loop** (``concurrency=N``): ``N`` requests are kept in flight; the next one (in workload
  order) is released at the moment a slot frees, and that moment is its arrival;
* **aborts**: a request with ``abort_at`` is aborted ``abort_at`` seconds (their point on the clock)
  after its release point, if it is still in flight then; each is aborted once.

A polling driver (the step loop) asks :meth:`ReleaseSchedule.release_due` and
:meth:`ReleaseSchedule.aborts_due` between engine steps; a driver that waits on timers (asyncio)
takes every open-loop release with its point at once (:meth:`ReleaseSchedule.planned`) and sets one
timer per request. Both record arrivals with :func:`record_arrival` and report finishes with
:meth:`ReleaseSchedule.finished`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.core.trace import TraceRecorder

#: tolerance when turning virtual seconds into a step index, so 0.3 / 0.1 counts as step 3, not 2
_EPS = 1e-9


def step_index(t: float, step_seconds: float) -> int:
    """The step before which virtual time ``t`` (seconds) is reached on a clock of ``step_seconds``."""
    return max(0, math.floor(t / step_seconds + _EPS))


def _seconds(t: float) -> float:
    return t


@dataclass(frozen=True)
class Release:
    """One request let out: ``at`` is its release point on the schedule's clock (open loop: its
    arrival's point; closed loop: the moment its slot freed); ``abort_due`` the point from which it is
    to be aborted (None: never)."""

    request: Any
    at: float
    abort_due: float | None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class ReleaseSchedule:
    """A workload's requests (WorkloadRequest-like: ``request_id``, ``arrival_time``, ``abort_at``), in
    release order, and the requests in flight (released, not yet reported finished).

    ``concurrency``: None for the open loop, else the closed loop's slots (an int >= 1; ValueError
    otherwise). ``to_point``: maps seconds of the workload onto the driver's clock (identity for
    seconds; ``lambda t: step_index(t, s)`` for the step clock); arrival times and ``abort_at`` both go
    through it.
    """

    def __init__(self, requests: Sequence[Any], concurrency: int | None = None,
                 to_point: Callable[[float], float] = _seconds):
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                        or concurrency < 1):
            raise ValueError(f"concurrency must be None (open loop) or an int >= 1 (closed loop), "
                             f"got {concurrency!r}")
        # sorted() is stable: requests arriving together are released in workload order
        self._pending = sorted(requests, key=lambda r: r.arrival_time)
        self._points = [to_point(r.arrival_time) for r in self._pending] if concurrency is None else []
        self._next = 0  # the index of the next request to release
        self._to_point = to_point
        self.concurrency = concurrency
        self.in_flight: dict[str, None] = {}  # released and not yet finished, in release order
        # (abort point, release order, request id), soonest first: only requests that will be aborted are
        # ever looked at, so thousands of requests in flight cost nothing per step
        self._aborts: list[tuple[float, int, str]] = []

    @property
    def done(self) -> bool:
        """Every request released and finished."""
        return self._next >= len(self._pending) and not self.in_flight

    def next_point(self) -> float | None:
        """The open loop's next release point (what an idle engine's driver waits or jumps to); None in
        the closed loop (a finish releases the next) or when every request is out."""
        if self.concurrency is not None or self._next >= len(self._pending):
            return None
        return self._points[self._next]

    def _release(self, at: float) -> Release:
        req = self._pending[self._next]
        abort_at = getattr(req, "abort_at", None)
        release = Release(req, at, None if abort_at is None else at + self._to_point(abort_at))
        self.in_flight[req.request_id] = None
        if release.abort_due is not None:
            heapq.heappush(self._aborts, (release.abort_due, self._next, req.request_id))
        self._next += 1
        return release

    def release_due(self, now: float) -> list[Release]:
        """Let out every request the rule releases at ``now`` (a point on the schedule's clock), in order."""
        out = []
        while self._next < len(self._pending):
            if self.concurrency is not None:
                if len(self.in_flight) >= self.concurrency:
                    break
                out.append(self._release(now))
            elif self._points[self._next] > now:
                break
            else:
                out.append(self._release(self._points[self._next]))
        return out

    def planned(self) -> list[Release]:
        """Open loop only: every request not yet out, each at its own release point, for a driver that
        waits for each on its own timer (it must not send one before its ``at``). ValueError in the
        closed loop, whose releases depend on finishes."""
        if self.concurrency is not None:
            raise ValueError("planned(): a closed-loop schedule releases on finishes; use release_due(now)")
        return [self._release(self._points[self._next]) for _ in range(self._next, len(self._pending))]

    def aborts_due(self, now: float) -> list[str]:
        """The ids of the requests whose abort point has come by ``now`` and that are still in flight,
        each returned once (the engine reports their finish later)."""
        out = []
        while self._aborts and self._aborts[0][0] <= now:
            _, _, rid = heapq.heappop(self._aborts)
            if rid in self.in_flight:
                out.append(rid)
        return out

    def finished(self, request_id: str) -> None:
        """``request_id`` finished (or was aborted, or failed): its slot frees. Unknown ids are ignored
        (an engine may report a request finished twice: the trace counts that, not the schedule)."""
        self.in_flight.pop(request_id, None)


def record_arrival(recorder: TraceRecorder, request: Any, t: float) -> None:
    """Record ``request``'s arrival at trace time ``t``, with what the trace keeps of it."""
    recorder.arrived(request.request_id, t, len(request.prompt_token_ids), request.max_tokens,
                     getattr(request, "priority", 0))
