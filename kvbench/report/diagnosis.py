"""The report's diagnosis: a fixed order of checks, applied to a results file.

Order (docs/benchmarks.md#diagnosis, with its reading of a structural capacity gap):

1. Is the preemption count growing? (and does it span the whole run: a structural capacity gap)
2. Is KV usage pinned near 100%?
3. Concurrency and input lengths: does ``max_num_seqs`` exceed what the pool can hold?
4. Starvation: how long do preempted requests wait?
5. Swap bandwidth: is swap slow against recompute, or running out of host space?

Judged against expectation: every scenario declares the pressure it creates on purpose
(:class:`~kvbench.bench.scenarios.declare.Pressure`: preemptions, a pinned pool, waiting victims, a
forced preemption mode). A storm that preempts is doing its job, not a problem; what the diagnosis
reports is a deviation: pressure where none was declared, none where it was (better than expected),
or an engine doing markedly worse than the other engines on the same scenario.

Each check returns a status (``ok``, ``better than expected``, ``watch``, ``problem``, ``not
measured``), what it found with numbers, and a knob to try only when something is wrong, and only
a knob that applies to the engine's preemption mode (no swap-bandwidth advice to a recompute
engine). The thresholds below are rules of thumb, stated where used.
"""

from __future__ import annotations

import math
from typing import Any

from kvbench.bench.formatting import fmt_metric, fmt_ratio, fmt_time
from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import NOISE_FLOOR_S, Pressure, num, plural
from kvbench.report.figures import Crossover, Facts, clock_of
from kvbench.report.scoreboard import pressure_of

OK, BETTER, WATCH, PROBLEM, NOT_MEASURED = "ok", "better than expected", "watch", "problem", "not measured"
RANK = {PROBLEM: 4, WATCH: 3, BETTER: 2, OK: 1, NOT_MEASURED: 0}
#: "markedly worse than another engine on the same scenario": this many times its count, and by 3 or more
WORSE_FACTOR = 1.5


def baseline_engine_name(results: Results) -> str | None:
    """The engine others are compared with: kind "reference" first, then a name starting with
    "reference", else the first engine listed."""
    engines = results.engines
    for e in engines:
        if e.get("kind") == "reference":
            return e["name"]
    for e in engines:
        if str(e["name"]).startswith("reference"):
            return e["name"]
    return engines[0]["name"] if engines else None


# --------------------------------------------------------------------------------------------
# the knee and the crossover: read from the run's facts (computed once, see kvbench.report.figures)


def swap_crossover(results: Results, engine: str) -> Crossover | None:
    """Where swap and recompute cost the same for ``engine`` (the run's one :class:`Crossover` fact)."""
    return Facts.of(results).crossovers.get(engine)


def concurrency_knee(results: Results, engine: str) -> tuple[float | None, str]:
    """Knee of the first concurrency sweep of ``engine``; None when throughput still rose at the top
    of the sweep (no knee within it). Read from the run's one :class:`Knee` fact."""
    k = Facts.of(results).first_knee(engine)
    if k is None:
        return None, ""
    return k.x, f"{k.label}, {k.x_label} sweep of {k.scenario}"


# --------------------------------------------------------------------------------------------
# the checks

Row = tuple[dict[str, Any], dict[str, Any]]  # (scenario, result) of one engine


def _check(n: int, title: str, status: str, finding: str, knob: str) -> dict[str, Any]:
    # advice only where something is wrong: an "ok" item carries no "Try:"
    return {"n": n, "title": title, "status": status, "finding": finding,
            "knob": knob if status in (WATCH, PROBLEM) else ""}


def _where(sc: dict | None, res: dict | None) -> str:
    if sc is None or res is None:
        return ""
    return sc["name"] + (f" [{res['mode']}]" if res.get("mode") else "")


def engine_mode(results: Results, engine: str) -> str:
    """How ``engine`` preempts when a scenario does not force it: its ``preemption_mode`` option, else
    what its preemptions in unforced scenarios were, else recompute (vLLM's default; hf-cb's soft reset)."""
    e = results.engine(engine) or {}
    mode = (e.get("options") or {}).get("preemption_mode")
    if mode in ("swap", "recompute"):
        return str(mode)
    swaps = recomputes = 0.0
    for sc, res in results.iter_results():
        p = pressure_of(sc)
        if res["engine"] == engine and not (p and p.forced_mode):
            swaps += num(res["metrics"].get("preemptions_swap")) or 0
            recomputes += num(res["metrics"].get("preemptions_recompute")) or 0
    return "swap" if swaps > recomputes else "recompute"


