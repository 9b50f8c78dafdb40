"""plan.html: the capacity plan of a simulator sweep as one self-contained page, beside plan.json.

Contract: :func:`render_plan` takes a :class:`~kvbench.sim.capacity_plan.PlanDocument` and returns one
HTML document with inline CSS, inline SVG charts and the report's few lines of inline script (sortable
tables); it references no URL. It renders through the report's jinja2 environment
(:func:`kvbench.report.render._render`: autoescape on, strict undefined), so every name that reaches
the page (engine spec, model, hardware profile, workload, knob values) is escaped; the charts escape
their own text (:mod:`kvbench.report.charts`). The page states that every time on it is simulated
seconds on the named hardware profile and model, and whether that profile is calibrated.

:func:`write_plan_report` writes ``plan.html`` and ``plan.json`` (the document as plain JSON), mode 0644.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from markupsafe import Markup

from kvbench import __version__
from kvbench.report import charts as rc
from kvbench.report.render import _render, write_text_file
from kvbench.sim.capacity_plan import PlanDocument, group_label, group_runs
from kvbench.sim.simulate import SimRun, fmt_ms, fmt_number

PLAN_HTML, PLAN_JSON = "plan.html", "plan.json"
#: a group of runs as :func:`~kvbench.sim.capacity_plan.group_runs` keys it: its other knobs, sorted
GroupKey = tuple[tuple[str, Any], ...]

#: what the charts draw against each swept knob: (figure, title, y label, tick format)
CHART_FIGURES: tuple[tuple[str, str, str, Any], ...] = (
    ("output_throughput", "Throughput", "output tokens/s", lambda v: f"{v:,.0f}"),
    ("tbt_p99", "p99 inter-token gap", "ms", lambda v: f"{v * 1000:g}"),
    ("preemptions_per_request", "Preemptions per request", "preemptions/request", lambda v: f"{v:g}"),
)


def write_plan_report(doc: PlanDocument, out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``out_dir/plan.html`` and ``out_dir/plan.json`` (creating ``out_dir``), both mode 0644, and
    return their paths. The page is rendered before either file is written. Raises OSError when the
    folder or a file cannot be written."""
    html = render_plan(doc)
    data = json.dumps(doc.to_json(), indent=2, allow_nan=False) + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_text_file(out / PLAN_JSON, data)
    return write_text_file(out / PLAN_HTML, html), json_path


def render_plan(doc: PlanDocument) -> str:
    """The page of ``doc``: what was simulated, the plan (knees, pools, swap vs recompute, the cost
    model's crossover), charts against each swept knob, the runs and the plan as printed."""
    by_knob = plan_charts(doc)
    charts = {"max_num_seqs": by_knob.pop("max_num_seqs", []), "num_gpu_blocks": by_knob.pop("num_gpu_blocks", []),
              "other": by_knob}
    return _render("plan.html", version=__version__, setup=doc.setup, plan=doc.plan, charts=charts,
                   modes=_mode_table(doc), runs=_runs_table(doc.runs), label=group_label, fmt=fmt_number, ms=fmt_ms)


def varying_knobs(doc: PlanDocument) -> list[str]:
    """The knobs whose value differs between runs, in sweep order (then run order)."""
    keys = list(dict.fromkeys([*doc.setup.sweep, *(k for r in doc.runs for k in r.knobs)]))
    return [k for k in keys if len({repr(r.knobs.get(k)) for r in doc.runs}) > 1]


