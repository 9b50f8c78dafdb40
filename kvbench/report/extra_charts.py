"""Three views a scenario card adds to its timelines, each only where the results hold its data:

* **host-pool usage over time** (``cpu_kv_usage``): where a result swapped, how full the host (swap) pool
  was; running it dry is what makes a swap engine fall back to recompute. A result that never swapped
  has no host-pool figure to show (its zeros are not measurements of a pool in use), so it is left out.
* **latency against load**: for a sweep over concurrency, the median and p99 end-to-end latency at each
  point, with error bars spanning the repeats (min to max), so a reader sees where latency climbs and
  whether two engines' points are apart beyond what their own repeats do.
* **goodput** (with ``--slo``): the share of requests that met every SLO, per result, as bars on a
  0-100% axis. Without ``--slo`` no result has it and nothing is drawn.

The builders take the report's chart styler (colours by engine, dashes by mode, unique ids) so these
charts match the others of the page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from markupsafe import Markup

from kvbench.bench.repeats import repeat_values
from kvbench.bench.scenarios.declare import num
from kvbench.report import charts as rc
from kvbench.report import scoreboard

#: the sweeps whose x is a load (concurrent requests): latency against load is drawn for these
LOAD_SWEEPS = ("concurrency",)
#: the latency figures drawn against load: (metric, how the legend names it, dash)
LOAD_LATENCIES = (("e2e_p50", "median", None), ("e2e_p99", "p99", "7 4"))


class Styler(Protocol):
    """What the report's chart builder offers (:class:`kvbench.report.render._Charts`)."""

    colors: dict[str, str]

    def render(self, chart: rc.Chart) -> Markup: ...


def _label(engine: str, mode: str | None) -> str:
    return f"{engine} [{mode}]" if mode else engine


def _color(styler: Styler, engine: str, index: int) -> str:
    return styler.colors.get(engine, rc.PALETTE[index % len(rc.PALETTE)])


def swapped(res: dict[str, Any]) -> bool:
    """True when the result moved blocks to the host pool (its counters say so, or its host pool filled)."""
    m = res.get("metrics") or {}
    if (num(m.get("swap_outs")) or 0) > 0 or (num(m.get("preemptions_swap")) or 0) > 0:
        return True
    values = [v for v in (res.get("series") or {}).get("cpu_kv_usage") or [] if v is not None]
    return any(v > 0 for v in values)


def _time_axis(res: dict[str, Any]) -> tuple[str, Callable[[float], float]]:
    """(x-axis title, trace time -> x) as the other timelines draw it: the step clock on the workload's own
    seconds (``workload_t`` beside each sample), the wall clock as it is."""
    s = res.get("series") or {}
    pairs = [(float(t), float(w)) for t, w in zip(s.get("t", []), s.get("workload_t", []), strict=False)
             if t is not None and w is not None]
    if (res.get("clock") or {}).get("clock") != "step" or len(pairs) < 2:
        return "time (s)", float
    ts, ws = [p[0] for p in pairs], [p[1] for p in pairs]
    return "workload time (s, by engine step)", lambda t: float(np.interp(t, ts, ws))


def host_pool(sc: dict[str, Any], styler: Styler, *, width: int = 440, height: int = 210) -> Markup | None:
    """Host (swap) pool usage over time, for a scenario whose point is running the host pool dry (its declared
    pressure says ``swap_fallback``), one line per result that swapped and whose sampled usage rose above
    zero; None otherwise. A flat zero from a result whose samples never caught the pool in use is not drawn:
    it would read as an empty pool where the counters say blocks were swapped."""
    pressure = scoreboard.pressure_of(sc)
    if pressure is None or not pressure.swap_fallback:
        return None
    lines, marks, legend = [], [], {}
    broken = 0
    x_title = "time (s)"
    modes = list(dict.fromkeys(r.get("mode") for r in sc["results"]))
    for i, r in enumerate(sc["results"]):
        s = r.get("series") or {}
        usage = s.get("cpu_kv_usage") or []
        if not swapped(r) or not any(v for v in usage if v is not None):
            continue
        label = _label(r["engine"], r.get("mode"))
        one_engine = len({x["engine"] for x in sc["results"]}) == 1  # then colour by mode, as the timelines do
        color = (rc.PALETTE[modes.index(r.get("mode")) % len(rc.PALETTE)] if one_engine
                 else _color(styler, r["engine"], i))
        x_title, move = _time_axis(r)
        xs = s.get("t", [])
        if "server_t" in s:  # samples polled from the server's /metrics: no segment across a polling gap
            xs, usage, n = rc.break_at_gaps(xs, usage)
            broken += n
        lines.append(rc.Line(label, [move(t) for t in xs], usage, color, dash=None if not lines else "7 4"))
        for t, mode in zip(s.get("preempt_t", []), s.get("preempt_mode", []), strict=False):
            c = rc.PREEMPT_COLORS.get(mode, "#d9434e")
            marks.append(rc.Marker(move(t), c, f"{label}: preempted ({mode})"))
            legend[f"preemption ({mode})"] = c
    if not lines:
        return None
    return styler.render(rc.Chart("Host (swap) pool usage", x_title, "host pool in use (%)", lines=lines,
                                  markers=marks, marker_legend=legend, y_format=lambda v: f"{v * 100:g}", y_max=1.0,
                                  subtitle="; ".join(x for x in ("a full host pool makes a swap engine fall back "
                                                                 "to recompute", rc.gap_note(broken)) if x),
                                  width=width, height=height))