def mode_label(results: Results, engine: str) -> str:
    """The diagnosis heading's words for how ``engine`` preempts: "preempts by <mode>" where its option, a
    setting it confirmed, or its own preemption counts say so; "preemption not exposed" for an engine that
    published no preemption figure in any result (llama.cpp): :func:`engine_mode`'s default is a guess there."""
    e = results.engine(engine) or {}
    mine = [res for _, res in results.iter_results() if res["engine"] == engine]
    confirmed = any(((res.get("settings") or {}).get("confirmed") or {}).get("preemption_mode") for res in mine)
    counted = any(num(res["metrics"].get(k)) is not None for res in mine
                  for k in ("preemptions", "preemptions_swap", "preemptions_recompute"))
    if (e.get("options") or {}).get("preemption_mode") or confirmed or counted:
        return f"preempts by {engine_mode(results, engine)}"
    return "preemption not exposed"


def _peers(results: Results, sc: dict, res: dict, key: str) -> list[tuple[str, float]]:
    """Other engines' values of ``key`` on the same scenario and mode, measured on the same clock (figures
    from two clocks are never set against each other)."""
    return [(r["engine"], v) for r in sc["results"] if r["engine"] != res["engine"] and r.get("mode") == res.get("mode")
            and clock_of(r) == clock_of(res) and (v := num(r["metrics"].get(key))) is not None]


def _worse_than_peers(results: Results, sc: dict, res: dict, key: str, value: float) -> str:
    """"worse than X (a vs b)" when markedly worse than the best other engine here, else ""."""
    peers = _peers(results, sc, res, key)
    if not peers:
        return ""
    best_engine, best = min(peers, key=lambda p: p[1])
    if value >= best * WORSE_FACTOR and value - best >= 3:
        return f"worse than {best_engine} on {_where(sc, res)} ({value:,.0f} vs {best:,.0f})"
    return ""


def _check_preemptions(results: Results, engine: str, rows: list[Row]) -> dict[str, Any]:
    title = "Is the preemption count growing?"
    # "toward the knee" only for an engine whose concurrency sweep has one (R2): without it there is no target
    knee, _ = concurrency_knee(results, engine)
    knob = ((f"Lower max_num_seqs toward the knee ({knee:g}); give" if knee is not None else "Give")
            + " the KV pool more blocks (gpu_memory_utilization, num_gpu_blocks).")
    known = [(sc, res, v) for sc, res in rows if (v := num(res["metrics"].get("preemptions"))) is not None]
    if not known:
        return _check(1, title, NOT_MEASURED, "The engine does not expose preemptions.", "")
    unexpected, structural, missing, worse, facts = [], [], [], [], []
    for sc, res, v in known:
        p = pressure_of(sc)
        m = res["metrics"]
        before = num(m.get("preemptions_before_surge"))
        if p is not None and not p.preemptions and v > 0:
            unexpected.append(f"preempted {plural(v, 'time')} in {_where(sc, res)}, which declares no preemption")
        elif p is not None and p.preemptions and v == 0:
            missing.append(_where(sc, res))
        if before:
            structural.append(f"{plural(before, 'preemption')} in {_where(sc, res)} before the surge began (a "
                              "structural capacity gap, not the safety net)")
        if p is None and (num(m.get("preemption_active_share")) or 0) >= 0.5:
            structural.append(f"preemptions through {(num(m.get('preemption_active_share')) or 0) * 100:.0f}% of "
                              f"{_where(sc, res)} (a structural capacity gap)")
        if v > 0 and (w := _worse_than_peers(results, sc, res, "preemptions", v)):
            worse.append(w)
    top_sc, top_res, top = max(known, key=lambda k: k[2])
    if top > 0:
        m = top_res["metrics"]
        fact = (f"Most in {_where(top_sc, top_res)}: {plural(top, 'preemption')} "
                f"(recompute {fmt_metric('preemptions', m.get('preemptions_recompute'))}, "
                f"swap {fmt_metric('preemptions', m.get('preemptions_swap'))})")
        most = num(m.get("max_preemptions_per_request"))
        if most:
            fact += f"; one request was preempted {plural(most, 'time')}"
        facts.append(fact + ".")
    growth = _sweep_growth(results, engine)
    if growth:
        facts.append(growth)
    if unexpected or structural:
        return _check(1, title, PROBLEM, " ".join([s[0].upper() + s[1:] + "." for s in unexpected + structural]
                                                   + facts), knob)
    if worse:
        return _check(1, title, WATCH, "Within the declared pressure, but " + "; ".join(worse) + ". " + " ".join(facts),
                      knob)
    if missing:
        return _check(1, title, BETTER, f"No preemption in {', '.join(missing)}, although the scenario declares "
                      "pressure: the engine kept up (or its pool is larger than the knobs asked for). "
                      + " ".join(facts), "")
    if top == 0:
        return _check(1, title, OK, "No preemptions in any scenario.", "")
    return _check(1, title, OK, "Preemptions only where the scenarios create them on purpose. " + " ".join(facts), "")


