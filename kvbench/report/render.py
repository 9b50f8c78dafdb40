"""The HTML report: one self-contained file per run, rendered from a results file alone.

Contract: :func:`render_report` takes :class:`~kvbench.bench.results.Results` (and optionally a baseline)
and returns one HTML document with inline CSS, inline SVG charts and a few lines of inline script
(sortable tables); it references no URL at all, so it opens offline and leaks nothing. jinja2 runs
with autoescape on; names from the command line reach the page only escaped (the charts escape
their own text, see :mod:`kvbench.report.charts`), and the results JSON embedded for reuse goes
through ``|tojson``, which escapes ``<``, ``>``, ``&`` and ``'``.

The figures here only *read* results: the scoreboard, headlines, side-by-side tables, the diagnosis
and the baseline deltas are computed from metrics already in the file; nothing re-runs an engine.
What is particular to a scenario (its headline, its scoreboard metric, the pressure it creates on
purpose, the tables that make its point) is declared by the scenario itself
(:mod:`kvbench.bench.scenarios`) and only read here.
"""

from __future__ import annotations

import itertools
import math
import os
import urllib.parse
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from markupsafe import Markup

from kvbench import __version__
from kvbench.bench import gate, sampler_cost
from kvbench.bench.formatting import fmt_bytes, fmt_metric, fmt_ratio, fmt_time, metric_label
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import num, within_noise
from kvbench.core import delivery
from kvbench.report import advice, extra_charts, figures, first_screen, scoreboard, sim_validation, trend, words
from kvbench.report import charts as rc
from kvbench.report import engine_settings as engine_settings_view
from kvbench.report import side_by_side as side_by_side_view
from kvbench.report import skipped as skipped_view
from kvbench.report.diagnosis import baseline_engine_name, diagnose

#: what report files are written with: readable by everyone like any document (a results file written
#: through a temporary file would otherwise keep mkstemp's 0600)
FILE_MODE = 0o644

