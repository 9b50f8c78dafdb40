"""Serving several in-process engines in lockstep: one step of each in turn, each timed on its own clock.

Why: a same-run ratio (engine / reference engine, what the gate compares) cancels the machine's
load only if both engines see the same load. On a shared 2-core machine the load moves within
seconds, so even serving one engine's job right after the other's left per-repeat throughput ratios
widely spread (docs/journal/measurements.md#lockstep). In lockstep the engines take turns step
by step (milliseconds apart), so a busy second hits both alike.

How (:func:`serve_lockstep`): each engine's ``adapter.serve`` runs on its own thread, but only the
thread holding the :class:`Baton` runs; the others wait. A participant passes the baton on after
every engine step (:class:`LockstepRecorder` does it when the driver records the step), so the
engines alternate step by step; one that finishes leaves the rotation. Every time a participant
records is read from its :class:`OwnClock`: the wall clock less the time it spent waiting for the
baton. So each trace's TTFT, TBT, throughput and durations measure that engine's own work (the
steps and the driver between them) as if it had run alone, on a machine as loaded as the others
found it. Counts do not depend on it: on the step clock arrivals are released by step index.

Contract: only adapters that drive their engine from the calling thread and record every step
through the recorder (``steppable`` adapters, whose ``serve`` runs
:func:`kvbench.drivers.step_loop.drive`) may be served in lockstep; an adapter that records from
other threads (hf-cb) must be served alone. Exactly one participant runs at any moment, so a
recorder is never used from two threads at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from kvbench.core.trace import StepRecord, Trace, TraceRecorder


class Baton:
    """Turn-taking among named participants: the head of the rotation runs, the others wait."""

    def __init__(self, names: list[str]):
        self._cond = threading.Condition()
        self._rotation: deque[str] = deque(names)

    def wait_turn(self, name: str) -> None:
        """Block until ``name`` holds the baton."""
        with self._cond:
            self._cond.wait_for(lambda: self._rotation and self._rotation[0] == name)

    def pass_on(self, name: str) -> None:
        """``name`` (the holder) moves to the back of the rotation and the next participant runs."""
        with self._cond:
            if self._rotation and self._rotation[0] == name:
                self._rotation.rotate(-1)
                self._cond.notify_all()

    def leave(self, name: str) -> None:
        """``name`` is done: it leaves the rotation (passing the baton on if it held it)."""
        with self._cond:
            if name in self._rotation:
                self._rotation.remove(name)
                self._cond.notify_all()


class OwnClock:
    """``time.perf_counter`` less the seconds its participant spent waiting for the baton."""

    def __init__(self) -> None:
        self.away = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.away


class LockstepRecorder(TraceRecorder):
    """A :class:`~kvbench.core.trace.TraceRecorder` on an :class:`OwnClock` that passes the baton on
    after every recorded step and waits for its next turn, the wait left out of its clock."""

    def __init__(self, engine: str, scenario: str, name: str, baton: Baton):
        self.own_clock = OwnClock()
        super().__init__(engine, scenario, clock=self.own_clock)
        self.name, self.baton = name, baton

    def step(self, record: StepRecord) -> None:
        super().step(record)
        left = time.perf_counter()
        self.baton.pass_on(self.name)
        self.baton.wait_turn(self.name)
        self.own_clock.away += time.perf_counter() - left


#: serve one participant: (its recorder) -> None; it must record its steps through the recorder
Serve = Callable[[TraceRecorder], None]


def serve_lockstep(participants: Mapping[str, tuple[str, str, Serve]]) -> dict[str, Trace | Exception]:
    """Serve every participant in lockstep (see the module docstring); returns each one's trace
    (``recorder.finish()``, after its serve returned) or the exception its serve raised.

    ``participants``: name -> (engine name, scenario name, serve function). The rotation follows
    the mapping's order: the first participant takes the first step.
    """
    names = list(participants)
    baton = Baton(names)
    results: dict[str, Trace | Exception] = {}

    def run(name: str) -> None:
        engine, scenario, serve = participants[name]
        recorder = LockstepRecorder(engine, scenario, name, baton)
        baton.wait_turn(name)
        try:
            serve(recorder)
            results[name] = recorder.finish()
        except Exception as e:  # handed to the caller, per participant; the others go on
            results[name] = e
        finally:
            baton.leave(name)

    threads = [threading.Thread(target=run, args=(name,), name=f"kvbench-lockstep-{name}", daemon=True)
               for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