def _sweep_growth(results: Results, engine: str) -> str:
    for sc in results.scenarios:
        for sw in sc["sweeps"]:
            pts = sorted((p for p in sw["points"] if p["engine"] == engine
                          and num(p["metrics"].get("preemptions")) is not None), key=lambda p: p["x"])
            # preemptions growing with load is a concurrency sweep's question (not a policy's headroom,
            # whose points are several surges' series)
            if len(pts) >= 2 and sw["name"] == "concurrency" and {p.get("mode") for p in sw["points"]} != {
                    "swap", "recompute"}:
                first, last = pts[0], pts[-1]
                trend = "grows" if last["metrics"]["preemptions"] > first["metrics"]["preemptions"] else "does not grow"
                return (f"Across the {sw['x_label']} sweep it {trend}: {first['metrics']['preemptions']:,.0f} at "
                        f"{first['x']:g} -> {last['metrics']['preemptions']:,.0f} at {last['x']:g}.")
    return ""


def _check_kv(results: Results, rows: list[Row]) -> dict[str, Any]:
    title = "Is KV usage pinned near 100%?"
    knob = ("More KV blocks (gpu_memory_utilization, num_gpu_blocks); fewer concurrent sequences "
            "(max_num_seqs); cap max_model_len if long-context bursts fill the pool.")
    known = [(sc, res, v) for sc, res in rows if (v := num(res["metrics"].get("kv_usage_time_over_95"))) is not None]
    if not known:
        return _check(2, title, NOT_MEASURED, "The engine does not expose KV usage.", "")
    # Rules of thumb: pinned for a tenth of a run is worth watching, for half of it the pool is the bottleneck.
    bad = []
    for sc, res, v in known:
        p = pressure_of(sc)
        if v > 0.1 and (p is None or not p.kv_pinned):
            bad.append((sc, res, v, p is None))
    if bad:
        sc, res, v, undeclared = max(bad, key=lambda b: b[2])
        status = PROBLEM if v > 0.5 else WATCH
        why = "" if undeclared else ", which does not declare a full pool"
        return _check(2, title, status, f"In {_where(sc, res)}{why} the device pool was above 95% for {v * 100:.0f}% "
                      f"of the time (peak {fmt_metric('kv_usage_max', res['metrics'].get('kv_usage_max'))}).", knob)
    sc, res, v = max(known, key=lambda k: k[2])
    return _check(2, title, OK, f"Pinned only where a scenario fills the pool on purpose: at most {v * 100:.0f}% of "
                  f"the time above 95% ({_where(sc, res)}).", "")


def _capacity_tokens(params: dict[str, Any]) -> float | None:
    blocks, size = num(params.get("num_gpu_blocks")), num(params.get("block_size"))
    if blocks and size:
        return blocks * size
    return num(params.get("capacity_tokens"))


