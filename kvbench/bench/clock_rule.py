"""One clock per comparison: which clock a benchmark session runs every engine on, decided once.

Two clocks exist (:mod:`kvbench.drivers.step_loop`): on the **step clock** arrivals are released by
engine step, so a deterministic engine's counts repeat exactly (what the regression gate compares
exactly); on the **wall clock** arrivals are released by elapsed seconds, as a real server meets them.
Figures from the two are not like for like: on the step clock an engine that steps fast meets the same
requests sooner and its idle gaps are jumped, so its throughput, TTFT and even its preemptions answer
another question than a wall-clock engine's.

The rule (:func:`session_clock`), applied once per session to every ``--engine`` given:

* every engine can be stepped from outside (``steppable``: the in-process reference engine, the
  simulator) -> all on the **step clock** (exact counts: gating among step-clock runs and baselines);
* otherwise (a server, ``hf-cb`` with its own loop thread) -> all on the **wall clock**, arrivals in
  seconds, the in-process engines timed on the wall as well, so that every engine of the run is
  ranked against every other on every scenario they share.

The decision is recorded in results.json (top-level ``"clock_rule"``, :meth:`ClockRule.to_dict`) and
stated in the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the rule in one sentence, as results.json and the report state it
RULE = ("one clock per session: every engine on the step clock when all of them can be stepped from outside "
        "(exact, repeatable counts); otherwise every engine on the wall clock with arrivals in seconds, so "
        "that all of them are compared on one clock")


@dataclass(frozen=True)
class ClockRule:
    """The clock every engine of a session runs on. ``step_seconds`` is None on the wall clock."""

    clock: str  # "step" or "wall"
    step_seconds: float | None
    why: str
    engines: tuple[str, ...] = ()
    not_steppable: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"clock": self.clock, "step_seconds": self.step_seconds, "rule": RULE, "why": self.why,
                "engines": list(self.engines), "not_steppable": list(self.not_steppable)}


def session_clock(steppable: Mapping[str, bool], step_seconds: float) -> ClockRule:
    """The clock for a session whose engines are ``steppable`` (engine name -> whether kvbench can step
    it from outside), ``step_seconds`` virtual seconds per step if that is the step clock.

    Raises ValueError for no engines or a non-positive ``step_seconds``."""
    if not steppable:
        raise ValueError("session_clock needs at least one engine")
    if not step_seconds > 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds!r}")
    engines = tuple(steppable)
    walled = tuple(name for name, can in steppable.items() if not can)
    if not walled:
        return ClockRule("step", float(step_seconds),
                         f"every engine can be stepped from outside: arrivals by engine step "
                         f"({step_seconds:g} s of workload time per step), counts exact", engines)
    return ClockRule("wall", None,
                     f"{', '.join(walled)} cannot be stepped from outside, so every engine runs on the wall "
                     "clock (arrivals in seconds) and all are compared on one clock", engines, walled)
