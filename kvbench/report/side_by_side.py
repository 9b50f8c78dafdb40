"""The report's "Engines side by side": per scenario run by two or more engines, each engine against the
run's reference engine in the same mode, labelled with both engines and the direction of every ratio.

Rules (tests/kvbench/test_report_side_by_side.py holds each):

* every ratio is headed "<engine> ÷ <reference>" and its verdict is worded for that engine ("▲ better":
  the engine beats the reference on that metric, whichever way the metric points);
* each metric appears once per pair: one row per metric, from :data:`METRICS`, which names no quantity twice
  (no count beside its rate or share);
* trivial rows are dropped: a metric missing or zero on every engine (0 ÷ 0), and no ratio is formed with
  a zero or missing side (the two values are shown, the ratio reads "–" and counts for nothing);
* noise is shown only where the repeats measured it: a ratio of single runs, or of a count that the
  repeats reproduced exactly, carries no "±";
* an engine whose run of the scenario failed a claim has its line open with that, before any ratio;
* engines on different clocks are listed as not compared, never given a ratio; so is a gap figure (p99 TBT...)
  of an engine that delivered its tokens in bursts (:mod:`kvbench.core.delivery`).
"""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from kvbench.bench import sampler_cost
from kvbench.bench.formatting import fmt_noisy_ratio, metric_label
from kvbench.bench.repeats import is_count
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import num
from kvbench.core import delivery
from kvbench.report import charts as rc
from kvbench.report import figures, first_screen, words
from kvbench.report.diagnosis import baseline_engine_name

#: the rows of a side-by-side table: one quantity each
METRICS: tuple[str, ...] = (
    "output_throughput", "goodput", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "e2e_p50", "e2e_p99",
    "preemptions", "recomputed_tokens", "swap_bandwidth", "prefix_hit_rate", "starvation_max_s", "kv_usage_mean",
    "waiting_max",
)
#: how many beyond-the-noise ratios a scenario's collapsed line names per engine
GIST_ITEMS = 4
#: the metrics drawn as ratio bars above a table
BAR_METRICS: tuple[str, ...] = ("output_throughput", "goodput", "ttft_p99", "tbt_p99", "e2e_p50", "preemptions")


def _label(res: dict[str, Any]) -> str:
    return res["engine"] + (f" [{res['mode']}]" if res.get("mode") else "")


def _measured_noise(metric: str, noise: float | None) -> float | None:
    """The noise to print: None for single runs and for a count the repeats reproduced exactly."""
    if noise is None or noise <= 0 or is_count(metric):
        return None
    return noise


def ratio_cell(metric: str, other: dict[str, Any], base: dict[str, Any], sc: dict[str, Any]) -> dict[str, Any]:
    """``other ÷ base`` of ``metric`` as a cell: text, CSS class, verdict word, tooltip, and whether it counts."""
    c = figures.compare(metric, other, base, sc)
    if c.not_comparable:
        return {"text": "not compared", "cls": "na", "word": "", "tip": c.not_comparable, "counts": False}
    if c.ratio is None or not c.a:
        return {"text": "–", "cls": "na", "word": "", "tip": "no ratio: zero or missing on one side", "counts": False}
    noise = _measured_noise(metric, c.noise)
    word = {"better": "▲ better", "worse": "▼ worse"}.get(c.verdict, "≈ within noise")
    tip = f"{_label(other)} ÷ {_label(base)}" + (f", noise ±{noise:.0%} from the repeats" if noise else
                                                  ", no noise measured (single run or exact count)")
    return {"text": fmt_noisy_ratio(c.ratio, noise), "cls": c.cls, "word": word, "tip": tip,
            "counts": c.verdict in ("better", "worse")}


