"""One engine against another at every point of a benchmark's sweep, from a saved results.json (issue 21:
"the server >= 0.9x of in-process at every point of the preemption storm's sweep").

For each sweep point and metric: the ratio of the two engines' medians, and the ratio round by round
(repeat i of one engine against repeat i of the other: the benchmarks serve the engines of a point
interleaved, round by round), printed as median [min-max] over the rounds, with each engine's own spread
(max - min over its repeats, as a share of its median) beside it, so that noise and a real gap are told
apart. Throughput: higher is better, the ratio is ``engine / baseline``; a time (TTFT): lower is better,
the ratio is ``baseline / engine``, so that > 1 always means the engine is ahead. Nothing is re-run.

    pytest suites/benchmarks --benchmark -k preemption_storm --engine reference \\
        --engine server:preset=reference --report-dir reports/storm
    PYTHONPATH=$PWD python scripts/storm_ratios.py reports/storm/<run>/results.json [--scenario preemption_storm]
        [--baseline reference] [--engine server:preset=reference] [--metrics output_throughput,ttft_p50]
        [--at-least 0.9]

Exit status 1 when ``--at-least`` is given and a point's median ratio of round ratios is below it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: metrics where lower is better: their ratio is baseline / engine
LOWER_IS_BETTER_PREFIXES = ("ttft", "tbt", "tpot", "e2e", "duration")


@dataclass(frozen=True)
class PointRatio:
    """One metric at one sweep point: the two engines' medians and rounds, and their ratios."""

    x: float
    metric: str
    baseline: float
    engine: float
    ratio_of_medians: float
    round_ratios: list[float]
    baseline_spread: float  # (max - min) / median over the baseline's repeats
    engine_spread: float

    @property
    def median_round_ratio(self) -> float:
        return statistics.median(self.round_ratios) if self.round_ratios else self.ratio_of_medians


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def lower_is_better(metric: str) -> bool:
    return metric.startswith(LOWER_IS_BETTER_PREFIXES)


def _ratio(metric: str, baseline: float, engine: float) -> float:
    num, den = (baseline, engine) if lower_is_better(metric) else (engine, baseline)
    return num / den if den else float("nan")


def _spread(values: list[float]) -> float:
    if not values:
        return float("nan")
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("nan")


def _values(point: dict[str, Any], metric: str) -> list[float]:
    rounds = [r.get(metric) for r in point.get("repeats") or []]
    rounds = [float(v) for v in rounds if v is not None]
    return rounds or ([float(point["metrics"][metric])] if point["metrics"].get(metric) is not None else [])


def point_ratios(results: dict[str, Any], scenario: str, baseline: str, engine: str,
                 metrics: list[str]) -> list[PointRatio]:
    """Every sweep point both engines served, for every metric: ValueError naming what is missing."""
    found = [s for s in results.get("scenarios", []) if s.get("name") == scenario]
    if not found:
        names = ", ".join(s.get("name", "?") for s in results.get("scenarios", []))
        raise ValueError(f"no scenario {scenario!r} in these results (they hold: {names or 'none'})")
    sweeps = found[0].get("sweeps") or []
    if not sweeps:
        raise ValueError(f"scenario {scenario!r} has no sweep")
    by_engine: dict[str, dict[float, dict[str, Any]]] = {}
    for point in sweeps[0]["points"]:
        by_engine.setdefault(point["engine"], {})[float(point["x"])] = point
    for name in (baseline, engine):
        if name not in by_engine:
            raise ValueError(f"engine {name!r} has no point in {scenario!r} (engines: {', '.join(by_engine)})")
    out = []
    for x in sorted(set(by_engine[baseline]) & set(by_engine[engine])):
        a, b = by_engine[baseline][x], by_engine[engine][x]
        for metric in metrics:
            va, vb = _values(a, metric), _values(b, metric)
            if not va or not vb:
                continue
            rounds = [_ratio(metric, x_a, x_b) for x_a, x_b in zip(va, vb, strict=False)]
            ma, mb = statistics.median(va), statistics.median(vb)
            out.append(PointRatio(x, metric, ma, mb, _ratio(metric, ma, mb), rounds, _spread(va), _spread(vb)))
    return out


def table(ratios: list[PointRatio], baseline: str, engine: str) -> str:
    lines = [f"{engine} against {baseline} (> 1: {engine} ahead; throughput {engine}/{baseline}, "
             f"times {baseline}/{engine})",
             "| point | metric | baseline | engine | ratio of medians | ratio by round: median [min-max] | "
             "spread baseline / engine |",
             "|---|---|---|---|---|---|---|"]
    for r in ratios:
        rounds = f"{r.median_round_ratio:.2f} [{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}]" \
            if r.round_ratios else "-"
        lines.append(f"| {r.x:g} | {r.metric} | {r.baseline:.4g} | {r.engine:.4g} | {r.ratio_of_medians:.2f} | "
                     f"{rounds} | {r.baseline_spread:.0%} / {r.engine_spread:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a results.json (or .json.gz) written by pytest --benchmark")
    parser.add_argument("--scenario", default="preemption_storm")
    parser.add_argument("--baseline", default="reference", help="the engine in the denominator (default reference)")
    parser.add_argument("--engine", default="server:preset=reference")
    parser.add_argument("--metrics", default="output_throughput,ttft_p50")
    parser.add_argument("--at-least", type=float, default=None,
                        help="exit 1 when a point's median round ratio is below this (e.g. 0.9)")
    args = parser.parse_args(argv)
    try:
        ratios = point_ratios(load(args.results), args.scenario, args.baseline, args.engine,
                              [m.strip() for m in args.metrics.split(",") if m.strip()])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(ratios, args.baseline, args.engine))
    if args.at_least is not None:
        below = [r for r in ratios if r.median_round_ratio < args.at_least]
        for r in below:
            print(f"below {args.at_least}: {r.metric} at {r.x:g}: {r.median_round_ratio:.2f}")
        return 1 if below else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
