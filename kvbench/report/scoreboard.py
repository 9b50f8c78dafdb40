"""The report's first screen: which engine leads each scenario and by how much (with its noise), the
conformance matrix, and where preemption cost each engine most.

Everything here reads a results file and the scenarios' declarations
(:mod:`kvbench.bench.scenarios.declare`); no scenario is known by name.
"""

from __future__ import annotations

import re
from typing import Any

from kvbench.bench.formatting import fmt_metric, fmt_noisy_ratio, fmt_time
from kvbench.bench.results import Results
from kvbench.bench.scenarios import SCENARIOS, Scenario
from kvbench.bench.scenarios.declare import (
    NOISE_FLOOR_S,
    Headline,
    Pressure,
    Score,
    is_time,
    noise_words,
    num,
    ratio_headline,
    ratio_noise,
    within_noise,
)
from kvbench.core import delivery
from kvbench.report.figures import clock_of, fmt_value, mixed_clocks_words

#: the score of a scenario this kvbench does not know (a results file from elsewhere)
DEFAULT_SCORE = Score("output_throughput", True, label="output throughput")
#: conformance outcomes, worst first (a cell of several records shows the worst's colour)
OUTCOME_ORDER = ("failed", "error", "xpassed", "passed", "xfailed", "skipped")


def declaration(name: str) -> Scenario | None:
    return SCENARIOS.get(name)


def pressure_of(sc: dict[str, Any]) -> Pressure | None:
    """The pressure a scenario declared: from the scenario class, else as recorded in the file, else None."""
    decl = declaration(sc["name"])
    if decl is not None:
        return decl.pressure
    stored = sc.get("pressure")
    if isinstance(stored, dict):
        known = {k: stored[k] for k in Pressure.__dataclass_fields__ if k in stored}
        return Pressure(**known)
    return None


def headlines(results: Results, reference: str | None) -> list[dict[str, Any]]:
    """One card per scenario in the results, from the scenario's own ``headline`` declaration."""
    delivery.annotate(results.data)
    cards = []
    for sc in results.scenarios:
        decl = declaration(sc["name"])
        h: Headline = (decl.headline(sc, reference) if decl is not None else
                       ratio_headline(sc, reference, title=sc["name"], metric="output_throughput",
                                      what="output throughput"))
        mixed = mixed_clocks_words(sc["results"])
        if mixed and h.value is not None:
            # a scenario's own headline compares its engines: not across two clocks
            h = Headline(h.title, "not compared", mixed[0].upper() + mixed[1:])
        score = decl.score if decl is not None else None
        bursts = (delivery.not_comparable_among(score.metric, sc["results"])
                  if score is not None and h.value is not None else "")
        if bursts:  # a headline on the scenario's gap metric, from an engine that delivered in bursts
            h = Headline(h.title, "not compared", f"{h.caption}: {bursts}")
        cards.append({**h.to_dict(), "scenario": sc["name"]})
    return cards