def _check_concurrency(results: Results, engine: str, rows: list[Row]) -> dict[str, Any]:
    title = "Concurrency and input lengths (max_num_seqs vs capacity)"
    knee, knee_where = concurrency_knee(results, engine)
    eng_opts = (results.engine(engine) or {}).get("options", {})
    facts, over, fits_min = [], [], None
    for sc, res in rows:
        m, params = res["metrics"], sc.get("parameters", {})
        cap = _capacity_tokens(params)
        per_req = (num(m.get("prompt_len_mean")) or 0) + (num(m.get("output_len_mean")) or 0)
        seqs = num(params.get("max_num_seqs")) or num(eng_opts.get("max_num_seqs"))
        if not cap or not per_req:
            continue
        fits = cap / per_req
        fits_min = fits if fits_min is None else min(fits, fits_min)
        p = pressure_of(sc)
        if seqs and seqs > fits and (num(m.get("preemptions")) or 0) > 0 and (p is None or not p.preemptions):
            over.append(f"{_where(sc, res)}: max_num_seqs = {seqs:g} but the pool holds ≈ {fits:.1f} requests of "
                        f"{per_req:,.0f} tokens, and it preempted")
        elif len(facts) < 2:
            facts.append(f"{_where(sc, res)}: the pool holds ≈ {fits:.1f} requests of {per_req:,.0f} tokens; up to "
                         f"{fmt_metric('running_max', m.get('running_max'))} ran at once, "
                         f"{fmt_metric('waiting_max', m.get('waiting_max'))} waited.")
    if knee is not None:
        facts.append(f"Throughput stops rising at {knee:g} ({knee_where}; gain < 5% beyond).")
    elif knee_where:
        facts.append(f"No knee within the sweep ({knee_where}): throughput still rose at its top.")
    if not facts and not over:
        return _check(3, title, NOT_MEASURED, "Scenario parameters lack the pool size (num_gpu_blocks, block_size) "
                      "and no concurrency sweep was run.", "")
    targets = [v for v in (knee, math.floor(fits_min) if fits_min else None) if v]
    knob = (f"Set max_num_seqs ≤ {min(targets):g}" if targets else "Lower max_num_seqs") + (
        "; for long prompts enable chunked prefill and size max_num_batched_tokens (512–2048) so one prefill "
        "cannot take a whole step.")
    if over:
        return _check(3, title, PROBLEM, "; ".join(over) + ". " + " ".join(facts), knob)
    return _check(3, title, OK, " ".join(facts), knob)


def _check_starvation(results: Results, rows: list[Row]) -> dict[str, Any]:
    title = "Starvation: how long do preempted requests wait?"
    knob = "Priority scheduling for latency-sensitive traffic; lower max_num_seqs so victims resume sooner."
    known = [(sc, res, v) for sc, res in rows if (v := num(res["metrics"].get("starvation_max_s"))) is not None]
    if not known:
        return _check(4, title, NOT_MEASURED, "The engine does not record preemption and resume times.", "")
    worst: list[tuple[str, str]] = []  # (status, finding)
    for sc, res, wait in known:
        if not wait:
            continue
        m, p = res["metrics"], pressure_of(sc)
        e2e = num(m.get("e2e_p50"))
        repeat = num(m.get("max_preemptions_per_request")) or 0
        # A wait longer than a typical whole request, or a request bounced three times, is starvation.
        starving = (e2e and wait > e2e) or repeat >= 3
        if not starving:
            continue
        text = (f"in {_where(sc, res)} a preempted request waited up to {fmt_time(wait)} against a median "
                f"end-to-end time of {fmt_time(e2e)}" + (f"; one was preempted {plural(repeat, 'time')}" if repeat
                                                         else ""))
        if p is not None and p.starvation:
            continue  # waiting victims are what this scenario declares
        peers = _peers(results, sc, res, "starvation_max_s")
        if p is not None and p.preemptions:
            best = min(peers, key=lambda q: q[1]) if peers else None
            if best and wait > 2 * best[1] and wait - best[1] > NOISE_FLOOR_S:
                worst.append((WATCH, f"{text}, over twice as long as {best[0]} ({fmt_time(best[1])})"))
        else:
            worst.append((PROBLEM, text))
    if worst:
        status = max((s for s, _ in worst), key=lambda s: RANK[s])
        return _check(4, title, status, "; ".join(t for _, t in worst).capitalize() + ".", knob)
    sc, res, wait = max(known, key=lambda k: k[2])
    if not wait:
        return _check(4, title, OK, "No preempted request waited.", "")
    return _check(4, title, OK, f"Waits stay within what the scenarios create on purpose: longest "
                  f"{fmt_time(wait)} in {_where(sc, res)}.", "")


