"""Liveness: a deadline and a no-progress watchdog for the loops that drive an engine.

An engine that stops making progress under pressure (a livelock, a deadlock, a request it lost)
must fail the check that drove it, quickly and by name, instead of hanging the suite. Every
engine-driving loop (:func:`kvbench.drivers.step_loop.drive`, an adapter's ``generate`` loop) feeds a
:class:`Watchdog` after each step with the work done so far (tokens sampled plus prompt tokens
computed: a long prefill split in many chunks is progress) and the state of every request still
in flight. Progress is more work or any change of those states (admitted, preempted, resumed,
finished). With no progress for ``stall_steps`` steps or ``stall_seconds`` seconds, or
past the ``deadline`` of the whole run, the watchdog raises :class:`LivenessError` naming the
stuck requests and their states.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Liveness:
    """Limits of one engine run. ``None`` turns a limit off.

    ``stall_steps``: steps without progress; ``stall_seconds``: seconds without progress;
    ``deadline``: seconds for the whole run (one ``generate`` or ``serve`` call).
    """

    stall_steps: int | None = 200
    stall_seconds: float | None = 60.0
    deadline: float | None = None

    def __post_init__(self) -> None:
        for name in ("stall_steps", "stall_seconds", "deadline"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"Liveness.{name}={value!r} is invalid: expected a positive number or None (off)")


#: The defaults every adapter uses unless the plugin (``--kvbench-deadline``, ``--kvbench-stall-steps``,
#: ``--kvbench-stall-seconds``) or the caller sets its own.
DEFAULT_LIVENESS = Liveness()


class LivenessError(RuntimeError):
    """An engine stopped making progress (or ran past its deadline).

    ``stuck`` maps each request still in flight to its state in the engine's words.
    """

    def __init__(self, why: str, stuck: Mapping[str, str]):
        self.why = why
        self.stuck = dict(stuck)
        shown = ", ".join(f"{rid} ({state})" for rid, state in list(self.stuck.items())[:20])
        more = f" and {len(self.stuck) - 20} more" if len(self.stuck) > 20 else ""
        super().__init__(f"no progress: {why}; {len(self.stuck)} request(s) stuck: {shown}{more}")


class Watchdog:
    """Call :meth:`observe` once per engine step (or idle turn of a driving loop)."""

    def __init__(self, liveness: Liveness | None = None, clock: Callable[[], float] = time.monotonic):
        self.liveness = liveness or DEFAULT_LIVENESS
        self._clock = clock
        self._started = self._last_progress = clock()
        self._signature: tuple | None = None
        self._idle_steps = 0

    def observe(self, work: int, states: Mapping[str, str], version: int | None = None) -> None:
        """``work``: tokens sampled plus tokens computed so far (cumulative); ``states``: request id
        -> state of every request in flight; ``version``: a number that changes whenever ``states``
        does, when the caller keeps one (it spares comparing every state each step: thousands of
        requests in flight made that the driver's main cost). Raises :class:`LivenessError` when a
        limit is passed."""
        now = self._clock()
        signature = (work, version if version is not None else tuple(sorted(states.items())))
        if signature != self._signature:
            self._signature, self._last_progress, self._idle_steps = signature, now, 0
        else:
            self._idle_steps += 1
        lv = self.liveness
        if lv.deadline is not None and now - self._started > lv.deadline:
            raise LivenessError(f"the run passed its deadline of {lv.deadline:g} s", states)
        if not states:
            return
        if lv.stall_steps is not None and self._idle_steps >= lv.stall_steps:
            raise LivenessError(f"no token and no state change for {self._idle_steps} steps "
                                f"(limit {lv.stall_steps})", states)
        if lv.stall_seconds is not None and now - self._last_progress > lv.stall_seconds:
            raise LivenessError(f"no token and no state change for {now - self._last_progress:.1f} s "
                                f"(limit {lv.stall_seconds:g} s)", states)


class DriverWatchdog(Watchdog):
    """A :class:`Watchdog` that follows request states itself from what a step driver sees:
    submissions, aborts sent, and each step's report (admitted, preempted, resumed, new tokens,
    prefill tokens, finished)."""

    def __init__(self, liveness: Liveness | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(liveness, clock)
        self.states: dict[str, str] = {}
        self.work = 0
        self.version = 0  # bumped on every change of ``states``

    def submitted(self, request_id: str) -> None:
        self.states[request_id] = "waiting"
        self.version += 1

    def abort_sent(self, request_id: str) -> None:
        if request_id in self.states:
            self.states[request_id] += ", abort requested"
            self.version += 1

    def saw_step(self, report: Any) -> None:
        """``report``: a :class:`kvbench.drivers.step_loop.StepReport`."""
        for rid in report.admitted:
            self.states[rid] = "running"
        for rid, mode in report.preempted:
            self.states[rid] = f"preempted ({mode})"
        for rid in report.resumed:
            self.states[rid] = "running"
        for rid in report.finished:
            self.states.pop(rid, None)
        if report.admitted or report.preempted or report.resumed or report.finished:
            self.version += 1
        self.work += sum(report.new_tokens.values()) + int(getattr(report.record, "num_prefill_tokens", 0) or 0)
        self.observe(self.work, self.states, self.version)

    def idle(self) -> None:
        """A turn of the driving loop in which the engine had no work."""
        self.observe(self.work, self.states, self.version)