#: columns of the summary table (the most telling figure of each family)
SUMMARY_COLUMNS: tuple[str, ...] = (
    "output_throughput", "goodput", "ttft_p99", "tbt_p50", "tbt_p99", "e2e_p50", "preemptions",
    "recomputed_share", "tbt_spikes", "starvation_max_s", "kv_usage_time_over_95", "prefix_hit_rate",
)
#: rows of the engines-side-by-side and baseline tables
COMPARE_METRICS: tuple[str, ...] = (
    "output_throughput", "total_throughput", "goodput", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99",
    "tpot_p50", "e2e_p50", "e2e_p99", "preemptions", "preemptions_per_s", "preempted_request_share",
    "recomputed_tokens", "recomputed_share", "swap_bandwidth", "prefix_hit_rate", "tbt_spikes",
    "starvation_max_s", "kv_usage_mean", "kv_usage_time_over_95", "waiting_max",
)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("kvbench.report", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html", "htm", "xml"), default=True),
        undefined=jinja2.StrictUndefined,  # a typo in the template fails loudly, not as an empty cell
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(metric=fmt_metric, ratio=fmt_ratio, seconds=fmt_time, bytes=fmt_bytes)
    return env


def _asset(env: jinja2.Environment, name: str) -> Markup:
    """A package template file inlined verbatim (CSS and JS are not jinja templates: their braces stay)."""
    assert env.loader is not None
    source, _, _ = env.loader.get_source(env, name)
    if "</" in source:  # would end the <style>/<script> element early
        raise ValueError(f"template asset {name} must not contain '</'")
    return Markup(source)


def _render(template: str, **context: Any) -> str:
    env = _environment()
    return env.get_template(template).render(css=_asset(env, "report.css"), js=_asset(env, "report.js"), **context)


# --------------------------------------------------------------------------------------------
# lookups


def _label(engine: str, mode: str | None) -> str:
    return f"{engine} [{mode}]" if mode else engine


def _find_scenario(results: Results, *needles: str) -> dict[str, Any] | None:
    for sc in results.scenarios:
        if any(n in sc["name"].lower() for n in needles):
            return sc
    return None


def clock_rule(results: Results) -> dict[str, Any] | None:
    """The run's clock decision as results.json states it (``clock_rule``); for a file without one, what its
    results show when they all ran on one clock; None when they mix clocks (each section then says so)."""
    stated = results.data.get("clock_rule")
    if isinstance(stated, dict) and stated.get("clock"):
        return stated
    everything = [r for _, r in results.iter_results()]
    mixed = figures.mixed_clocks_words(everything)
    if mixed:
        return {"clock": "", "step_seconds": None, "mixed": True, "why": mixed[0].upper() + mixed[1:]}
    clocks = {figures.clock_of(r) for r in everything}
    if not clocks:
        return None
    return {"clock": clocks.pop(), "step_seconds": None,
            "why": "every result of this file was measured on it (the file does not state the run's rule)"}


def headline_ratios(results: Results) -> list[dict[str, Any]]:
    """One headline card per scenario in the results, each the scenario's own declaration."""
    return scoreboard.headlines(results, baseline_engine_name(results))


# --------------------------------------------------------------------------------------------
# tables


def _better(metric: str, ratio: float, noise: float | None = None) -> str:
    """CSS class for a ratio of other / reference (or current / baseline): good or bad only beyond ``noise``."""
    if not math.isfinite(ratio) or within_noise(ratio, noise):
        return "same"
    up_good = metric in gate.HIGHER_IS_BETTER
    return "good" if (ratio > 1) == up_good else "bad"


def summary_table(results: Results) -> dict[str, Any]:
    # goodput exists only with --slo: without it the column would read "n/a" in every row (R2)
    columns = [k for k in SUMMARY_COLUMNS if k != "goodput"
               or any(num(r["metrics"].get(k)) is not None for _, r in results.iter_results())]
    rows = []
    for sc, res in results.iter_results():
        checks, undecided = res.get("checks", {}), res.get("undecided") or {}
        held = f"{sum(map(bool, checks.values()))}/{len(checks)}" if checks else ""
        rows.append({"scenario": words.scenario_title(sc["name"]), "engine": res["engine"], "mode": res.get("mode"),
                     "cells": [figures.fmt_value(k, res, compact=True) for k in columns],
                     "sort": [num(res["metrics"].get(k)) for k in columns],
                     # undecided claims are said apart: they never count as held
                     "checks": " · ".join(filter(None, [held, f"{len(undecided)} undecided" if undecided else ""])),
                     "checks_ok": all(checks.values()), "machine": res.get("machine") or "",
                     "clock": figures.clock_of(res)})
    # merged shards (kvbench merge) keep each result's machine: a column when there is more than one
    show_machine = len({r["machine"] for r in rows}) > 1
    return {"columns": [metric_label(k) for k in columns], "rows": rows, "show_machine": show_machine,
            "goodput": "goodput" in columns,
            "bursts": delivery.table_note(r for _, r in results.iter_results())}  # what "(bursty)" cells mean


def _ratio_cell(c: figures.Comparison) -> dict[str, Any]:
    tip = {"not comparable": c.not_comparable, "n/a": "no ratio: a side is zero or missing"}.get(c.verdict, "")
    return {"text": c.text, "cls": c.cls, "word": c.symbol, "tip": tip}


def side_by_side(results: Results) -> list[dict[str, Any]]:
    """Per scenario run by two or more engines: metrics x results, and each other engine's ratio to
    the reference engine *in the same mode* (chunked vs chunked, never chunked vs unchunked), with its
    noise; engines on different clocks are shown side by side but not compared."""
    ref = baseline_engine_name(results)
    tables = []
    for sc in results.scenarios:
        res = sc["results"]
        if len({r["engine"] for r in res}) < 2:
            continue
        bases = {r.get("mode"): r for r in res if r["engine"] == ref}
        if not bases:  # no reference engine here: the first engine listed plays its part
            first = res[0]["engine"]
            bases = {r.get("mode"): r for r in res if r["engine"] == first}
        pairs = [(r, bases[r.get("mode")]) for r in res if r.get("mode") in bases and r is not bases[r.get("mode")]]
        rows = []
        for key in COMPARE_METRICS:
            values = [num(r["metrics"].get(key)) for r in res]
            if all(v is None for v in values):
                continue
            ratios = [_ratio_cell(figures.compare(key, other, base, sc)) for other, base in pairs]
            rows.append({"label": metric_label(key), "cells": [figures.fmt_value(key, r) for r in res],
                         "ratios": ratios})
        not_compared = sorted({why for o, b in pairs if (why := figures.clocks_differ(sc, o, b))})
        beyond = [f"{r['label']} {x['text']} {x['word']}" for r in rows for x in r["ratios"]
                  if x["cls"] in ("good", "bad")]
        tables.append({"scenario": sc["name"], "headers": [(r["engine"], r.get("mode"), figures.clock_of(r))
                                                             for r in res],
                       "ratio_headers": [(f"{o['engine']} ÷ {b['engine']}", o.get("mode")) for o, b in pairs],
                       "rows": rows, "not_compared": not_compared, "beyond": beyond,
                       "chart": _ratio_chart(sc, pairs)})
    return tables


#: metrics drawn as ratio bars above each side-by-side table
RATIO_BAR_METRICS: tuple[str, ...] = (
    "output_throughput", "goodput", "ttft_p99", "tbt_p99", "e2e_p50", "preemptions", "recomputed_tokens",
    "starvation_max_s",
)


def _ratio_chart(sc: dict[str, Any], pairs: list[tuple[dict, dict]]) -> Markup | None:
    """Ratio bars of the pairs on one clock (pairs on different clocks are not compared); a bar is
    coloured only beyond its noise, and its value carries the noise."""
    bars = []
    pairs = [(o, b) for o, b in pairs if not figures.clocks_differ(sc, o, b)]
    several_engines = len({o["engine"] for o, _ in pairs}) > 1
    for key in RATIO_BAR_METRICS:
        for other, base in pairs:
            c = figures.compare(key, other, base, sc)
            if c.ratio is None:  # no ratio to draw (the table still shows both values)
                continue
            tag_ = " · ".join(x for x in (other["engine"] if several_engines else "", other.get("mode") or "") if x)
            good = {"better": True, "worse": False}.get(c.verdict)
            bars.append(rc.Bar(metric_label(key) + (f" · {tag_}" if tag_ else ""), c.ratio, good,
                               f"{metric_label(key)}: {figures.fmt_value(key, other)} vs {figures.fmt_value(key, base)}"
                               f" · {c.verdict}", text=c.text))
    if not bars:
        return None
    names = list(dict.fromkeys(f"{o['engine']} ÷ {b['engine']}" for o, b in pairs))  # in the run's engine order
    return rc.ratio_bars(f"{', '.join(names)} — {sc['name']}", bars,
                         subtitle="green: better beyond the noise, red: worse, grey: within the noise "
                                  "(log scale, clipped at 4×)")


#: columns of the baseline matrix
BASELINE_METRICS: tuple[str, ...] = (
    "output_throughput", "goodput", "ttft_p99", "tbt_p99", "e2e_p50", "preemptions", "recomputed_share",
    "starvation_max_s", "kv_usage_time_over_95",
)


def baseline_section(results: Results, baseline: Results) -> dict[str, Any]:
    """A matrix of (scenario, engine, mode) x key metrics: current value and change from the baseline,
    with the regressions of the gate's default thresholds listed first and shaded."""
    # a figure and its baseline measured on two clocks (a run from before the one-clock rule) are not compared:
    # the cell and any "regression" between them are set aside and said so
    gated = gate.gate(results, baseline, gate.DEFAULT_THRESHOLDS)  # the gate sets aside what crossed clocks
    flagged_all = gated.regressions
    across = [d for d in flagged_all if _across_clocks(d, results, baseline)]
    regressions = [d for d in flagged_all if not _across_clocks(d, results, baseline)]
    flagged = {(d.scenario, d.engine, d.mode, d.metric) for d in regressions}
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    not_compared: set[str] = set()
    # the cells show both runs' own values (absolute): a same-run ratio to the reference engine, which the
    # gate compares times by, would read as a value in the metric's unit ("1.0 tok/s") and leave the
    # reference engine's own times empty
    absolute_cells = gate.gate(results, baseline, [f"{k}:+0%" for k in BASELINE_METRICS], absolute=True)
    not_compared |= {_label(f"{s.scenario} / {s.engine}", s.mode)
                     for s in [*gated.set_aside, *absolute_cells.set_aside]}
    for d in absolute_cells.deltas:
        key = (d.scenario, d.engine, d.mode)
        if _across_clocks(d, results, baseline):
            not_compared.add(_label(f"{d.scenario} / {d.engine}", d.mode))
            cells.setdefault(key, {})[d.metric] = {
                "current": fmt_metric(d.metric, d.current), "baseline": fmt_metric(d.metric, d.baseline),
                "change": "not compared", "cls": "na", "word": "≠ clock", "regressed": False}
            continue
        cls = _delta_class(d)
        cells.setdefault(key, {})[d.metric] = {
            "current": fmt_metric(d.metric, d.current), "baseline": fmt_metric(d.metric, d.baseline),
            "change": gate.format_change(d), "cls": cls,
            "word": {"good": "▲ better", "bad": "▼ worse", "same": "≈"}[cls],
            "regressed": (*key, d.metric) in flagged}
    rows = [{"where": _label(f"{s} / {e}", m), "cells": [by_metric.get(k) for k in BASELINE_METRICS]}
            for (s, e, m), by_metric in cells.items()]
    only_cur, only_base = gate.unmatched(results, baseline)
    return {"label": _run_label(baseline), "columns": [metric_label(k) for k in BASELINE_METRICS], "rows": rows,
            "thresholds": ", ".join(gate.DEFAULT_THRESHOLDS), "regressions": [d.describe() for d in regressions],
            "not_compared": sorted(not_compared | {_label(f"{d.scenario} / {d.engine}", d.mode) for d in across}),
            "only_current": [_label(f"{s} / {e}", m) for s, e, m in only_cur],
            "only_baseline": [_label(f"{s} / {e}", m) for s, e, m in only_base]}


def _result_clock(results: Results, scenario: str, engine: str, mode: str | None) -> str | None:
    res = results.result(scenario, engine, mode)
    return figures.clock_of(res) if res is not None else None


def _across_clocks(d: gate.Delta, results: Results, baseline: Results) -> bool:
    """Whether a delta sets figures of two clocks against each other: the result's clock moved between the
    runs, or (a same-run ratio) the engine and the one it is a ratio to ran on different clocks in either."""
    engines = [d.engine]
    if d.basis.startswith("ratio to "):
        engines.append(d.basis.removeprefix("ratio to "))
    clocks = {_result_clock(run, d.scenario, e, d.mode) for run in (results, baseline) for e in engines}
    return len(clocks - {None}) > 1


def _delta_class(d: gate.Delta) -> str:
    """good / bad for a change beyond the gate's noise floor (and beyond the jitter of a single run), else same."""
    if d.regressed:
        return "bad"
    diff = d.current - d.baseline
    if abs(diff) <= d.noise or abs(diff) <= figures.MIN_RATIO_NOISE * max(abs(d.baseline), abs(d.current)):
        return "same"
    up_good = d.metric in gate.HIGHER_IS_BETTER
    return "good" if (diff > 0) == up_good else "bad"


def _run_label(results: Results) -> str:
    commit = results.data.get("commit") or {}
    cid = (commit.get("id") or "")[:10]
    parts = [results.data.get("created") or "unknown date"]
    if cid:
        parts.append(f"commit {cid}" + (" (dirty)" if commit.get("dirty") else ""))
    return ", ".join(parts)


def machine_label(results: Results) -> str:
    m = results.machine or {}
    bits = [m.get("hostname") or "unknown host", m.get("device") or "unknown device"]
    if m.get("cpu_count"):
        bits.append(f"{m['cpu_count']} CPUs")
    if m.get("torch"):
        bits.append(f"torch {m['torch']}")
    return ", ".join(str(b) for b in bits)


# --------------------------------------------------------------------------------------------
# charts


#: height (px) of a timeline or distribution chart: three fit across at 1400 px; 210 keeps five y ticks legible
TIMELINE_HEIGHT = 210


class _Charts:
    """Chart builders for one report; hands out unique clip-path ids."""

    def __init__(self, results: Results):
        self.colors = {name: rc.PALETTE[i % len(rc.PALETTE)] for i, name in enumerate(results.engine_names())}
        self.order = {name: i for i, name in enumerate(results.engine_names())}
        self.facts = figures.Facts.of(results)
        self.n = 0

    def render(self, chart: rc.Chart) -> Markup:
        self.n += 1
        return rc.render(chart, uid=f"c{self.n}")

    def style(self, engine: str, mode: str | None, modes: list[str | None],
              one_engine: bool = False) -> tuple[str, str | None]:
        """Colour by engine, dash by mode and engine: two series that coincide still differ in pattern.
        With ``one_engine`` (every series of the chart is one engine's) colour by mode instead: a policies
        scenario has a dozen modes, more than dash patterns can tell apart."""
        dashes = (None, "7 4", "2 3", "10 3 2 3", "4 2 1 2")
        idx = modes.index(mode) if mode in modes else 0
        if one_engine:
            return rc.PALETTE[idx % len(rc.PALETTE)], dashes[(idx // len(rc.PALETTE)) % len(dashes)]
        idx += self.order.get(engine, 0)
        return self.colors.get(engine, rc.PALETTE[0]), dashes[idx % len(dashes)]

    # -- one result -------------------------------------------------------------------------

    #: the timelines of a scenario: (series x key, series y key, title, unit, y format, y max, integer ticks)
    TIMELINES: tuple[tuple[str, str, str, str, Any, float | None, bool], ...] = (
        ("gap_t", "gap_max", "Longest token gap", "gap (ms)", lambda v: f"{v * 1000:g}", None, False),
        ("throughput_t", "throughput", "Output throughput", "tokens/s", lambda v: f"{v:,.0f}", None, False),
        ("t", "kv_usage", "KV usage", "KV blocks in use (%)", lambda v: f"{v * 100:g}", 1.0, False),
        ("t", "num_waiting", "Waiting requests", "requests", lambda v: f"{v:g}", None, True),
        # engines reached over HTTP: what the server's own /metrics said during the run, beside the client's gaps
        ("server_t", "server_running", "Running requests (server /metrics)", "requests", lambda v: f"{v:g}", None,
         True),
        ("server_t", "server_preemptions", "Preemptions so far (server /metrics)", "preemptions",
         lambda v: f"{v:g}", None, True),
        ("server_t", "server_prefix_hit_rate", "Prefix-cache hit rate (server /metrics)", "hits / tokens looked up (%)",
         lambda v: f"{v * 100:g}", 1.0, False),
    )

    #: the timelines drawn open in a scenario's card; the others wait behind "more charts" (page height)
    FIRST_TIMELINES = ("gap_max", "kv_usage")

    def timelines(self, sc: dict[str, Any], keys: Collection[str] | None = None) -> list[Markup]:
        """One chart per metric (those of ``keys``, every one by default) with every result of the scenario
        overlaid, on one y scale per metric.

        Results on different clocks (open-loop arrivals released by engine step for one, by the wall
        clock for another) are never overlaid: each clock gets its own chart, on the same y scale, and
        says so. The scenario's event (a surge's start) is marked where the time axis is the workload's."""
        with_series = [r for r in sc["results"] if r.get("series")]
        if not with_series:
            return []
        groups: dict[str, list[dict[str, Any]]] = {}
        split = bool(figures.clocks_differ(sc, *with_series))
        for r in with_series:
            groups.setdefault(figures.clock_of(r) if split else "", []).append(r)
        modes = list(dict.fromkeys(r.get("mode") for r in with_series))
        one_engine = len({r["engine"] for r in with_series}) == 1
        event = _scenario_event(sc)
        # the step clock's timelines are drawn on the workload's own seconds (step index x seconds per
        # step), where its arrivals and its surge are; the wall seconds those steps took are stated apart
        to_workload = {id(r): _workload_axis(r) for r in with_series}
        out = []
        for x_key, y_key, title, unit, fmt, y_max, integer in self.TIMELINES:
            if keys is not None and y_key not in keys:
                continue
            ys_all = [v for r in with_series for v in r["series"].get(y_key, []) if v is not None]
            if not ys_all:
                continue
            top = y_max if y_max is not None else max(ys_all) * 1.05 or 1.0
            for clock, members in groups.items():
                lines, marks, legend = [], [], {}
                broken = 0  # polling gaps the lines break at
                for r in members:
                    s = r["series"]
                    if y_key not in s:  # a server's view: engines in process have none
                        continue
                    color, dash = self.style(r["engine"], r.get("mode"), modes, one_engine=one_engine)
                    label = _label(r["engine"], r.get("mode"))
                    move = to_workload[id(r)] if x_key != "server_t" else None
                    xs, ys = s.get(x_key, []), s.get(y_key, [])
                    if x_key == "server_t" or "server_t" in s:  # samples polled from the server's /metrics
                        xs, ys, n = rc.break_at_gaps(xs, ys)
                        broken += n
                    lines.append(rc.Line(label, [move(x) for x in xs] if move else xs, ys, color, dash=dash))
                    if y_key == "gap_max":
                        for t, mode in zip(s.get("preempt_t", []), s.get("preempt_mode", []), strict=False):
                            t = move(t) if move else t
                            c = rc.PREEMPT_COLORS.get(mode, "#d9434e")
                            marks.append(rc.Marker(t, c, f"{label}: preempted ({mode}) at {t:.3f} s"))
                            legend[f"preemption ({mode})"] = c
                if not lines:
                    continue
                sub = f"{clock} clock only: not comparable with the other clock" if split else "one scale for all"
                if y_key == "gap_max" and (bursts := delivery.chart_note(members)):
                    sub += "; " + bursts
                if broken and y_key != "gap_max":
                    sub += "; " + rc.gap_note(broken)
                stepped = [r for r in members if to_workload[id(r)] is not None and y_key in r["series"]]
                x_title = "time (s)"
                if stepped and x_key != "server_t":
                    x_title, note = _step_axis_words(stepped)
                    sub += "; " + note
                vlines = []
                if event is not None:
                    at = {_label(r["engine"], r.get("mode")): (event[1] if to_workload[id(r)] is not None else
                                                               _event_time(r, event[1])) for r in members}
                    if len({round(t, 3) for t in at.values() if t is not None}) == 1 and None not in at.values():
                        vlines.append(rc.VLine(next(iter(at.values())), event[0], "#1b2a4a"))
                    else:
                        vlines += [rc.VLine(t, f"{event[0]} ({label})", self.style(*_engine_mode(label), modes,
                                                                                   one_engine=one_engine)[0])
                                   for label, t in at.items() if t is not None]
                    sub += f"; {event[0]} at {event[1]:g} s of the workload" + (
                        "" if vlines else " (not on this axis)")
                chart = rc.Chart(title + (f" ({clock} clock)" if split else "")
                                 + f" — {words.scenario_title(sc['name'])}", x_title,
                                 unit, lines=lines, markers=marks, marker_legend=legend, vlines=vlines,
                                 y_format=fmt, y_max=top, y_integer=integer, subtitle=sub, width=440,
                                 height=TIMELINE_HEIGHT)
                out.append(self.render(chart))
        return out

    # -- one scenario -----------------------------------------------------------------------

    def cdfs(self, sc: dict[str, Any], keys: Collection[str] = ("ttft", "tbt")) -> list[Markup]:
        """The TTFT (``ttft``) and inter-token gap (``tbt``) distributions of ``keys``, engines overlaid."""
        out = []
        modes = list(dict.fromkeys(r.get("mode") for r in sc["results"]))
        split = bool(figures.clocks_differ(sc, *sc["results"]))  # never overlay two clocks' distributions
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in sc["results"]:
            groups.setdefault(figures.clock_of(r) if split else "", []).append(r)
        for (key, title), (clock, members) in itertools.product(
                [(k, t) for k, t in (("ttft", "TTFT distribution"), ("tbt", "Inter-token gap distribution"))
                 if k in keys], groups.items()):
            lines = []
            for r in members:
                s = r.get("series", {})
                color, dash = self.style(r["engine"], r.get("mode"), modes,
                                         one_engine=len({x["engine"] for x in sc["results"]}) == 1)
                lines.append(rc.Line(_label(r["engine"], r.get("mode")), s.get(f"{key}_cdf_x", []),
                                     s.get(f"{key}_cdf_p", []), color, dash=dash, step=True))
            if any(ln.xs for ln in lines):
                xs = [x for ln in lines for x in ln.xs if x and x > 0]
                log = bool(xs) and max(xs) / min(xs) > 50
                out.append(self.render(rc.Chart(
                    f"{title}" + (f" ({clock} clock)" if clock else "") + f" — {words.scenario_title(sc['name'])}",
                    f"{key.upper()} (ms)" + (", log scale" if log else ""),
                    "share of " + ("requests" if key == "ttft" else "gaps") + " (%)", lines=lines, log_x=log,
                    subtitle="; ".join(x for x in (
                        f"{clock} clock only: not comparable with the other clock's chart" if clock else "",
                        delivery.chart_note(members) if key == "tbt" else "") if x),
                    x_format=lambda v: f"{v * 1000:g}", y_format=lambda v: f"{v * 100:g}", y_max=1.0,
                    width=440, height=TIMELINE_HEIGHT)))
        return out

    def sweep(self, sc: dict[str, Any], sw: dict[str, Any]) -> list[Markup]:
        """The sweep's charts, engines overlaid on one scale; engines measured on different clocks (a file
        merged from separate runs) get one set of charts per clock, never one scale across them."""
        clock = {r["engine"]: figures.clock_of(r) for r in sc["results"]}
        by_clock: dict[str, list[dict[str, Any]]] = {}
        for p in sw["points"]:
            by_clock.setdefault(clock.get(p["engine"], "wall"), []).append(p)
        if len(by_clock) < 2:
            return self._sweep_charts(sc, sw, "")
        return [c for name, pts in sorted(by_clock.items())
                for c in self._sweep_charts(sc, {**sw, "points": pts}, name)]

    def _sweep_charts(self, sc: dict[str, Any], sw: dict[str, Any], clock: str) -> list[Markup]:
        modes = list(dict.fromkeys(p.get("mode") for p in sw["points"]))
        groups: dict[tuple[str, str | None], list[dict]] = {}
        for p in sw["points"]:
            groups.setdefault((p["engine"], p.get("mode")), []).append(p)
        xs_all = [float(p["x"]) for p in sw["points"]]
        # counts and lengths spanning 8x or more on a log axis; shares of something (< 1) stay linear
        log = bool(xs_all) and min(xs_all) >= 1 and max(xs_all) / min(xs_all) >= 8
        if {"swap", "recompute"} <= set(modes):
            return self._cost(sc, sw, groups, modes, log)
        out = []
        for metric, title in (("output_throughput", "Throughput"), ("tbt_p99", "p99 inter-token gap"),
                              ("preemptions", "Preemptions")):
            lines, vlines, no_knee = [], [], []
            for (eng, mode), pts in groups.items():
                pts = sorted(pts, key=lambda p: p["x"])
                ys = [num(p["metrics"].get(metric)) for p in pts]
                if all(y is None for y in ys):
                    continue
                color, dash = self.style(eng, mode, modes, one_engine=len({e for e, _ in groups}) == 1)
                lines.append(rc.Line(_label(eng, mode), [p["x"] for p in pts], ys, color, dash=dash, dots=True))
                # a knee is where more concurrency stops paying; on any other axis (a policy's headroom)
                # "throughput stops rising" is no landmark. The run's one knee fact, from the medians.
                k = self.facts.knee(sc["name"], eng, mode) if sw["name"] == figures.KNEE_SWEEP else None
                if k is not None and k.x is None:
                    no_knee.append(_label(eng, mode))  # still rising at the top: no knee within the sweep
                elif k is not None and k.x is not None and metric != "preemptions":
                    vlines.append(rc.VLine(k.x, f"knee {k.text} ({_label(eng, mode)})", color))
            if not lines:
                continue
            fmt = (lambda v: f"{v:,.0f}") if metric != "tbt_p99" else (lambda v: f"{v * 1000:g}")
            unit = {"output_throughput": "tokens/s", "tbt_p99": "ms", "preemptions": "count"}[metric]
            # three to a row: a narrower canvas keeps the text as large as in the two-column charts
            sub = ""
            if metric == "output_throughput" and sw["name"] == figures.KNEE_SWEEP:
                sub = "knee: throughput gains < 5% beyond it" + (
                    f"; none within the sweep for {', '.join(no_knee)}" if no_knee else "")
            if clock:
                sub = "; ".join(x for x in (f"{clock} clock only: not comparable with the other clock", sub) if x)
            out.append(self.render(rc.Chart(f"{title} vs {sw['x_label']}" + (f" ({clock} clock)" if clock else ""),
                                            sw["x_label"], unit, width=440,
                                            height=300, lines=lines, vlines=vlines, y_format=fmt, log_x=log,
                                            y_integer=metric == "preemptions", subtitle=sub)))
        return out

    def _cost(self, sc: dict[str, Any], sw: dict[str, Any], groups: dict, modes: list, log: bool) -> list[Markup]:
        """Cost by x per engine and mode with the crossover marked, and swap ÷ recompute by x."""
        lines, ratio_lines, vlines = [], [], []
        metric_used = None
        multi = len({e for e, _ in groups}) > 1
        for eng in dict.fromkeys(e for e, _ in groups):
            metric, curves = figures.cost_curves(sw, eng)
            metric_used = metric_used or metric
            for mode, pts in curves.items():
                # one engine: colour by mode; several: colour by engine, dash by mode
                color = self.colors.get(eng, rc.PALETTE[0]) if multi else rc.PREEMPT_COLORS.get(mode, "#444")
                lines.append(rc.Line(_label(eng, mode), [x for x, _ in pts], [y for _, y in pts], color,
                                     dash=None if mode == "recompute" else "7 4", dots=True))
            cx = self.facts.crossovers.get(eng)
            if cx is not None and cx.scenario == sc["name"]:
                ratio_lines.append(rc.Line(eng, list(cx.xs), [s / r if r else None for s, r in
                                                              zip(cx.swap, cx.recompute, strict=True)],
                                           self.colors.get(eng, rc.PALETTE[0]), dots=True))
                # a crossing inside the noise is no landmark (R2): the advice and the chart say the same thing
                if cx.x is not None and not cx.within_noise:
                    vlines.append(rc.VLine(cx.x, f"crossover {cx.text} ({eng})", self.colors.get(eng, "#444")))
        cost = self.render(rc.Chart(f"Preempt-and-resume cost by {sw['x_label']}", sw["x_label"], "cost (ms)",
                                    lines=lines, vlines=vlines, log_x=log, y_format=lambda v: f"{v * 1000:g}",
                                    subtitle=f"{metric_used or 'cost'} · solid: recompute · dashed: swap · "
                                             "lower is cheaper"))
        ratio = self.render(rc.Chart(f"Swap ÷ recompute cost by {sw['x_label']}", sw["x_label"],
                                     "swap cost ÷ recompute cost", lines=ratio_lines, vlines=vlines, log_x=log,
                                     hlines=[rc.VLine(1.0, "equal cost", "#444")],
                                     y_format=lambda v: f"{v:g}×",
                                     subtitle="below 1×: swap is cheaper; above: recompute is"))
        return [cost, ratio]


def _scenario_event(sc: dict[str, Any]) -> tuple[str, float] | None:
    """The scenario's landmark on the workload's clock: ("surge", t) from its parameters or results."""
    params = sc.get("parameters", {})
    for key, name in (("surge_start_s", "surge"), ("wave_start_s", "wave")):
        t = num(params.get(key))
        if t is None:
            t = next((v for r in sc["results"] if (v := num(r["metrics"].get(key))) is not None), None)
        if t is not None:
            return f"{name} starts", t
    return None


def _workload_axis(res: dict[str, Any]) -> Any:
    """On the step clock, a function from a trace time (the wall seconds the engine's steps took) to the
    workload's seconds (step index x seconds per step), interpolated between the recorded steps; None on
    the wall clock (its trace times are the workload's) or without the mapping (older results)."""
    if figures.clock_of(res) != "step":
        return None
    s = res.get("series", {})
    pairs = [(float(t), float(w)) for t, w in zip(s.get("t", []), s.get("workload_t", []), strict=False)
             if t is not None and w is not None]
    if len(pairs) < 2:
        return None
    ts, ws = [p[0] for p in pairs], [p[1] for p in pairs]

    def move(t: float) -> float:
        return float(np.interp(t, ts, ws))

    return move


def _step_axis_words(stepped: list[dict[str, Any]]) -> tuple[str, str]:
    """(x-axis title, subtitle note) of a timeline drawn on the step clock's workload seconds: the stated
    seconds per step beside what a step measured, so neither is mistaken for the other."""
    per_step = sorted({float(v) for r in stepped if (v := num((r.get("clock") or {}).get("step_seconds")))})
    measured = [v for r in stepped if (v := num(r["metrics"].get("step_duration_mean"))) is not None]
    stated = " / ".join(fmt_time(v) for v in per_step) or "a fixed time"
    note = f"1 step = {stated} of workload"
    if measured:
        lo, hi = min(measured), max(measured)
        note += ", measured " + (fmt_time(lo) if abs(hi - lo) < 1e-4 else f"{fmt_time(lo)}–{fmt_time(hi)}")
    return "workload time (s, by engine step)", note


def _event_time(res: dict[str, Any], t_workload: float) -> float | None:
    """Where a workload time falls on a result's timeline: the same on the wall clock; on the step
    clock the first point whose ``workload_t`` reached it (None for older results without it)."""
    if figures.clock_of(res) == "wall":
        return t_workload
    s = res.get("series", {})
    return next((t for t, w in zip(s.get("t", []), s.get("workload_t", []), strict=False)
                 if w is not None and w >= t_workload), None)


def _engine_mode(label: str) -> tuple[str, str | None]:
    """The inverse of :func:`_label`."""
    if label.endswith("]") and " [" in label:
        engine, mode = label[:-1].split(" [", 1)
        return engine, mode
    return label, None


def claims_matrix(sc: dict[str, Any]) -> dict[str, Any] | None:
    """The scenario's claims once: claim x engine (results of one engine share their claims; a mode
    whose verdict differs gets its own column). A cell is True (held), False (failed), a string (undecided:
    the reason) or None (not a claim of that engine's run)."""
    columns: list[tuple[str, dict[str, bool | str]]] = []
    for r in sc["results"]:
        checks = {**(r.get("undecided") or {}), **(r.get("checks") or {})}
        if not checks:
            continue
        same = next((c for name, c in columns if name.split(" [")[0] == r["engine"] and c == checks), None)
        if same is None:
            columns.append((_label(r["engine"], r.get("mode")), checks))
    if not columns:
        return None
    if len({name.split(" [")[0] for name, _ in columns}) == len(columns):
        columns = [(name.split(" [")[0], c) for name, c in columns]  # one column per engine: no mode needed
    claims = list(dict.fromkeys(k for _, c in columns for k in c))
    return {"engines": [name for name, _ in columns],
            "rows": [{"claim": k, "cells": [c.get(k) for _, c in columns]} for k in claims]}


def _one_clock_tables(sc: dict[str, Any], tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A scenario's own tables, said to be across clocks when its results mix them: rows side by side
    are then not to be compared, and each table says so (a run puts every engine on one clock)."""
    bursts = delivery.chart_note(sc["results"])  # a table's gap columns of an engine that delivered in bursts
    if moved := sampler_cost.table_note(sc["results"]):  # gap columns kvbench's own sampler moved
        bursts = "; ".join(x for x in (bursts, moved) if x)
    if bursts:
        tables = [{**t, "note": "; ".join(x for x in (t.get("note") or "", "TBT columns " + bursts) if x)}
                  if any("TBT" in str(c) or "gap" in str(c) for c in t.get("columns") or []) else t for t in tables]
    mixed = figures.mixed_clocks_words(sc["results"])
    if not mixed:
        return tables
    return [{**t, "note": "; ".join(x for x in (t.get("note") or "", "not comparable row to row: " + mixed) if x)}
            for t in tables]


def _scenario_views(results: Results, charts: _Charts) -> list[dict[str, Any]]:
    views = []
    for sc in results.scenarios:
        res_views = []
        for res in sc["results"]:
            # the p99 gap with what kvbench's own /metrics sampler did to it beside it (kvbench.bench.sampler_cost)
            gist = " · ".join(f"{metric_label(k)} {figures.fmt_value(k, res)}" if k != "tbt_p99" else
                              f"{metric_label(k)} {fmt_metric(k, res['metrics'][k])} ({sampler_cost.aside(res)})"
                              + (f", {bursts}" if (bursts := delivery.not_comparable(k, res)) else "") for k in
                              ("output_throughput", "tbt_p99", "preemptions") if res["metrics"].get(k) is not None)
            moved = sampler_cost.note(res)
            res_views.append({"label": _label(res["engine"], res.get("mode")), "gist": gist,
                              "clock": figures.clock_of(res), "notes": [*res.get("notes", []), *([moved] if moved
                                                                                                 else [])]})
        sweeps = [c for sw in sc["sweeps"] for c in charts.sweep(sc, sw)]
        decl = scoreboard.declaration(sc["name"])
        pressure = scoreboard.pressure_of(sc)
        views.append({"name": sc["name"], "description": sc.get("description", ""), "sweep_columns":
                      3 if len(sweeps) % 3 == 0 else 2,
                      "tables": _one_clock_tables(sc, decl.tables(sc) if decl is not None else []),
                      "pressure": pressure.describe() if pressure is not None else [],
                      # a fact recorded at run time (from one repeat) is shown where the report computes it
                      "parameters": {k: v for k, v in sc.get("parameters", {}).items()
                                     if k not in figures.DERIVED_KEYS},
                      "has_server_metrics": any("server_t" in r.get("series", {}) for r in sc["results"]),
                      "dists": charts.cdfs(sc, ("ttft",)), "timelines": charts.timelines(sc, charts.FIRST_TIMELINES),
                      "more_charts": [*charts.timelines(sc, [t[1] for t in charts.TIMELINES
                                                             if t[1] not in charts.FIRST_TIMELINES]),
                                      *charts.cdfs(sc, ("tbt",))], "claims": claims_matrix(sc),
                      "sweeps": sweeps, "results": res_views,
                      # a title in words, notes every result shares said once, the extra views (R2)
                      "title": words.scenario_title(sc["name"]), "common_notes": words.common_notes(sc["results"]),
                      "extras": extra_charts.scenario_extras(sc, charts, lambda e, m: charts.style(e, m, [m]))})
    return views


# --------------------------------------------------------------------------------------------
# entry points


def render_report(results: Results, baseline: Results | None = None, *, previous: dict[str, str] | None = None,
                  index_href: str | None = None, plan_href: str | None = None) -> str:
    """The report of ``results`` as one self-contained HTML document (see the module docstring).
    ``previous`` ({name, href}): the baseline is that earlier run (linked); ``index_href``: the run index;
    ``plan_href``: the capacity plan (``kvbench simulate --report``) the recommendation links."""
    delivery.annotate(results.data)  # an engine bursty anywhere in the run: its gap figures marked everywhere
    charts = _Charts(results)
    base = baseline_section(results, baseline) if baseline is not None else None
    verdicts = first_screen.verdicts(results)
    headlines = [{**h, "verdict": ""} for h in scoreboard.agree_with_verdicts(headline_ratios(results), verdicts)]
    if base is not None:  # a card says whether its scenario regressed
        for h in headlines:
            regressed = [r for r in base["regressions"] if r.startswith(h["scenario"] + " /")]
            h["verdict"] = "regressed" if regressed else "no regression"
    context = {
        "version": __version__,
        "data": _without_series(results.to_dict()),
        "run_label": _run_label(results),
        "machine_label": machine_label(results),
        "machine": results.machine,
        "commit": results.data.get("commit") or {},
        "engines": results.engines,
        "reference": baseline_engine_name(results),
        "headlines": headlines, "previous": previous, "index_href": index_href,
        "scoreboard": scoreboard.scoreboard(results, baseline_engine_name(results)),
        "verdicts": verdicts,
        "skipped": skipped_view.section(results),  # each scenario not measured on an engine, with the run's reason
        "clock_rule": clock_rule(results),
        "conformance": scoreboard.conformance_matrix(results),
        "preemption_costs": scoreboard.preemption_costs(results),
        "diagnosis": diagnose(results),
        "recommendations": (advice.recommendations(results, charts.facts, plan_href=plan_href)
                            if results.scenarios else []),
        "caveat": advice.caveat(results), "budget": f"{advice.PREEMPTION_BUDGET:g}", "plan_href": plan_href,
        "glossary": words.engine_glossary(results.engines),  # R2: each engine kind explained once
        "summary": summary_table(results),
        "side_by_side": side_by_side_view.tables(results),  # R2: engines named, each metric once
        "engine_settings": engine_settings_view.section(results),  # what each engine ran with, asked and confirmed
        "sim_validation": sim_validation.section(results),
        "scenarios": _scenario_views(results, charts),
        "baseline": base,
    }
    return _render("report.html", **context)


#: bulky parts of a results entry left out of the page (``results.json`` beside the report keeps them)
NOT_EMBEDDED = ("series", "repeats")


def _without_series(data: dict[str, Any]) -> dict[str, Any]:
    """The results as embedded in the page: every figure (medians and spreads), but not the timelines
    (the charts draw them) nor every repeat's figures; embedded, they made a quick run's report 2 MB."""
    def slim(item: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in item.items() if k not in NOT_EMBEDDED}

    out = dict(data)
    out["scenarios"] = [{**sc, "results": [slim(r) for r in sc["results"]],
                         "sweeps": [{**sw, "points": [slim(p) for p in sw["points"]]} for sw in sc["sweeps"]]}
                        for sc in data.get("scenarios", [])]
    return _rounded(out)


def _rounded(value: Any, digits: int = 6) -> Any:
    """Floats to ``digits`` significant digits, in nested dicts and lists: the page shows figures to
    three or four digits, and seventeen-digit floats were a quarter of a quick report's weight
    (``results.json`` keeps full precision)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v, digits) for v in value]
    return value


def write_text_file(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0644 whatever the umask or an earlier file's mode."""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    os.chmod(path, FILE_MODE)
    return path


def _clocks(results: Results) -> set[str]:
    """The clocks a file's results ran on: a run compares itself by default only with runs on the same."""
    return {figures.clock_of(r) for _, r in results.iter_results()}


def _scales(results: Results) -> set[str]:
    return {str(sc.get("parameters", {}).get("scale")) for sc in results.scenarios}


def previous_run(report_dir: str | os.PathLike[str], results: Results,
                 exclude: str | os.PathLike[str] | None = None) -> Path | None:
    """The newest earlier run in ``report_dir`` (a subfolder holding ``results.json``) with the same engines
    and scale as ``results``: what a run compares itself with by default. None when there is none; a
    folder whose results cannot be read is passed over."""
    created = results.data.get("created") or ""
    best: tuple[str, Path] | None = None
    skip = Path(exclude).resolve() if exclude is not None else None
    for path in Path(report_dir).glob("*/results.json"):
        if skip is not None and path.parent.resolve() == skip:
            continue
        try:
            other = Results.load(path)
        except (OSError, ValueError):
            continue
        when = other.data.get("created") or ""
        if (when < created and set(other.engine_names()) == set(results.engine_names())
                and _scales(other) == _scales(results) and _clocks(other) == _clocks(results)
                and (best is None or when > best[0])):
            best = (when, path)
    return best[1] if best else None


def write_report(results: Results | str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 baseline: Results | str | os.PathLike[str] | None = None, *, compare_previous: bool = True) -> Path:
    """Write ``out_dir/results.json`` and ``out_dir/report.html`` beside it, both mode 0644; returns the
    report's path. Without a ``baseline`` (and unless ``compare_previous`` is False) the report compares
    with the newest earlier run beside ``out_dir`` with the same engines and scale, and links it and the
    run index: the first screen then answers "did it regress"."""
    res = results if isinstance(results, Results) else Results.load(results)
    base = baseline if (baseline is None or isinstance(baseline, Results)) else Results.load(baseline)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(res.save(out / "results.json"), FILE_MODE)
    previous = None
    if base is None and compare_previous:
        prev = previous_run(out.parent, res, exclude=out)
        if prev is not None:
            base = Results.load(prev)
            previous = {"name": prev.parent.name, "href": "../" + urllib.parse.quote(prev.parent.name) + "/report.html"}
    others = [p for p in out.parent.glob("*/results.json") if p.parent.resolve() != out.resolve()]
    index = "../index.html" if others or (out.parent / "index.html").exists() else None
    return write_text_file(out / "report.html", render_report(res, base, previous=previous, index_href=index,
                                                              plan_href=plan_href(out)))


def plan_href(report_dir: str | os.PathLike[str]) -> str | None:
    """A relative link from a report in ``report_dir`` to the capacity plan (``kvbench simulate --report``
    writes ``plan.html``): the one in ``report_dir`` itself, else the newest in its parent folder or in a
    folder beside it (``reports/plan/plan.html``); None when no plan was made."""
    here = Path(report_dir)
    if (here / "plan.html").is_file():
        return "plan.html"
    plans = [p for p in (here.parent / "plan.html", *here.parent.glob("*/plan.html"))
             if p.is_file() and p.parent.resolve() != here.resolve()]
    if not plans:
        return None
    newest = max(plans, key=lambda p: p.stat().st_mtime)
    rel = newest.relative_to(here.parent)
    return "../" + "/".join(urllib.parse.quote(part) for part in rel.parts)


def write_index(report_dir: str | os.PathLike[str]) -> Path:
    """Write ``report_dir/index.html``: the trend of every run's headline metrics as small multiples
    (:mod:`kvbench.report.trend`), then every run (a subfolder holding ``results.json``) newest first. A
    folder whose results cannot be read is listed with the reason instead of failing."""
    root = Path(report_dir)
    root.mkdir(parents=True, exist_ok=True)
    runs, readable = [], []
    for res_path in sorted(root.glob("*/results.json")):
        run = {"name": res_path.parent.name, "has_report": (res_path.parent / "report.html").exists(),
               "href": trend.run_href(res_path.parent.name)}
        try:
            res = Results.load(res_path)
        except (OSError, ValueError) as e:
            run.update(error=str(e), created="", sort="")
            runs.append(run)
            continue
        ref = baseline_engine_name(res)
        storm = _find_scenario(res, "storm")
        tp = None
        if storm and ref:
            r = next((x for x in storm["results"] if x["engine"] == ref), None)
            tp = num(r["metrics"].get("output_throughput")) if r else None
        commit = res.data.get("commit") or {}
        run.update(error=None, created=res.data.get("created") or "", sort=res.data.get("created") or "", tp=tp,
                   commit=(commit.get("id") or "")[:10], dirty=bool(commit.get("dirty")),
                   branch=commit.get("branch") or "", engines=res.engine_names(), scenarios=res.scenario_names(),
                   machine=machine_label(res), storm_throughput=fmt_metric("output_throughput", tp) if tp else "–",
                   regressions=None)
        runs.append(run)
        readable.append(trend.Run(run["name"], run["created"], run["href"], run["has_report"], res))
    runs.sort(key=lambda r: r["sort"], reverse=True)
    html = _render("index.html", runs=runs, root=root.name, version=__version__, trend=trend.trend_view(readable))
    return write_text_file(root / "index.html", html)
