"""Runs over time: the headline metrics of every run in a report folder as small multiples
(docs/benchmarks.md#runs-over-time).

``reports/index.html`` shows, for each scale the runs were made at (a quick run and a full one are not
like for like), one row per scenario and one small chart per headline metric: the scenario's own
scoreboard metric (its declaration's :class:`~kvbench.bench.scenarios.declare.Score`, in the mode it
names), p99 TBT and preemptions. Every chart shares one x axis, the runs in the order they were made, so
a change lines up down the page; each engine keeps one colour and dash pattern everywhere (a legend at
the top); each point is a link to its run's report, and its tooltip says the run, the value, the clock
and the machine. The charts are inline SVG; every text and attribute is escaped (:func:`charts.tag`).

One clock per line: a scenario whose results over the runs were measured on more than one clock (runs from
before the one-clock rule, :mod:`kvbench.bench.clock_rule`, or sessions with different sets of engines) gets
one row of small multiples per clock, each with its own y axis, and the row's title names the clock. No line
joins a step-clock point to a wall-clock one and no axis holds both: figures from two clocks are not like for
like (two step clocks of different seconds a step count as two clocks, as in the gate,
:func:`kvbench.bench.gate.clock_of`).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from markupsafe import Markup, escape

from kvbench.bench import gate
from kvbench.bench.formatting import fmt_metric, metric_label
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import num, result_of
from kvbench.report import charts as rc
from kvbench.report import figures, words
from kvbench.report.scoreboard import DEFAULT_SCORE, declaration

#: metrics drawn for every scenario beside its own scoreboard metric
COMMON_METRICS = ("tbt_p99", "preemptions")
DASHES = (None, "6 3", "2 2", "8 3 2 3", "4 2 1 2")
#: a small multiple's size in px (the SVG scales with its box)
WIDTH, HEIGHT = 300, 120


@dataclass(frozen=True)
class Run:
    """One run of the folder: its name (the subfolder), when it was made, its report's link."""

    name: str
    created: str
    href: str
    has_report: bool
    results: Results


@dataclass
class Panel:
    """One small multiple: one metric of one scenario, a series per engine."""

    metric: str
    label: str
    mode: str | None
    series: dict[str, list[tuple[int, float, Run, Mapping[str, Any]]]] = field(default_factory=dict)

    @property
    def title(self) -> str:
        unit = " (tok/s)" if self.metric.endswith("_throughput") else ""
        return self.label + unit + (f" [{self.mode}]" if self.mode else "")


def _tick(metric: str, value: float) -> str:
    """A y tick: the metric's own format, throughputs without their unit (the title carries it)."""
    return f"{value:,.0f}" if metric.endswith("_throughput") else fmt_metric(metric, value)


def run_href(name: str) -> str:
    """The link from the index to a run's report ("./" + quoting: a folder named "javascript:x" stays relative)."""
    return "./" + urllib.parse.quote(name) + "/report.html"


def scale_of(results: Results) -> str:
    scales = sorted({str(sc.get("parameters", {}).get("scale") or "unknown scale") for sc in results.scenarios})
    return ", ".join(scales) or "unknown scale"


