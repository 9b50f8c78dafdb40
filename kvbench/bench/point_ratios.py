"""One engine against another at every point of a scenario's sweep, from a saved results file.

What ``kvbench ratios RESULTS.json`` prints: for each sweep point (and variant ``mode``) both engines
served, and each metric asked, the ratio of the two engines' medians and the ratio round by round
(repeat i of one engine against repeat i of the other: a benchmark serves the engines of a point
interleaved, round by round, so each such ratio compares two measurements taken seconds apart), shown
as median [min-max] over the rounds, with each engine's own rounds' relative range beside it, so that
noise and a real gap are told apart.

Direction: > 1 always means the engine is ahead of the baseline. A metric where higher is better
(:data:`kvbench.bench.gate.HIGHER_IS_BETTER`: throughputs, hit rates) gives ``engine / baseline``; any
other (times, counts of preemptions) gives ``baseline / engine``. Nothing is re-run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.bench.formatting import fmt_median_range, fmt_share
from kvbench.bench.gate import HIGHER_IS_BETTER, paired_ratios
from kvbench.bench.metrics import GOODPUT_KEYS, METRIC_KEYS
from kvbench.bench.repeats import relative_range, repeat_values
from kvbench.bench.results import Results

#: the metrics compared when none are named
DEFAULT_METRICS: tuple[str, ...] = ("output_throughput", "ttft_p50")


@dataclass(frozen=True)
class PointRatio:
    """One metric at one sweep point: the two engines' medians, their ratios, and how far each engine's
    rounds lay apart (:func:`kvbench.bench.repeats.relative_range`; None with fewer than two rounds)."""

    x: float
    mode: str | None
    metric: str
    baseline: float
    engine: float
    ratio_of_medians: float
    round_ratios: tuple[float, ...]
    baseline_range: float | None
    engine_range: float | None

    @property
    def median_round_ratio(self) -> float:
        """The median of the round-by-round ratios; the ratio of medians when the rounds do not pair up
    (:func:`kvbench.bench.gate.paired_ratios`: fewer than two, or not as many on each side)."""
        return statistics.median(self.round_ratios) if self.round_ratios else self.ratio_of_medians


def ahead_ratio(metric: str, baseline: float, engine: float) -> float:
    """How far ``engine`` is ahead of ``baseline`` on ``metric`` (> 1: ahead), in the metric's direction;
    NaN when the denominator is 0."""
    num, den = (engine, baseline) if metric in HIGHER_IS_BETTER else (baseline, engine)
    return num / den if den else math.nan


def _rounds(point: Mapping[str, Any], metric: str) -> list[float]:
    """The point's value of ``metric`` in each round (:func:`kvbench.bench.repeats.repeat_values`), or its one
    stored value when it has no repeats."""
    values = repeat_values(point, metric)
    if values:
        return values
    stored = (point.get("metrics") or {}).get(metric)
    return [float(stored)] if isinstance(stored, int | float) and math.isfinite(stored) else []


def _sweep(results: Results, scenario: str, sweep: str | None) -> dict[str, Any]:
    """The sweep named ``sweep`` of ``scenario`` (None: its first); ValueError naming what there is."""
    found = [s for s in results.scenarios if s.get("name") == scenario]
    if not found:
        names = ", ".join(s.get("name", "?") for s in results.scenarios)
        raise ValueError(f"--scenario {scenario!r}: not in these results (they hold: {names or 'no scenario'})")
    sweeps = found[0].get("sweeps") or []
    if not sweeps:
        raise ValueError(f"--scenario {scenario!r} has no sweep: its points are what the ratios compare")
    if sweep is None:
        return sweeps[0]
    for candidate in sweeps:
        if candidate.get("name") == sweep:
            return candidate
    raise ValueError(f"--sweep {sweep!r}: scenario {scenario!r} has the sweeps "
                     f"{', '.join(s.get('name', '?') for s in sweeps)}")


def known_metrics(results: Results, scenario: str, sweep: str | None = None) -> list[str]:
    """The metric keys a sweep can be compared on: every key a benchmark records
    (:data:`kvbench.bench.metrics.METRIC_KEYS`, :data:`~kvbench.bench.metrics.GOODPUT_KEYS`), then any other
    key the sweep's points hold (a scenario's own figures, e.g. the crossover's ``cost_s``). ValueError as
    :func:`point_ratios` for an unknown scenario or sweep."""
    own = {key for point in _sweep(results, scenario, sweep)["points"] for key in point.get("metrics") or {}}
    recorded = [*METRIC_KEYS, *GOODPUT_KEYS]
    return recorded + sorted(own - set(recorded))


def sweep_engines(results: Results, scenario: str, sweep: str | None = None) -> list[str]:
    """The engines with a point in the sweep, in the order they first appear."""
    return list(dict.fromkeys(p["engine"] for p in _sweep(results, scenario, sweep)["points"]))


def point_ratios(results: Results, scenario: str, baseline: str, engine: str, metrics: Sequence[str],
                 *, sweep: str | None = None, mode: str | None = None) -> list[PointRatio]:
    """Every point (x, mode) of the sweep both engines served, for every metric both have there, in
    order of mode then x. ``mode``: only that variant's points. ValueError naming what is missing (the
    scenario, the sweep, an engine, the mode)."""
    points = _sweep(results, scenario, sweep)["points"]
    by_engine: dict[str, dict[tuple[str, float], Mapping[str, Any]]] = {}
    for point in points:
        if mode is None or point.get("mode") == mode:
            by_engine.setdefault(point["engine"], {})[(point.get("mode") or "", float(point["x"]))] = point
    if mode is not None and not by_engine:
        modes = sorted({str(p.get("mode")) for p in points})
        raise ValueError(f"--mode {mode!r}: no point of {scenario!r} has it (modes: {', '.join(modes)})")
    for name, flag in ((baseline, "--baseline"), (engine, "--engine")):
        if name not in by_engine:
            raise ValueError(f"{flag} {name!r} has no point in {scenario!r} "
                             f"(engines with points: {', '.join(by_engine) or 'none'})")
    out = []
    for key in sorted(set(by_engine[baseline]) & set(by_engine[engine])):
        a, b = by_engine[baseline][key], by_engine[engine][key]
        for metric in metrics:
            va, vb = _rounds(a, metric), _rounds(b, metric)
            if not va or not vb:
                continue
            # round i with round i (the gate's pairing: none unless both have the same rounds, two or more)
            paired = paired_ratios(b, a, metric) if metric in HIGHER_IS_BETTER else paired_ratios(a, b, metric)
            rounds = tuple(paired or ())
            ma, mb = statistics.median(va), statistics.median(vb)
            out.append(PointRatio(key[1], key[0] or None, metric, ma, mb, ahead_ratio(metric, ma, mb), rounds,
                                  relative_range(va), relative_range(vb)))
    return out


def below(ratios: Sequence[PointRatio], at_least: float) -> list[PointRatio]:
    """The ratios whose median round ratio is under ``at_least`` (a NaN ratio counts as under)."""
    return [r for r in ratios if not r.median_round_ratio >= at_least]


def ratios_table(ratios: Sequence[PointRatio], baseline: str, engine: str) -> str:
    """The ratios as a Markdown table, a heading line first saying the direction. A figure that is missing
    (a range of fewer than two rounds, round ratios that do not pair up) reads "n/a"; the mode column reads "-"
    for a point that has no variant (not a missing figure)."""
    base_col, engine_col = baseline.replace("|", "/"), engine.replace("|", "/")
    lines = [f"{engine} against {baseline} (> 1: {engine} ahead; higher-is-better metrics {engine}/{baseline}, "
             f"others {baseline}/{engine})",
             # the columns name both engines (a "|" in a name would end a cell)
             f"| point | mode | metric | {base_col} | {engine_col} | ratio of medians | "
             f"ratio by round: median [min-max] | rounds' range {base_col} / {engine_col} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        lines.append(f"| {r.x:g} | {r.mode or '-'} | {r.metric} | {r.baseline:.4g} | {r.engine:.4g} | "
                     f"{r.ratio_of_medians:.2f} | {fmt_median_range(r.round_ratios, '{:.2f}')} | "
                     f"{fmt_share(r.baseline_range)} / {fmt_share(r.engine_range)} |")
    return "\n".join(lines)
