"""Simulator vs measured: how far a simulated engine's figures are from a measured engine's, scenario by scenario.

Contract: :func:`compare_sim_to_measured` reads a :class:`~kvbench.bench.results.Results` and nothing
else. A *simulated* engine is one whose description says ``"simulated": true`` (the ``sim`` adapter's
``describe()``); every other engine is *measured*. Each simulated engine is paired with each measured
engine (one :class:`EnginePairing` per pair of engines), and within a pairing every scenario where both
have a result in the same ``mode`` gives one :class:`ResultPair`:

* timing metrics (:data:`TIMING_METRICS`): the relative error ``|simulated - measured| / measured``;
* counts (:data:`COUNT_METRICS`): whether they are equal.

A pairing then has the median absolute relative error per timing metric and over every timing error
of its results pooled (what the simulator's validation prints: docs/simulator.md#validation-against-the-engine),
and meets the goal (median absolute error <= :data:`ERROR_GOAL` on the timing metrics) when that pooled
median is within it.

Counts are only *expected* to be equal when the simulator released arrivals by engine step
(``clock=step``: the same requests before the same steps as the reference engine on the step clock)
and the measured result was itself on the step clock. Otherwise a difference is shown, not judged:
on the simulated (``cost``) clock arrivals land between different steps and the schedules diverge.

:func:`section` turns the comparison into the plain values the report template shows.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.bench.formatting import fmt_metric, metric_label
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import num

#: metrics compared by relative error
TIMING_METRICS: tuple[str, ...] = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99")
#: metrics that must be equal on the step clock
COUNT_METRICS: tuple[str, ...] = ("preemptions_recompute", "preemptions_swap", "recomputed_tokens")
#: the goal on the median absolute relative error of the timing metrics
ERROR_GOAL = 0.10
#: the clock under which counts are expected equal
STEP_CLOCK = "step"


@dataclass(frozen=True)
class TimingError:
    """One timing metric of one result pair. ``error`` is ``|simulated - measured| / measured``, None
    when either value is missing or the measured one is 0 (no relative error to speak of)."""

    metric: str
    measured: float | None
    simulated: float | None

    @property
    def error(self) -> float | None:
        if self.measured is None or self.simulated is None or self.measured == 0:
            return None
        return abs(self.simulated - self.measured) / abs(self.measured)


@dataclass(frozen=True)
class CountMatch:
    """One count of one result pair. ``equal`` is None when either side did not record it."""

    metric: str
    measured: float | None
    simulated: float | None

    @property
    def equal(self) -> bool | None:
        if self.measured is None or self.simulated is None:
            return None
        return self.measured == self.simulated


@dataclass(frozen=True)
class ResultPair:
    """A scenario's result in one mode, simulated and measured. ``counts_expected_equal``: the simulator
    was on the step clock and the measured result not on the wall clock (see the module docstring)."""

    scenario: str
    mode: str | None
    timings: tuple[TimingError, ...]
    counts: tuple[CountMatch, ...]
    counts_expected_equal: bool
    measured_clock: str | None


@dataclass(frozen=True)
class EnginePairing:
    """One simulated engine against one measured engine, over every scenario and mode both ran.

    ``sim_clock`` is the simulator's clock as described (``"step"``, ``"cost"``), None when unstated.
    """

    simulated: str
    measured: str
    sim_clock: str | None
    pairs: tuple[ResultPair, ...]

    @property
    def step_clock(self) -> bool:
        return self.sim_clock == STEP_CLOCK

    def errors(self, metric: str | None = None) -> list[float]:
        """Every relative error of ``metric`` (every timing metric when None), in result order."""
        return [t.error for p in self.pairs for t in p.timings
                if t.error is not None and (metric is None or t.metric == metric)]

    def median_error(self, metric: str | None = None) -> float | None:
        """Median absolute relative error of ``metric`` over the pairs (pooled over every timing metric
        when None); None when no pair has that error."""
        errors = self.errors(metric)
        return statistics.median(errors) if errors else None

    @property
    def goal_met(self) -> bool | None:
        """The pooled median error is within :data:`ERROR_GOAL`; None when there is no timing error."""
        median = self.median_error()
        return None if median is None else median <= ERROR_GOAL

    @property
    def counts_differing(self) -> list[tuple[ResultPair, CountMatch]]:
        """Counts that differ where they are expected equal (a failure of the simulator)."""
        return [(p, c) for p in self.pairs if p.counts_expected_equal for c in p.counts if c.equal is False]

    @property
    def counts_equal(self) -> bool | None:
        """Every count expected equal is; None when no count was expected equal (or none recorded)."""
        judged = [c.equal for p in self.pairs if p.counts_expected_equal for c in p.counts if c.equal is not None]
        return all(judged) if judged else None


def engine_clock(engine: Mapping[str, Any]) -> str | None:
    """The clock a simulated engine released arrivals by: its description's ``clock``, else its options',
    else a ``clock=`` in its name (``sim:hardware=...,clock=step``); None when none says."""
    clock = engine.get("clock") or (engine.get("options") or {}).get("clock")
    if clock:
        return str(clock)
    _, _, options = str(engine.get("name", "")).partition(":")
    for item in options.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "clock" and value.strip():
            return value.strip()
    return None


def _pair(scenario: str, sim: Mapping[str, Any], meas: Mapping[str, Any], step_clock: bool) -> ResultPair:
    sm, mm = sim.get("metrics") or {}, meas.get("metrics") or {}
    measured_clock = (meas.get("clock") or {}).get("clock")
    return ResultPair(
        scenario=scenario, mode=meas.get("mode"),
        timings=tuple(TimingError(k, num(mm.get(k)), num(sm.get(k))) for k in TIMING_METRICS),
        counts=tuple(CountMatch(k, num(mm.get(k)), num(sm.get(k))) for k in COUNT_METRICS),
        counts_expected_equal=step_clock and measured_clock != "wall", measured_clock=measured_clock)


#: options of the sim adapter that say how to simulate, not how the engine is configured
SIM_ONLY_OPTIONS = frozenset({"hardware", "model", "clock", "fast"})
#: options of the reference adapter that place or pace the engine without changing its schedule
PLACEMENT_OPTIONS = frozenset({"device", "attention_backend", "linear_backend", "elementwise_backend",
                               "kv_cache_space", "step_delay_ms"})


def comparable(sim: Mapping[str, Any], measured: Mapping[str, Any]) -> bool:
    """Whether ``sim`` simulates ``measured``: the simulator is the reference engine's scheduler, so only a
    ``reference`` engine configured alike (the same options once the simulator's own and the placement
    ones are left out) is one it ran; a swap-mode engine beside a recompute simulator, or another
    engine's kind, is not judged against it."""
    kind = measured.get("kind") or str(measured.get("name", "")).split(":", 1)[0]
    if kind != "reference":
        return False
    config = {k: str(v) for k, v in (sim.get("options") or {}).items() if k not in SIM_ONLY_OPTIONS}
    other = {k: str(v) for k, v in (measured.get("options") or {}).items() if k not in PLACEMENT_OPTIONS}
    return config == other


