"""``kvbench compare A.json B.json --html OUT.html``: two runs side by side as one self-contained page.

What the text gate prints, in a page: the verdict first (regressions beyond the noise and the thresholds,
missing results), both runs' headline cards per scenario side by side, every (scenario, engine, mode) x
key metric with both runs' values and the change (coloured only beyond the noise,
:func:`~kvbench.report.render.baseline_section`), and the gate's every comparison. Like the report it is
rendered with autoescape and references no URL.
"""

from __future__ import annotations

from typing import Any

from kvbench import __version__
from kvbench.bench import gate
from kvbench.bench.formatting import metric_label
from kvbench.bench.results import Results
from kvbench.report import render


def _run(results: Results, path: str) -> dict[str, Any]:
    return {"path": path, "label": render._run_label(results), "machine": render.machine_label(results),
            "engines": results.engine_names()}


def _headlines(baseline: Results, current: Results) -> list[dict[str, Any]]:
    """Per scenario of either run: its headline card in A and in B (None where the run lacks it)."""
    a = {h["scenario"]: h for h in render.headline_ratios(baseline)}
    b = {h["scenario"]: h for h in render.headline_ratios(current)}
    return [{"scenario": s, "a": a.get(s), "b": b.get(s)} for s in dict.fromkeys([*a, *b])]


def _gate_rows(verdict: gate.Verdict) -> list[dict[str, Any]]:
    rows = []
    for d in verdict.deltas:
        status = "regression" if d.regressed else ("within noise" if d.within_noise else "ok")
        rows.append({"where": render._label(f"{d.scenario} / {d.engine}", d.mode), "metric": metric_label(d.metric),
                     "basis": d.basis, "a": gate.format_value(d.baseline), "b": gate.format_value(d.current),
                     "change": gate.format_change(d), "noise": gate.format_value(d.noise) if d.noise else "–",
                     "threshold": str(d.threshold), "status": status,
                     "cls": {"regression": "bad", "within noise": "same"}.get(status, "")})
    return rows


def render_compare(baseline: Results, current: Results, verdict: gate.Verdict, *, baseline_path: str = "A",
                   current_path: str = "B", thresholds: str = "") -> str:
    """The page of ``current`` (B) against ``baseline`` (A) with the gate's ``verdict``."""
    matrix = render.baseline_section(current, baseline)
    return render._render("compare.html", version=__version__, a=_run(baseline, baseline_path),
                          b=_run(current, current_path), verdict=verdict, summary=verdict.summary(),
                          failures=verdict.failure_lines(), notes=verdict.notes, thresholds=thresholds,
                          headlines=_headlines(baseline, current), matrix=matrix, gate_rows=_gate_rows(verdict))