def _check_swap(results: Results, engine: str, rows: list[Row]) -> dict[str, Any]:
    title = "Swap bandwidth: is swap slow against recompute?"
    mode = engine_mode(results, engine)
    facts: list[str] = []
    bw_rows = [(sc, res, v) for sc, res in rows if (v := num(res["metrics"].get("swap_bandwidth"))) is not None]
    if bw_rows:
        sc, res, bw = max(bw_rows, key=lambda r: r[2])
        m = res["metrics"]
        sides = [v for k in ("swapped_out_bytes", "swapped_in_bytes") if (v := num(m.get(k))) is not None]
        moved = sum(sides) if sides else None  # neither side exposed: "not exposed", never "0 B"
        facts.append(f"{_where(sc, res)}: swap moved {fmt_metric('swapped_out_bytes', moved)} at "
                     f"{fmt_metric('swap_bandwidth', bw)} ({fmt_time(m.get('swap_seconds'))} spent copying).")
    cx = swap_crossover(results, engine)
    quiet = cx is not None and cx.within_noise
    if cx:
        ratio = cx.swap[-1] / cx.recompute[-1] if cx.recompute[-1] else None
        if cx.x is None:
            facts.append(f"{cx.above.capitalize()} is cheaper at every {cx.x_label} measured "
                         f"(swap costs {fmt_ratio(ratio)} of recompute at {cx.xs[-1]:g}).")
        elif quiet:
            facts.append(f"Crossover {cx.text} ({engine}): the cost curves cross there, where both cost under "
                         f"{fmt_time(NOISE_FLOOR_S)}: within noise (swap costs {fmt_ratio(ratio)} of recompute at "
                         f"{cx.xs[-1]:g}).")
        else:
            facts.append(f"Crossover {cx.text} ({engine}): swap and recompute cost the same at that {cx.x_label}; "
                         f"{cx.above} is cheaper above it (swap costs {fmt_ratio(ratio)} of recompute at "
                         f"{cx.xs[-1]:g}).")
    exposed = any(num(res["metrics"].get(k)) is not None for _, res in rows
                  for k in ("preemptions_swap", "preemptions_recompute", "preemptions"))
    if not facts and not exposed:
        return _check(5, title, NOT_MEASURED, "No preemption counts, swap activity or swap-vs-recompute sweep for "
                      "this engine.", "")
    if mode != "swap":
        # swap advice to an engine that does not swap is noise; the forced-swap scenarios' figures stay as facts
        return _check(5, title, OK, f"{engine} preempts by recompute, so swap bandwidth does not limit it"
                      + (". Measured where a scenario forces swap: " + " ".join(facts) if facts else "."), "")
    knob = ("swap_space (host GiB) if swap falls back to recompute; preemption_mode=recompute for sequences shorter "
            "than the crossover.")
    unexpected = []
    for sc, res in rows:
        fb, p = num(res["metrics"].get("swap_fallbacks")), pressure_of(sc)
        if fb and (p is None or not p.swap_fallback):
            unexpected.append(f"{_where(sc, res)}: host swap space ran out, fell back to recompute "
                              f"{plural(fb, 'time')}.")
    if unexpected:
        return _check(5, title, PROBLEM, " ".join(unexpected + facts), knob)
    if cx and cx.x is not None and not quiet:
        lens = sorted(v for _, r in rows if (v := num(r["metrics"].get("prompt_len_mean"))))
        if lens and cx.above == "swap" and lens[len(lens) // 2] < cx.x:
            facts.append(f"Your prompts average {lens[len(lens) // 2]:,.0f} tokens, below the crossover: recompute "
                         "would suit them.")
            return _check(5, title, WATCH, " ".join(facts), knob)
    if not facts:
        return _check(5, title, NOT_MEASURED, "No swap activity or swap-vs-recompute sweep for this engine.", "")
    return _check(5, title, OK, " ".join(facts), "")


def diagnose(results: Results) -> list[dict[str, Any]]:
    """One entry per engine (the reference first): ``{engine, mode, checks: [5 checks], worst}``."""
    ref = baseline_engine_name(results)
    names = results.engine_names()
    ordered = ([ref] if ref in names else []) + [n for n in names if n != ref]
    out = []
    for engine in ordered:
        rows = [(sc, res) for sc, res in results.iter_results() if res["engine"] == engine]
        if not rows and not any(p["engine"] == engine for sc in results.scenarios for sw in sc["sweeps"]
                                for p in sw["points"]):
            continue
        checks = [_check_preemptions(results, engine, rows), _check_kv(results, rows),
                  _check_concurrency(results, engine, rows), _check_starvation(results, rows),
                  _check_swap(results, engine, rows)]
        out.append({"engine": engine, "mode": engine_mode(results, engine), "mode_label": mode_label(results, engine),
                    "checks": checks,
                    "worst": max((c["status"] for c in checks), key=lambda s: RANK[s])})
    return out


def expectations(results: Results) -> list[dict[str, Any]]:
    """What each scenario in the results declares, in words (shown above the diagnosis)."""
    out = []
    for sc in results.scenarios:
        p: Pressure | None = pressure_of(sc)
        out.append({"scenario": sc["name"], "declared": p.describe() if p else ["nothing declared"]})
    return out