def compare_sim_to_measured(results: Results) -> list[EnginePairing] | None:
    """Every (simulated engine, measured engine) pair the simulator ran (:func:`comparable`) with at least
    one scenario and mode in common, in the order the engines are listed; None when there is no such pair
    (the report then shows no section)."""
    engines = {e["name"]: e for e in results.engines}
    simulated = [n for n, e in engines.items() if e.get("simulated")]
    measured = [n for n, e in engines.items() if not e.get("simulated")]
    pairings = []
    for sim in simulated:
        clock = engine_clock(engines[sim])
        for meas in (m for m in measured if comparable(engines[sim], engines[m])):
            pairs = []
            for sc in results.scenarios:
                sims = {r.get("mode"): r for r in sc["results"] if r["engine"] == sim}
                pairs += [_pair(sc["name"], sims[r.get("mode")], r, clock == STEP_CLOCK)
                          for r in sc["results"] if r["engine"] == meas and r.get("mode") in sims]
            if pairs:
                pairings.append(EnginePairing(sim, meas, clock, tuple(pairs)))
    return pairings or None


# --------------------------------------------------------------------------------------------
# the report's view


def _pct(value: float | None) -> str:
    # one decimal, so a median just past the goal (10.04%) does not read as the goal itself
    return "n/a" if value is None else f"{value:.1%}"