def _errors(point: dict[str, Any], metric: str) -> tuple[float, float] | None:
    values = repeat_values(point, metric)
    return (min(values), max(values)) if len(values) >= 2 else None


def latency_vs_load(sw: dict[str, Any], styler: Styler, style: Callable[[str, str | None], tuple[str, str | None]],
                    *, clock: str | None = None, width: int = 440, height: int = 300) -> Markup | None:
    """End-to-end latency (median and p99) against the sweep's load, one line per engine (and mode) and
    figure, with the repeats' range as error bars; None for a sweep that is not over load or has no latency.
    ``clock``: the points' one clock, named in the title when the scenario's results are on several."""
    if sw.get("name") not in LOAD_SWEEPS:
        return None
    clock = clock or ""
    groups: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for p in sw["points"]:
        groups.setdefault((p["engine"], p.get("mode")), []).append(p)
    lines, repeats = [], 0
    for (engine, mode), pts in groups.items():
        pts = sorted(pts, key=lambda p: float(p["x"]))
        color, _ = style(engine, mode)
        for metric, word, dash in LOAD_LATENCIES:
            ys = [num(p["metrics"].get(metric)) for p in pts]
            if all(y is None for y in ys):
                continue
            errors = [_errors(p, metric) for p in pts]
            repeats = max(repeats, *(len(repeat_values(p, metric)) for p in pts))
            lines.append(rc.Line(f"{_label(engine, mode)} · {word}", [float(p["x"]) for p in pts], ys, color,
                                 dash=dash, dots=True, errors=errors))
    if not lines:
        return None
    xs = [float(p["x"]) for p in sw["points"]]
    log = min(xs) >= 1 and max(xs) / min(xs) >= 8
    bars = (f"bars: min to max over {repeats} repeats" if repeats >= 2 else
            "one run per point: no error bars")
    where = f" ({clock} clock)" if clock else ""
    sub = f"solid: median · dashed: p99 · {bars}" + (
        f" · {clock} clock only: not comparable with the other clock" if clock else "")
    return styler.render(rc.Chart(f"Latency vs {sw.get('x_label') or 'load'}{where}", sw.get("x_label") or "load",
                                  "end-to-end latency (s)", lines=lines, log_x=log, y_format=lambda v: f"{v:g}",
                                  subtitle=sub, width=width, height=height))


def _by_clock(sc: dict[str, Any], sw: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """The sweep once when its engines share a clock, else once per clock (two clocks are never drawn on one
    scale); the clock is the engine's in the scenario's results."""
    clock_of = {r["engine"]: (r.get("clock") or {}).get("clock", "wall") for r in sc["results"]}
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in sw["points"]:
        groups.setdefault(clock_of.get(p["engine"], "wall"), []).append(p)
    if len(groups) < 2:
        return [(None, sw)]
    return [(c, {**sw, "points": pts}) for c, pts in sorted(groups.items())]


def goodput(sc: dict[str, Any], styler: Styler, *, width: int = 440) -> Markup | None:
    """Bars of each result's goodput (share of requests meeting every ``--slo`` limit); None without it."""
    clocks = {(r.get("clock") or {}).get("clock", "wall") for r in sc["results"]}
    items = [(_label(r["engine"], r.get("mode")) + (f" ({(r.get('clock') or {}).get('clock', 'wall')} clock)"
                                                    if len(clocks) > 1 else ""), g, _color(styler, r["engine"], i))
             for i, r in enumerate(sc["results"]) if (g := num((r.get("metrics") or {}).get("goodput"))) is not None]
    if not items:
        return None
    sub = "share of requests meeting every --slo limit; higher is better" + (
        "; the clocks differ, so the bars are not compared across them" if len(clocks) > 1 else "")
    return rc.share_bars("Goodput: requests that met the SLO", items, subtitle=sub, width=width)


def scenario_extras(sc: dict[str, Any], styler: Styler,
                    style: Callable[[str, str | None], tuple[str, str | None]]) -> list[Markup]:
    """The extra views of one scenario card, in the order drawn: host pool, latency vs load, goodput."""
    out = [host_pool(sc, styler),
           *(latency_vs_load(part, styler, style, clock=clock) for sw in sc.get("sweeps") or []
             for clock, part in _by_clock(sc, sw)),
           goodput(sc, styler)]
    return [c for c in out if c is not None]