def plan_charts(doc: PlanDocument) -> dict[str, list[Markup]]:
    """Per numeric knob that varies (two or more values): throughput, p99 TBT and preemptions per
    request against it, one line per group of runs sharing the other knobs. Knees are marked on
    ``max_num_seqs``; the budget and each group's pool on ``num_gpu_blocks``."""
    varying = varying_knobs(doc)
    # (knob, figure) -> (what the mark is, the x it sits at per group label)
    marks = {("max_num_seqs", "output_throughput"):
             ("knee", {group_label(k.group): k.max_num_seqs for k in doc.plan.knees or []}),
             ("num_gpu_blocks", "preemptions_per_request"):
             ("pool", {group_label(p.group): p.num_gpu_blocks for p in doc.plan.pools or []})}
    out: dict[str, list[Markup]] = {}
    uid = 0
    for knob in varying:
        values = [r.knobs.get(knob) for r in doc.runs]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            continue
        groups = group_runs(doc.runs, knob)
        log = min(values) >= 1 and max(values) / min(values) >= 8  # counts and sizes; shares stay linear
        styles = _line_styles(list(groups))
        charts = []
        for figure, title, unit, y_format in CHART_FIGURES:
            lines, hlines = [], []
            what, at = marks.get((knob, figure), ("", {}))
            marked: dict[float, set[str]] = {}  # x -> colours of the groups marked there
            for rest, runs in groups.items():
                runs = sorted(runs, key=lambda r: r.knobs[knob])
                legend = ", ".join(f"{k}={v}" for k, v in rest if k in varying) or "all runs"
                color, dash = styles[rest]
                lines.append(rc.Line(legend, [r.knobs[knob] for r in runs], [r.figures.get(figure) for r in runs],
                                     color, dash=dash, dots=True))
                x = at.get(group_label(dict(rest)))
                if x is not None:
                    marked.setdefault(x, set()).add(color)
            # one short mark per x (the tables above name the groups): long labels collide at the top
            vlines = [rc.VLine(x, f"{what} {x:g}", colors.pop() if len(colors) == 1 else "#444")
                      for x, colors in sorted(marked.items())]
            if knob == "num_gpu_blocks" and figure == "preemptions_per_request":
                hlines.append(rc.VLine(doc.plan.preemption_budget, f"budget {doc.plan.preemption_budget:g}",
                                       "#d9434e"))
            uid += 1
            charts.append(rc.render(rc.Chart(f"{title} vs {knob}", knob + (", log scale" if log else ""), unit,
                                             lines=lines, vlines=vlines, hlines=hlines, y_format=y_format,
                                             log_x=log, width=440, height=300, subtitle=_subtitle(knob, figure)),
                                    uid=f"p{uid}"))
        out[knob] = charts
    return out


#: line dashes by preemption mode: the modes of one group of other knobs share its colour
_DASHES = (None, "7 4", "2 3", "10 3 2 3")


def _line_styles(groups: list[GroupKey]) -> dict[GroupKey, tuple[str, str | None]]:
    """(colour, dash) per group: colour by the knobs other than preemption_mode, dash by the mode, so
    swap and recompute runs that coincide still read as two lines of one colour."""

    def without_mode(rest: GroupKey) -> GroupKey:
        return tuple((k, v) for k, v in rest if k != "preemption_mode")

    colours = list(dict.fromkeys(without_mode(rest) for rest in groups))
    modes = list(dict.fromkeys(dict(rest).get("preemption_mode") for rest in groups))
    return {rest: (rc.PALETTE[colours.index(without_mode(rest)) % len(rc.PALETTE)],
                   _DASHES[modes.index(dict(rest).get("preemption_mode")) % len(_DASHES)]) for rest in groups}


def _subtitle(knob: str, figure: str) -> str:
    if knob == "max_num_seqs" and figure == "output_throughput":
        return "knee: the smallest max_num_seqs within 5% of its line's best"
    if knob == "num_gpu_blocks" and figure == "preemptions_per_request":
        return "pool: the smallest num_gpu_blocks within the budget"
    return ""


def _mode_table(doc: PlanDocument) -> dict[str, Any]:
    """Swap vs recompute as a table: one row per group, one column group per mode (in run order)."""
    comparisons = doc.plan.modes or []
    names = list(dict.fromkeys(m.mode for c in comparisons for m in c.modes))
    rows = [{"group": group_label(c.group), "claims": c.claims,
             "cells": [next((m for m in c.modes if m.mode == name), None) for name in names]}
            for c in comparisons]
    return {"names": names, "rows": rows}


#: the runs table's figure columns: (header, figure, formatter)
RUN_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("output tok/s", "output_throughput", fmt_number),
    ("TTFT p50", "ttft_p50", fmt_ms),
    ("TTFT p99", "ttft_p99", fmt_ms),
    ("p99 TBT", "tbt_p99", fmt_ms),
    ("preemptions (recompute)", "preemptions_recompute", lambda v: fmt_number(v, 0)),
    ("preemptions (swap)", "preemptions_swap", lambda v: fmt_number(v, 0)),
    ("preemptions / request", "preemptions_per_request", lambda v: fmt_number(v, 3)),
    ("recomputed tokens", "recomputed_tokens", lambda v: fmt_number(v, 0)),
    ("swapped out GB", "swapped_out_bytes", lambda v: fmt_number(None if v is None else v / 1e9, 2)),
)


def _runs_table(runs: list[SimRun]) -> dict[str, Any]:
    """Every run: one column per knob, the figures (text and raw value to sort by), wall seconds."""
    knobs = list(dict.fromkeys(k for r in runs for k in r.knobs))
    rows = [{"knobs": [r.knobs.get(k, "") for k in knobs], "requests": r.requests,
             "cells": [{"text": fmt(r.figures.get(key)), "sort": "" if r.figures.get(key) is None
                        else r.figures[key]} for _, key, fmt in RUN_COLUMNS],
             "wall": f"{r.wall_seconds:.1f}"} for r in runs]
    return {"knobs": knobs, "headers": [h for h, _, _ in RUN_COLUMNS], "rows": rows}