def _signed_pct(timing: TimingError) -> str:
    """The error with its direction: "+12%" when the simulator says more than was measured, "−12%" less."""
    if timing.error is None:
        return "n/a"
    above = (timing.simulated or 0.0) >= (timing.measured or 0.0)
    return ("+" if above else "−") + f"{timing.error:.0%}"


def _error_class(error: float | None) -> str:
    return "" if error is None else ("good" if error <= ERROR_GOAL else "bad")


def _count_cell(pair: ResultPair, count: CountMatch) -> dict[str, str]:
    measured, simulated = fmt_metric(count.metric, count.measured), fmt_metric(count.metric, count.simulated)
    if count.equal is None:
        return {"text": f"{measured} / {simulated}", "cls": "na", "tip": "not recorded on one side"}
    sign = "=" if count.equal else "≠"
    if not pair.counts_expected_equal:
        return {"text": f"{measured} {sign} {simulated}", "cls": "same",
                "tip": "not expected equal off the step clock"}
    return {"text": f"{measured} {sign} {simulated}", "cls": "good" if count.equal else "bad",
            "tip": "equal, as expected on the step clock" if count.equal else "differs on the step clock"}


def section(results: Results) -> list[dict[str, Any]] | None:
    """The "Simulator vs measured" section as plain values for the template (one dict per engine
    pairing, every figure already formatted); None when :func:`compare_sim_to_measured` finds no pair."""
    pairings = compare_sim_to_measured(results)
    if pairings is None:
        return None
    views = []
    for g in pairings:
        rows = [{"scenario": p.scenario, "mode": p.mode,
                 "timings": [{"measured": fmt_metric(t.metric, t.measured),
                              "simulated": fmt_metric(t.metric, t.simulated),
                              "error": _signed_pct(t), "cls": _error_class(t.error)} for t in p.timings],
                 "counts": [_count_cell(p, c) for c in p.counts]} for p in g.pairs]
        medians = [{"text": _pct(g.median_error(k)), "cls": _error_class(g.median_error(k))}
                   for k in TIMING_METRICS]
        off_step = [p for p in g.pairs if not p.counts_expected_equal]
        if not g.step_clock:
            counts_note = (f"counts are only expected to be equal on the step clock; this simulator ran on the "
                           f"{g.sim_clock or 'unstated'} clock, so differences are shown, not judged")
        elif off_step:
            counts_note = (f"{len(off_step)} measured result(s) were on the wall clock: their counts are shown, "
                           "not judged")
        else:
            counts_note = ""
        differing = [f"{p.scenario}{f' [{p.mode}]' if p.mode else ''}: {metric_label(c.metric)}"
                     for p, c in g.counts_differing]
        failed = g.goal_met is False or g.counts_equal is False
        views.append({
            "banner": "bad" if failed else ("good" if g.goal_met else ""),
            "simulated": g.simulated, "measured": g.measured, "clock": g.sim_clock or "not stated",
            "step_clock": g.step_clock, "median": _pct(g.median_error()), "goal": _pct(ERROR_GOAL),
            "goal_met": g.goal_met, "counts_equal": g.counts_equal, "counts_note": counts_note,
            "differing": differing, "timing_labels": [metric_label(k) for k in TIMING_METRICS],
            "count_labels": [metric_label(k) for k in COUNT_METRICS], "medians": medians, "rows": rows,
            "results": len(g.pairs)})
    return views