def agree_with_verdicts(cards: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Headline cards that do not contradict the first screen: where the verdict found its scenario level
    within the noise (which may count more noise than the card's own repeats: one workload measured twice),
    a card still showing a ratio beyond its noise is marked within noise and points at the verdict."""
    level = {v["scenario"]: v for v in verdicts if v.get("status") == "level"}
    unranked = {v["scenario"]: v.get("unranked") or [] for v in verdicts}
    ranked_on = {v["scenario"]: v["metric"] for v in verdicts
                 if v.get("metric") and v.get("status") in ("wins", "wins at a cost", "level")}
    out = []
    for card in cards:
        if not card.get("measured") and card.get("scenario") in ranked_on:
            # "Evening surge: not measured" above a verdict that ranks the evening surge reads as a contradiction:
            # the card's own figure is what was not measured, and it says which one the verdict used
            card = {**card, "caption": f"{card.get('caption', '')}; this card's figure only: the verdict ranks the "
                                       f"scenario on {ranked_on[card['scenario']]}"}
            out.append(card)
            continue
        # a card about an engine the verdict does not rank (its run failed or decided nothing) is no finding
        caption = str(card.get("caption", ""))
        pair = re.match(r"(\S+) ÷ (\S+) ", caption)
        not_ranked = unranked.get(card.get("scenario"), [])
        named = set(pair.groups()) if pair else {e for e in not_ranked if f"({e})" in caption}
        off = [e for e in not_ranked if e in named]
        if off and card.get("measured"):
            card = {**card, "within_noise": True, "value": "not ranked",
                    "caption": f"{caption}: {card.get('value')}; not ranked: the verdict does not rank "
                               f"{', '.join(off)} on this run (its reason is in the verdict)"}
            out.append(card)
            continue
        v = level.get(card.get("scenario"))
        # the card's ratio is "<engine> ÷ <engine> ...": reconciled only when both are level in the verdict
        pair = re.match(r"(\S+) ÷ (\S+) ", str(card.get("caption", "")))
        same = v is not None and pair is not None and {pair.group(1), pair.group(2)} <= set(v.get("level") or [])
        if same and card.get("measured") and not card.get("within_noise") and "×" in str(card.get("value")):
            caption = f"{card['caption']}: {card['value']}, within the noise the verdict counts ({v['noise']})"
            card = {**card, "within_noise": True, "value": "within noise", "caption": caption}
        out.append(card)
    return out


def scoreboard(results: Results, reference: str | None) -> list[dict[str, Any]]:
    """Per scenario: the engines' values of its declared score, the leader, by what ratio, with its noise."""
    delivery.annotate(results.data)
    rows = []
    for sc in results.scenarios:
        decl = declaration(sc["name"])
        score = decl.score if decl is not None else DEFAULT_SCORE
        row: dict[str, Any] = {"scenario": sc["name"], "metric": "", "values": [], "leader": "", "by": "",
                               "noise": "", "within_noise": False, "note": "", "standings": [], "idle": []}
        rows.append(row)
        if score is None:
            row["note"] = "one engine's modes against each other: see the headline"
            continue
        row["metric"] = score.label or score.metric + (f" [{score.mode}]" if score.mode else "")
        entries = [(r, num(r["metrics"].get(score.metric))) for r in sc["results"] if r.get("mode") == score.mode]
        entries = [(r, v) for r, v in entries if v is not None]
        row["values"] = [(r["engine"], fmt_value(score.metric, r)) for r, v in entries]
        if not entries:
            row["note"] = "not measured"
            continue
        # a lead on a cost of preemption is judged only where the cost was incurred: an engine that never
        # preempted here paid nothing, which is not a lead (it did not face the same storm)
        idle = []
        if score.metric in PREEMPTION_COSTS:
            idle = [r for r, _ in entries if num(r["metrics"].get("preemptions")) == 0]
            entries = [(r, v) for r, v in entries if r not in idle]
            row["idle"] = [r["engine"] for r in idle]
        if len(entries) < 2:
            if entries:
                row["leader"] = entries[0][0]["engine"]
            row["note"] = ("the only engine measured" if not idle else
                           f"not ranked: {', '.join(row['idle'])} never preempted here, so the cost did not arise")
            row["leader"] = row["leader"] if not idle else ""
            row["standings"] = [f"{r['engine']}: did not preempt" for r in idle]
            continue
        mixed = mixed_clocks_words([r for r, _ in entries])
        if mixed:
            # figures from two clocks are never compared (kvbench.bench.clock_rule): a run puts all its
            # engines on one clock, so two clocks in one file mean results merged from separate runs
            row["note"] = "not ranked: " + mixed
            row["standings"] = [f"{r['engine']}: {fmt_value(score.metric, r)} ({clock_of(r)} clock)"
                                for r, _ in entries]
            continue
        bursts = delivery.not_comparable_among(score.metric, [r for r, _ in entries])
        if bursts:  # gaps of a server that writes tokens in bursts measure its writer: never crowned on
            row["note"] = "not ranked: " + bursts
            row["standings"] = [f"{r['engine']}: {fmt_value(score.metric, r)}" for r, _ in entries]
            continue
        entries.sort(key=lambda e: e[1], reverse=score.higher_is_better)
        (best, bv), (second, sv) = entries[0], entries[1]
        ratio = (bv / sv if score.higher_is_better else sv / bv) if bv and sv else None
        noise = ratio_noise(best, second, score.metric)
        row["noise"] = noise_words(noise)
        small = is_time(score.metric) and max(bv, sv) < NOISE_FLOOR_S
        if ratio is None:  # a zero on one side (e.g. nothing recomputed): the values say it, a ratio cannot
            row["leader"] = best["engine"]
            row["by"] = f"{fmt_metric(score.metric, bv)} vs {fmt_metric(score.metric, sv)} ({second['engine']})"
        elif small or within_noise(ratio, noise):
            row["within_noise"] = True
            row["by"] = "within noise" + (f" (both < {fmt_time(NOISE_FLOOR_S)})" if small else
                                          f" ({fmt_noisy_ratio(ratio, noise)})")
        else:
            row["leader"], row["by"] = best["engine"], f"{fmt_noisy_ratio(ratio, noise)} over {second['engine']}"
        row["standings"] = _standings(score, entries) + [f"{r['engine']}: did not preempt" for r in idle]
    return rows


#: scores that are a cost of preemption: ranked only among engines that preempted
PREEMPTION_COSTS = frozenset({"recomputed_tokens", "recomputed_share", "preemptions", "preemptions_per_s",
                              "swapped_out_bytes", "swap_seconds", "starvation_max_s", "preempted_request_share"})


def _standings(score: Score, ranked: list[tuple[dict[str, Any], float]]) -> list[str]:
    """Every engine's place against the best (``ranked`` best first): "leads", "level with the best
    (within noise)" or "behind: 2.0× ±10%" (the best's advantage over it), so no engine goes unmentioned."""
    (best, bv) = ranked[0]
    out = [f"{best['engine']}: best ({fmt_value(score.metric, best)})"]
    for r, v in ranked[1:]:
        ratio = (bv / v if score.higher_is_better else v / bv) if bv and v else None
        noise = ratio_noise(best, r, score.metric)
        small = is_time(score.metric) and max(bv, v) < NOISE_FLOOR_S
        if ratio is None:
            where = f"{fmt_value(score.metric, r)} (no ratio: a zero)"
        elif small or within_noise(ratio, noise):
            where = f"level with the best, within noise ({fmt_value(score.metric, r)})"
        else:
            where = f"behind by {fmt_noisy_ratio(ratio, noise)} ({fmt_value(score.metric, r)})"
        out.append(f"{r['engine']}: {where}")
    return out


def conformance_matrix(results: Results) -> dict[str, Any] | None:
    """Engine x check from ``results["conformance"]`` (None when the file has no conformance records)."""
    records = results.data.get("conformance") or []
    if not records:
        return None
    engines = list(dict.fromkeys(r.get("engine", "?") for r in records))
    checks = list(dict.fromkeys(r.get("check", "?") for r in records))
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        cells.setdefault((r.get("engine", "?"), r.get("check", "?")), []).append(r)
    rows = []
    for check in checks:
        row = []
        for engine in engines:
            recs = cells.get((engine, check), [])
            if not recs:
                row.append({"text": "–", "cls": "none", "tip": "not run"})
                continue
            counts: dict[str, int] = {}
            for r in recs:
                counts[r.get("outcome", "error")] = counts.get(r.get("outcome", "error"), 0) + 1
            worst = min(counts, key=lambda o: OUTCOME_ORDER.index(o) if o in OUTCOME_ORDER else 0)
            near = sum(int(r.get("near_ties") or 0) for r in recs)
            text = " · ".join(f"{n} {o}" if len(recs) > 1 else o for o, n in counts.items())
            if near:
                text += f" (near-tie ×{near})"
            tips = []
            for r in recs:
                bits = [r.get("nodeid", ""), r.get("outcome", "")]
                if r.get("reason"):
                    bits.append(str(r["reason"]))
                if r.get("evidence"):
                    bits.append(", ".join(f"{k}={v}" for k, v in r["evidence"].items()))
                if r.get("knob_overrides"):
                    bits.append("knobs overrode: " + ", ".join(f"{k} {v[0]}→{v[1]}" if isinstance(v, list | tuple)
                                                               and len(v) == 2 else f"{k} {v}"
                                                               for k, v in r["knob_overrides"].items()))
                tips.append(" — ".join(b for b in bits if b))
            row.append({"text": text, "cls": worst, "tip": "\n".join(tips)})
        rows.append({"check": check, "cells": row})
    return {"engines": engines, "rows": rows}


def preemption_costs(results: Results) -> list[dict[str, Any]]:
    """For each engine: the scenario where preemption cost it most (largest share of work redone or of
    time spent copying swapped blocks), and its longest wait after a preemption."""
    out = []
    for engine in results.engine_names():
        worst: tuple[float, str, str] | None = None
        longest: tuple[float, str] | None = None
        preempted = exposed = False
        for sc, res in results.iter_results():
            if res["engine"] != engine:
                continue
            m = res["metrics"]
            exposed = exposed or num(m.get("preemptions")) is not None
            if not num(m.get("preemptions")):
                continue
            preempted = True
            where = sc["name"] + (f" [{res['mode']}]" if res.get("mode") else "")
            rec = num(m.get("recomputed_share"))
            swap_s, dur = num(m.get("swap_seconds")), num(m.get("duration_s"))
            for share, text in ((rec, "of computed tokens were recomputed"),
                                (swap_s / dur if swap_s is not None and dur else None,
                                 "of the run went to copying swapped blocks")):
                if share is not None and (worst is None or share > worst[0]):
                    worst = (share, where, text)
            wait = num(m.get("starvation_max_s"))
            if wait is not None and (longest is None or wait > longest[0]):
                longest = (wait, where)
        if not preempted:  # a count not exposed is never read as none
            out.append({"engine": engine, "text": "never preempted" if exposed else "preemptions not exposed"})
            continue
        parts = []
        if worst is not None:
            parts.append(f"{worst[1]}: {worst[0] * 100:.1f}% {worst[2]}")
        if longest is not None:
            parts.append(f"longest wait after a preemption {fmt_time(longest[0])} ({longest[1]})")
        out.append({"engine": engine, "text": "; ".join(parts) or "preempted, cost not exposed"})
    return out
