"""The report's first screen: per scenario, who wins on the metric the scenario is about, by how much,
whether that is beyond the noise, at what cost, and what an operator should do.

Rules (each has a test in tests/kvbench/test_report_first_screen.py):

* **One clock.** Engines measured on two clocks (a file merged from separate runs) are not ranked:
  the row says so (a run puts all its engines on one clock, :mod:`kvbench.bench.clock_rule`).
* **No gap metric from a bursty server.** A score computed from the spacing of tokens (a p99 inter-token gap)
  is not ranked where any engine compared delivered its tokens in bursts, in this scenario or elsewhere in
  the run (:mod:`kvbench.core.delivery`): its gaps measure its server's writer.
* **A win is beyond the noise.** The leader's margin over the runner-up must exceed the noise of
  that ratio (:func:`kvbench.bench.repeats.honest_ratio_noise`: the repeats' spreads, the spread of
  the ratios taken round by round, and what two runs of an identical schedule in this file did).
  Within the noise nobody is crowned, whatever else the leader pays.
* **A win has a price tag.** The winner's preemptions and TTFT against the runner-up's are stated; a
  win paid for with more preemptions or a worse tail TTFT (beyond their noise) is a trade-off, and
  the action says so instead of recommending the winner outright.
* **Advice only with its evidence.** The action names a setting only where the row's own evidence
  earned it (a win beyond noise); "level" rows recommend no change; a scenario that compares one
  engine's settings (admission control) recommends one only where its goal was met beyond the noise,
  never where every setting's verdict is "no".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench import repeats, sampler_cost
from kvbench.bench.formatting import fmt_metric, fmt_noisy_ratio, fmt_time
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import NOISE_FLOOR_S, Score, is_time, num, result_of, within_noise
from kvbench.core import delivery
from kvbench.report import scoreboard
from kvbench.report.figures import clock_of, count_range, fmt_value, mixed_clocks_words

#: statuses of a row, in the words the page shows
WINS, TRADE_OFF, LEVEL, NOT_RANKED, ALONE, NOT_MEASURED, OWN_SETTINGS = (
    "wins", "wins at a cost", "level", "not ranked", "one engine", "not measured", "one engine's settings")
#: preemptions count as "more" only this many times the other's and by at least this many (one more
#: preemption in a storm of dozens is no price tag)
MORE_PREEMPTIONS_FACTOR, MORE_PREEMPTIONS_MIN = 1.2, 2


@dataclass
class Row:
    """One scenario's verdict, in words the template prints as they are."""

    scenario: str
    title: str
    metric: str = ""
    why: str = ""
    status: str = NOT_MEASURED
    winner: str = ""
    margin: str = ""
    noise: str = ""
    cost: str = ""
    action: str = ""
    standings: list[str] = field(default_factory=list)
    #: the engines level with the best within the noise, the best first (a "level" row's top group)
    level: list[str] = field(default_factory=list)
    #: the engines that ran the scenario and are not ranked on it (their run failed, decided nothing, or lacks
    #: the figure), each named with its reason in the standings
    unranked: list[str] = field(default_factory=list)

    @property
    def crowned(self) -> bool:
        return self.status in (WINS, TRADE_OFF)

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "title": self.title, "metric": self.metric, "why": self.why,
                "status": self.status, "winner": self.winner, "margin": self.margin, "noise": self.noise,
                "cost": self.cost, "action": self.action, "standings": self.standings, "crowned": self.crowned,
                "level": self.level, "unranked": self.unranked}


def verdicts(results: Results) -> list[dict[str, Any]]:
    """One row per scenario of ``results`` (see the module docstring)."""
    delivery.annotate(results.data)  # an engine bursty anywhere in the run: its gap figures are marked everywhere
    drift = repeats.identical_schedule_drift(results.scenarios)
    skipped = [s for s in results.data.get("skipped_scenarios") or [] if isinstance(s, Mapping)]
    return [verdict(sc, drift, [s for s in skipped if s.get("scenario") == sc["name"]]).to_dict()
            for sc in results.scenarios]