def _table(sc: dict[str, Any], base: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    columns = [base, *others]
    rows, beyond = [], []
    for metric in METRICS:
        values = [num(r["metrics"].get(metric)) for r in columns]
        if all(not v for v in values):  # missing or zero everywhere: nothing to compare
            continue
        ratios = [ratio_cell(metric, o, base, sc) for o in others]
        rows.append({"label": metric_label(metric), "ratios": ratios,
                     "cells": [figures.fmt_value(metric, r, compact=True) for r in columns]})
        beyond += [(o["engine"], f"{metric_label(metric)} {x['text']} {x['word']}")
                   for o, x in zip(others, ratios, strict=True) if x["counts"]]
    return {"mode": base.get("mode"), "base": _label(base), "others": [_label(o) for o in others],
            "ratio_heads": [f"{o['engine']} ÷ {base['engine']}" for o in others], "rows": rows,
            "beyond": beyond, "chart": _bars(sc, base, others)}


def _bars(sc: dict[str, Any], base: dict[str, Any], others: list[dict[str, Any]]) -> Markup | None:
    drawn: list[tuple[str, str, figures.Comparison, dict[str, Any]]] = []
    for metric in BAR_METRICS:
        for o in others:
            c = figures.compare(metric, o, base, sc)
            if c.ratio is not None and not c.not_comparable and c.a:
                drawn.append((metric, o["engine"], c, ratio_cell(metric, o, base, sc)))
    if not drawn:
        return None
    engines = list(dict.fromkeys(engine for _, engine, _, _ in drawn))  # those compared: the title names only them
    bars = [rc.Bar(metric_label(metric) + (f" · {engine}" if len(engines) > 1 else ""), c.ratio,
                   {"better": True, "worse": False}.get(c.verdict), cell["tip"], text=cell["text"])
            for metric, engine, c, cell in drawn]
    names = " and ".join(f"{engine} ÷ {base['engine']}" for engine in engines)
    return rc.ratio_bars(names + (f" [{base['mode']}]" if base.get("mode") else ""), bars,
                         subtitle="green: the engine is better beyond the noise, red: worse, grey: within the noise "
                                  "(whichever way the metric points; clipped at 4×)")


def tables(results: Results) -> list[dict[str, Any]]:
    """Per scenario with two or more engines: one table per mode, each other engine against the reference
    engine (the run's first engine where the reference did not run) in that mode."""
    delivery.annotate(results.data)  # gap ratios with an engine that delivered in bursts: not compared
    ref = baseline_engine_name(results)
    out = []
    for i, sc in enumerate(results.scenarios):
        res = sc["results"]
        engines = list(dict.fromkeys(r["engine"] for r in res))
        if len(engines) < 2:
            continue
        base_engine = ref if ref in engines else engines[0]
        groups = []
        for mode in dict.fromkeys(r.get("mode") for r in res):
            base = next((r for r in res if r["engine"] == base_engine and r.get("mode") == mode), None)
            others = [r for r in res if r.get("mode") == mode and r is not base and r["engine"] != base_engine]
            if base is None or not others:
                continue
            groups.append(_table(sc, base, others))
        if not groups:
            continue
        not_compared = sorted({why for g in groups for row in g["rows"] for x in row["ratios"]
                               if x["text"] == "not compared" and (why := x["tip"])
                               and "tokens delivered in bursts" not in why})
        # gap cells of an engine that delivered in bursts carry a footnote mark: its note says why, once
        not_compared += [note] if (note := delivery.table_note(res)) else []
        by_engine: dict[str, list[str]] = {}
        for g in groups:
            for engine, text in g["beyond"]:
                by_engine.setdefault(engine, []).append(text + (f" [{g['mode']}]" if g["mode"] else ""))
        compared = {o for g in groups for row in g["rows"]
                    for o, x in zip(g["others"], row["ratios"], strict=True) if x["text"] != "not compared"}
        gist = []
        for engine in engines:
            if engine == base_engine:
                continue
            items = by_engine.get(engine, [])
            if not any(o.split(" [")[0] == engine for o in compared):
                summary = "not compared (different clocks)" if not_compared else "no ratio to form"
            elif items:  # the summary line stays one line: the first few, then how many more (the table has all)
                summary = " · ".join(items[:GIST_ITEMS]) + (
                    f" · and {len(items) - GIST_ITEMS} more beyond the noise" if len(items) > GIST_ITEMS else "")
            else:
                summary = "every ratio within the noise"
            failed = first_screen.failed_claims([r for r in res if r["engine"] == engine])
            if failed:  # its figures come from a run that did not do the workload: said before any ratio
                summary = f"its run failed ({'; '.join(failed)}), so these ratios are no result: {summary}"
            gist.append(f"{engine} vs {base_engine}: {summary}")
        base_failed = first_screen.failed_claims([r for r in res if r["engine"] == base_engine])
        if base_failed:
            not_compared.insert(0, f"{base_engine}'s own run failed ({'; '.join(base_failed)}): every ratio "
                                   "against it is no result")
        out.append({"scenario": words.scenario_title(sc["name"]), "href": f"#scenario-{i + 1}",
                    "reference": base_engine, "groups": groups, "gist": gist, "not_compared": not_compared,
                    # gap ratios kvbench's own /metrics sampler moved (kvbench.bench.sampler_cost)
                    "notes": [f"TBT ratios {moved}." for moved in [sampler_cost.table_note(res)] if moved]})
    return out