def scenario_metrics(name: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(result mode, [(metric, label)]) drawn for scenario ``name``: its scoreboard metric first."""
    decl = declaration(name)
    score = decl.score if decl is not None and decl.score is not None else DEFAULT_SCORE
    metrics = [(score.metric, score.label or metric_label(score.metric))]
    metrics += [(m, metric_label(m)) for m in COMMON_METRICS if m != score.metric]
    return score.mode, metrics


RowKey = tuple[str, gate.Clock]


def panels(runs: Sequence[Run]) -> dict[RowKey, list[Panel]]:
    """{(scenario, clock): [Panel per metric]} over ``runs`` of one scale (oldest first; a point's x is its
    run's index): each result goes to the row of the clock it was measured on (:func:`kvbench.bench.gate.clock_of`),
    so no series mixes clocks; a panel with no point is left out."""
    out: dict[RowKey, list[Panel]] = {}
    for i, run in enumerate(runs):
        for sc in run.results.scenarios:
            mode, metrics = scenario_metrics(sc["name"])
            if not any(r.get("mode") == mode for r in sc["results"]):
                continue  # e.g. a scenario with only sweeps, or a score mode this run did not serve
            for engine in dict.fromkeys(r["engine"] for r in sc["results"]):
                res = result_of(sc, engine, mode)
                if res is None:
                    continue
                row = out.setdefault((sc["name"], gate.clock_of(res)), [Panel(m, label, mode) for m, label in metrics])
                for panel in row:
                    v = num(res["metrics"].get(panel.metric))
                    if v is not None:
                        panel.series.setdefault(engine, []).append((i, v, run, res))
    return {key: kept for key, row in out.items() if (kept := [p for p in row if p.series])}


def clock_label(clock: gate.Clock) -> str:
    """"step clock, 0.01 s a step" / "wall clock": a row's clock as its title names it."""
    name, seconds = clock
    return f"{name} clock" + (f", {seconds:g} s a step" if name == "step" and seconds is not None else "")


def row_title(scenario: str, clock: gate.Clock, clocks_of_scenario: int) -> str:
    """The scenario's title, with its clock when the scenario has rows on more than one clock."""
    title = words.scenario_title(scenario)
    return title if clocks_of_scenario < 2 else f"{title} ({clock_label(clock)})"


def engine_styles(runs: Sequence[Run]) -> dict[str, tuple[str, str | None]]:
    """One (colour, dash) per engine across the whole page, in order of first appearance."""
    names = list(dict.fromkeys(e for run in runs for e in run.results.engine_names()))
    return {e: (rc.PALETTE[i % len(rc.PALETTE)], DASHES[(i // len(rc.PALETTE) + i) % len(DASHES)])
            for i, e in enumerate(names)}


def small_multiple(panel: Panel, n_runs: int, styles: Mapping[str, tuple[str, str | None]],
                   runs: Sequence[Run]) -> Markup:
    """One panel as inline SVG: y from 0 to the panel's top, x the run index, each point a link."""
    left, right, top, bottom = 46, 10, 8, 20
    pw, ph = WIDTH - left - right, HEIGHT - top - bottom
    top_v = max(v for pts in panel.series.values() for _, v, _, _ in pts)
    ticks = rc.nice_ticks(0.0, top_v or 1.0, n=3, integer=panel.metric == "preemptions")
    y_hi = ticks[-1] or 1.0

    def x_at(i: int) -> float:
        return left + (pw / 2 if n_runs < 2 else pw * i / (n_runs - 1))

    def y_at(v: float) -> float:
        return top + ph * (1 - v / y_hi)

    parts: list[Markup] = [rc.tag("title", f"{panel.title} by run")]
    for t in ticks:
        y = y_at(t)
        parts.append(rc.tag("line", x1=left, x2=left + pw, y1=f"{y:.1f}", y2=f"{y:.1f}", class_="c-grid"))
        parts.append(rc.tag("text", _tick(panel.metric, t), x=left - 4, y=f"{y + 3:.1f}", class_="c-tick",
                            text_anchor="end"))
    parts.append(rc.tag("line", x1=left, x2=left + pw, y1=top + ph, y2=top + ph, class_="c-axis"))
    if n_runs >= 2:
        for i, anchor in ((0, "start"), (n_runs - 1, "end")):
            parts.append(rc.tag("text", runs[i].created[:10] or runs[i].name, x=f"{x_at(i):.1f}",
                                y=HEIGHT - 6, class_="c-tick", text_anchor=anchor))
    for engine, pts in panel.series.items():
        color, dash = styles.get(engine, (rc.PALETTE[0], None))
        if len(pts) > 1:
            d = " ".join(f"{x_at(i):.1f},{y_at(v):.1f}" for i, v, _, _ in pts)
            parts.append(rc.tag("polyline", points=d, class_="c-line", stroke=color, stroke_width=1.6,
                                stroke_dasharray=dash))
        for i, v, run, res in pts:
            tip = (f"{run.name} · {engine}: {fmt_metric(panel.metric, v)} · {figures.clock_of(res)} clock · "
                   f"{run.results.machine.get('hostname') or 'unknown host'}")
            dot = rc.tag("circle", rc.tag("title", tip), cx=f"{x_at(i):.1f}", cy=f"{y_at(v):.1f}", r=3.2,
                         fill=color, stroke="#fff", stroke_width=1)
            parts.append(rc.tag("a", dot, href=run.href) if run.has_report else dot)
    return Markup(f'<svg class="chart trend" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
                  f'aria-label="{escape(panel.label)}">{Markup("").join(parts)}</svg>')


def trend_view(runs: Sequence[Run]) -> dict[str, Any]:
    """What index.html draws: the legend and, per scale (oldest run first), per scenario, its row of small
    multiples."""
    runs = sorted(runs, key=lambda r: r.created)
    styles = engine_styles(runs)
    scales = []
    for scale in dict.fromkeys(scale_of(r.results) for r in runs):
        in_scale = [r for r in runs if scale_of(r.results) == scale]
        found = panels(in_scale)
        # a scenario's rows side by side, in the order the scenarios first appear
        by_row = {key: found[key] for name in dict.fromkeys(n for n, _ in found) for key in found if key[0] == name}
        clocks_per_scenario = {name: sum(n == name for n, _ in by_row) for name, _ in by_row}
        rows = [{"scenario": row_title(name, clock, clocks_per_scenario[name]), "clock": clock_label(clock),
                 "charts": [{"title": p.title, "svg": small_multiple(p, len(in_scale), styles, in_scale)} for p in row]}
                for (name, clock), row in by_row.items()]
        clocks = list(dict.fromkeys(clock_label(clock) for _, clock in by_row))
        note = ("" if len(clocks) < 2 else
                f"These runs were measured on {len(clocks)} clocks ({'; '.join(clocks)}): a scenario measured on more "
                "than one has a row per clock, each with its own axis, and no line joins two clocks (figures from "
                "two clocks are not like for like).")
        if rows:
            scales.append({"scale": scale, "runs": len(in_scale), "rows": rows, "clocks": clocks, "clock_note": note,
                           "first": in_scale[0].created[:10], "last": in_scale[-1].created[:10]})
    legend = [{"engine": e, "color": c, "dash": d or ""} for e, (c, d) in styles.items()]
    return {"scales": scales, "legend": legend, "runs": len(runs)}