def failed_claims(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The claims that failed in any of ``results`` (one engine's run of a scenario, every mode), sorted."""
    return sorted({c for r in results for c, ok in (r.get("checks") or {}).items() if ok is False})


def _failed_or_undecided(results: Sequence[Mapping[str, Any]]) -> str | None:
    """Why an engine's run of a scenario (its ``results``, every mode) cannot be ranked: a claim failed (its
    figures come from a run that did not do what the scenario asks, e.g. requests that never finished), or
    nothing but the sanity claim was decided (the pressure the scenario is built for was not shown); None when
    it can."""
    from kvbench.bench.scenarios.common import SANITY_CLAIM

    failed = failed_claims(results)
    if failed:
        return "not ranked: its run failed (" + "; ".join(failed) + ")"
    decided = {c for r in results for c in (r.get("checks") or {}) if not c.startswith(SANITY_CLAIM)}
    open_ = {c for r in results for c in (r.get("undecided") or {}) if not c.startswith(SANITY_CLAIM)}
    if open_ and not decided:  # the claims' reasons are under "Not measured" (skipped_scenarios holds them)
        return (f"not ranked: nothing decided on it (undecided: {len(open_)} of its claim"
                f"{'' if len(open_) == 1 else 's'} about the scenario), so the pressure it is built for was not shown")
    return None


def not_rankable(sc: Mapping[str, Any], score: Score) -> dict[str, str]:
    """{engine: why} for each engine of ``sc`` that is not ranked on its score: its run failed or decided
    nothing (:func:`_failed_or_undecided`), or it ran the score's mode without the score's figure ("not
    exposed", never read as zero or left out without a word)."""
    measured = {r["engine"] for r in sc["results"] if r.get("mode") == score.mode
                and num(r["metrics"].get(score.metric)) is not None}
    out: dict[str, str] = {}
    engines = list(dict.fromkeys(r["engine"] for r in sc["results"]))
    for engine in engines:
        mine = [r for r in sc["results"] if r["engine"] == engine]
        why = _failed_or_undecided(mine)
        if why is not None:
            out[engine] = why
        elif engine not in measured and any(r.get("mode") == score.mode for r in mine):
            out[engine] = f"{score.label or score.metric}: not exposed (the engine does not report it)"
    return out


def verdict(sc: Mapping[str, Any], drift: Mapping[str, repeats.Drift] | None = None,
            skipped: Sequence[Mapping[str, Any]] = ()) -> Row:
    """The verdict of one results-file scenario ``sc``; ``skipped``: the run's notes of engines it was
    not measured on, and why (``skipped_scenarios`` of results.json)."""
    decl = scoreboard.declaration(sc["name"])
    title = (decl.title if decl is not None and decl.title else sc["name"].replace("_", " ").capitalize())
    row = Row(sc["name"], title)
    score = decl.score if decl is not None else scoreboard.DEFAULT_SCORE
    if score is None:
        return _own_settings(row, sc, decl)
    unranked = not_rankable(sc, score)
    row = _ranked(row, sc, score, drift, [s for s in skipped if s.get("engine") not in unranked], unranked)
    # every engine that ran the scenario and is not ranked is named with its reason, after the ranked ones
    row.standings += [f"{e}: {why}" for e, why in unranked.items()]
    row.unranked = list(unranked)
    return row


def _ranked(row: Row, sc: Mapping[str, Any], score: Score, drift: Mapping[str, repeats.Drift] | None,
            skipped: Sequence[Mapping[str, Any]], unranked: Mapping[str, str]) -> Row:
    """``row`` filled in from the engines of ``sc`` that can be ranked on ``score`` (not in ``unranked``)."""
    row.metric = score.label or score.metric
    row.why = score.why
    entries = [(r, v) for r in sc["results"] if r.get("mode") == score.mode and r["engine"] not in unranked
               and (v := num(r["metrics"].get(score.metric))) is not None]
    if not entries:
        row.action = ("Nothing to decide: no engine measured it." if not unranked else
                      "Nothing to decide: no engine's run of it can be ranked (each one's reason is listed).")
        return row
    if score.metric in scoreboard.PREEMPTION_COSTS:
        idle = [r["engine"] for r, _ in entries if num(r["metrics"].get("preemptions")) == 0]
        entries = [(r, v) for r, v in entries if r["engine"] not in idle]
        row.standings = [f"{e}: did not preempt, so the cost did not arise" for e in idle]
        if len(entries) < 2 and idle:
            row.status, row.action = NOT_RANKED, "No ranking: the cost arose on fewer than two engines."
            return row
    if len(entries) < 2:
        row.status = ALONE
        row.standings = [f"{entries[0][0]['engine']}: {fmt_value(score.metric, entries[0][0])}"]
        row.standings += [f"{s.get('engine')}: skipped ({s.get('reason')})" for s in skipped]
        if unranked:
            row.action = "Nothing to compare: only one engine's run of it can be ranked (the others' reasons listed)."
        else:
            row.action = ("Nothing to compare: only one engine ran it" + (", the others were skipped." if skipped
                                                                          else "; run it with two engines or more."))
        return row
    mixed = mixed_clocks_words([r for r, _ in entries])
    if mixed:
        row.status = NOT_RANKED
        row.margin = "not compared: measured on two clocks"
        row.standings = [f"{r['engine']}: {fmt_value(score.metric, r)} ({clock_of(r)} clock)" for r, _ in entries]
        row.action = "Run these engines in one session to rank them (kvbench then measures all on one clock)."
        return row
    bursts = delivery.not_comparable_among(score.metric, [r for r, _ in entries])
    if bursts:
        return _bursty(row, score, entries, bursts)
    entries.sort(key=lambda e: e[1], reverse=score.higher_is_better)
    (best, bv), (second, sv) = entries[0], entries[1]
    noise, sources = repeats.honest_ratio_noise(best, second, score.metric,
                                                repeats.drift_for(drift or {}, score.metric))
    row.noise = noise_words(noise, sources)
    if delivery.is_gap_metric(score.metric) and (moved := sampler_cost.table_note([r for r, _ in entries])):
        row.noise += f"; p99 gaps {moved}"  # the first screen says what kvbench's own observation did to the score
    ratio = (bv / sv if score.higher_is_better else sv / bv) if bv and sv else None
    small = is_time(score.metric) and max(bv, sv) < NOISE_FLOOR_S
    row.standings = standings(score, entries, drift) + row.standings  # after them, those that did not preempt
    if ratio is None:
        row.margin = f"{fmt_metric(score.metric, bv)} vs {fmt_metric(score.metric, sv)} ({second['engine']})"
    else:
        row.margin = f"{fmt_noisy_ratio(ratio, noise)} over {second['engine']}"
    if small or (ratio is not None and within_noise(ratio, noise)):
        row.status = LEVEL
        behind = _behind_the_best(score, entries, drift)
        top = [r["engine"] for r, _ in entries if r["engine"] not in {e for e, _ in behind}]
        row.level = top
        row.margin = ("level: both under " + fmt_time(NOISE_FLOOR_S)) if small else (
            f"{', '.join(top)} level within the noise ({best['engine']} ahead by {ratio:.2f}×, noise "
            f"±{(noise or 0.0) * 100:.0f}%)")
        if behind:
            row.margin += "; " + "; ".join(f"{e} behind by {text}" for e, text in behind)
        row.cost = price(best, second)
        row.action = level_action(entries, score, top, [e for e, _ in behind])
        return row
    row.winner = best["engine"]
    row.cost = price(best, second)
    paid = costs_more(best, second)
    row.status = TRADE_OFF if paid else WINS
    row.action = win_action(best, second, score, paid, noise_measured=noise is not None)
    return row


# --------------------------------------------------------------------------------------------
# the pieces of a row


def noise_words(noise: float | None, sources: Sequence[str]) -> str:
    """"±12% (repeats; round-by-round ratios)" or "single run: no noise measured"."""
    if noise is None:
        return "single run: no noise measured"
    return f"±{noise * 100:.0f}% ({'; '.join(sources)})" if sources else f"±{noise * 100:.0f}%"


def _value_observed(metric: str, result: Mapping[str, Any]) -> str:
    """A result's value of ``metric``, and beside a gap figure what kvbench's /metrics sampler did to it (the gap
    clear of its scrapes, :func:`kvbench.bench.sampler_cost.aside`) wherever a sampler ran."""
    value = fmt_value(metric, result)
    if not delivery.is_gap_metric(metric) or sampler_cost.of_result(result)["status"] == sampler_cost.NO_SAMPLER:
        return value
    return f"{value} [{sampler_cost.aside(result)}]"


def standings(score: Score, ranked: list[tuple[dict[str, Any], float]],
              drift: Mapping[str, repeats.Drift] | None) -> list[str]:
    """Every engine's value, best first, and its place against the best where the row's words do not say it
    (an engine behind beyond the noise, or level with the best, is named in the verdict's own words)."""
    best, bv = ranked[0]
    out = [f"{best['engine']}: {_value_observed(score.metric, best)} (best)"]
    for r, v in ranked[1:]:
        ratio = (bv / v if score.higher_is_better else v / bv) if bv and v else None
        noise, _ = repeats.honest_ratio_noise(best, r, score.metric, repeats.drift_for(drift or {}, score.metric))
        level = ratio is not None and within_noise(ratio, noise)
        where = ("level with the best" if level else
                 f"behind by {fmt_noisy_ratio(ratio, noise)}" if ratio is not None else "no ratio (a zero)")
        out.append(f"{r['engine']}: {_value_observed(score.metric, r)} ({where})")
    return out


def _preemptions(result: Mapping[str, Any]) -> float | None:
    return num(result["metrics"].get("preemptions"))


def more_preemptions(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """``a`` preempted more than ``b`` beyond chance: by the factor and the minimum, and, where the
    counts varied across repeats, with every repeat of ``a`` above every repeat of ``b``."""
    pa, pb = _preemptions(a), _preemptions(b)
    if pa is None or pb is None or pa - pb < MORE_PREEMPTIONS_MIN or pa < MORE_PREEMPTIONS_FACTOR * pb:
        return False
    ra, rb = count_range(a, "preemptions"), count_range(b, "preemptions")
    lo_a = ra[0] if ra else pa
    hi_b = rb[1] if rb else pb
    return lo_a > hi_b


def worse_ttft(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    """``a``'s p99 TTFT ÷ ``b``'s when it is worse beyond their noise, else None."""
    ta, tb = num(a["metrics"].get("ttft_p99")), num(b["metrics"].get("ttft_p99"))
    if ta is None or not tb or max(ta, tb) < NOISE_FLOOR_S:
        return None
    noise, _ = repeats.honest_ratio_noise(a, b, "ttft_p99", None)
    ratio = ta / tb
    return ratio if ratio > 1 and not within_noise(ratio, noise) else None


def costs_more(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What ``a`` pays beyond ``b`` (more preemptions, a worse p99 TTFT), in words; [] when nothing."""
    out = []
    if more_preemptions(a, b):
        pa, pb = _preemptions(a), _preemptions(b)
        assert pa is not None and pb is not None
        extra = f" ({(pa / pb - 1) * 100:.0f}% more)" if pb else ""
        out.append(f"it preempted {fmt_value('preemptions', a)} times against {fmt_value('preemptions', b)}{extra}")
    ttft = worse_ttft(a, b)
    if ttft is not None:
        out.append(f"its p99 TTFT is {ttft:.2g}× {b['engine']}'s")
    return out


def _count(metric: str, result: Mapping[str, Any]) -> str:
    """A count as the page shows it, "not exposed" where the engine does not count it."""
    return fmt_value(metric, result) if num(result["metrics"].get(metric)) is not None else "not exposed"


def price(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """``a``'s preemptions and p99 TTFT beside ``b``'s (the leader's price tag), as measured."""
    parts = []
    pa, pb = _preemptions(a), _preemptions(b)
    if pa is not None or pb is not None:  # one side not exposed reads so, never as none
        parts.append(f"preemptions {_count('preemptions', a)} vs {_count('preemptions', b)}")
    ta, tb = num(a["metrics"].get("ttft_p99")), num(b["metrics"].get("ttft_p99"))
    if ta is not None and tb is not None:
        parts.append(f"p99 TTFT {fmt_time(ta)} vs {fmt_time(tb)}")
    return (f"{a['engine']} vs {b['engine']}: " + "; ".join(parts)) if parts else ""


def win_action(best: Mapping[str, Any], second: Mapping[str, Any], score: Score,
               paid: list[str], *, noise_measured: bool = True) -> str:
    """What to do about a win; from single runs (no noise measured) it says so rather than "beyond the noise"."""
    what = score.label or score.metric
    if not paid:
        if not noise_measured:
            return (f"For this workload prefer {best['engine']}: better {what} at no higher cost, in a single run "
                    "(no noise measured: repeat it, --benchmark-repeats 3, before relying on it).")
        return f"For this workload prefer {best['engine']}: better {what} beyond the noise, at no higher cost."
    return (f"Trade-off, not a clear win: {best['engine']} if {what} matters most, but " + " and ".join(paid)
            + f"; otherwise {second['engine']}.")


def _behind_the_best(score: Score, ranked: list[tuple[dict[str, Any], float]],
                     drift: Mapping[str, repeats.Drift] | None) -> list[tuple[str, str]]:
    """(engine, "4.0× ±131%") of each engine behind the best beyond the noise of their ratio."""
    best, bv = ranked[0]
    out = []
    for r, v in ranked[1:]:
        ratio = (bv / v if score.higher_is_better else v / bv) if bv and v else None
        noise, _ = repeats.honest_ratio_noise(best, r, score.metric, repeats.drift_for(drift or {}, score.metric))
        if ratio is not None and not within_noise(ratio, noise):
            out.append((r["engine"], fmt_noisy_ratio(ratio, noise)))
    return out


def level_action(entries: list[tuple[dict[str, Any], float]], score: Score, top: Sequence[str] = (),
                 behind: Sequence[str] = ()) -> str:
    """No setting to recommend among the engines level at the top; those behind beyond the noise named as
    such; the fewest preemptions named only where that difference is itself beyond chance."""
    what = score.label or score.metric
    text = f"No change on this evidence: the engines are level on {what}."
    if behind:
        text = (f"Prefer {' or '.join(top)} over {', '.join(behind)} for {what} (behind beyond the noise); "
                f"between {' and '.join(top)} no change on this evidence.")
    results = [r for r, _ in entries]
    fewest = min(results, key=lambda r: _preemptions(r) if _preemptions(r) is not None else float("inf"))
    beaten = [r for r in results if r is not fewest and more_preemptions(r, fewest)]
    if beaten:
        text += (f" {fewest['engine']} preempted fewest ({fmt_value('preemptions', fewest)} vs "
                 + ", ".join(f"{fmt_value('preemptions', r)} on {r['engine']}" for r in beaten)
                 + "), where preemptions matter.")
    return text


def _bursty(row: Row, score: Score, entries: list[tuple[dict[str, Any], float]], why: str) -> Row:
    """Not ranked: the score is a gap figure and an engine compared delivered its tokens in bursts (its gaps
    measure its server's writer, :mod:`kvbench.core.delivery`)."""
    row.status = NOT_RANKED
    row.margin = f"not compared: {why}"
    row.standings = [f"{r['engine']}: {fmt_value(score.metric, r)}" for r, _ in entries]
    row.action = ("No ranking on this evidence: the gaps between tokens of a server that writes them in bursts say "
                  "when it wrote, not when its engine computed them. Compare these engines on throughput and TTFT; "
                  "a server kvbench starts can give its front end a core of its own (helper_cores=engine).")
    return row


def _own_settings(row: Row, sc: Mapping[str, Any], decl: Any) -> Row:
    """A scenario that compares one engine's settings rather than engines: its headline, and an action
    only where its own goal was met beyond the noise."""
    row.status = OWN_SETTINGS
    if decl is not None:
        h = decl.headline(sc, None)
        row.margin = f"{h.value}: {h.caption}" if h.value is not None else h.caption
    tradeoff = admission_tradeoff(sc)
    if tradeoff is not None:
        row.why = "admission control should cut preemptions without giving up throughput"
        row.action = tradeoff
    else:
        row.action = "See the scenario's section: it compares one engine's modes, not engines."
    return row


def admission_tradeoff(sc: Mapping[str, Any]) -> str | None:
    """What the admission trade-off table of a policies scenario earns: a setting whose goal verdict is
    "yes" (met beyond the noise), or no change when none is; None when ``sc`` has no such table."""
    from kvbench.bench.scenarios import policies

    rows = policies.tradeoff_rows(sc)
    if not rows:
        return None
    bursts = delivery.not_comparable_among("tbt_p99", sc.get("results") or [])
    if bursts:  # the goal is judged on the p99 inter-token gap: a bursty server's gaps earn no setting
        return f"No admission change on this evidence: the goal is judged on p99 TBT, and {bursts}."
    met = [r for r in rows if r[-1] == "yes"]
    if not met:
        near = [r[1] for r in rows if r[-1] == "within noise"]
        return ("No admission change: the goal (fewer preemptions and a lower p99 TBT at the same throughput) "
                "was not met beyond the noise at any setting" + (f"; within noise at {', '.join(near)}" if near
                                                                 else "") + ".")
    best = met[0]
    static = result_of(sc, best[0], best[1].partition("/")[0] + "/static")
    return (f"Consider {best[1].partition('/')[2]} on {best[0]}: it met the goal beyond the noise"
            + (f" (preemptions {best[2]})" if static is not None else "") + ".")
