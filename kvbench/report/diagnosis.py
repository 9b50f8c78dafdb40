"""The report's diagnosis: the seeds' order of checks, applied to a results file.

Order (seed 004, section 5, and seed 001's reading of storms):

1. Is the preemption count growing? (and does it span the whole run: a structural capacity gap)
2. Is KV usage pinned near 100%?
3. Concurrency and input lengths: does ``max_num_seqs`` exceed what the pool can hold?
4. Starvation: how long do preempted requests wait?
5. Swap bandwidth: is swap slow against recompute, or running out of host space?

Each check returns a status (``ok``, ``watch``, ``problem``, ``not measured``), what it found,
with numbers, and the knob to try. The thresholds below are rules of thumb, stated where used.
"""

from __future__ import annotations

import math
from typing import Any

from kvbench.bench import metrics
from kvbench.bench.results import COST_METRICS, Results
from kvbench.report.formatting import fmt_metric, fmt_ratio, fmt_time

OK, WATCH, PROBLEM, NOT_MEASURED = "ok", "watch", "problem", "not measured"


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


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
# swap vs recompute curves (shared with the report's charts and headline)


def cost_curves(sweep: dict[str, Any], engine: str) -> tuple[str | None, dict[str, list[tuple[float, float]]]]:
    """(cost metric, {mode: sorted (x, cost)}) of one engine's swap/recompute points in a sweep."""
    pts = [p for p in sweep["points"] if p["engine"] == engine and p.get("mode") in ("swap", "recompute")]
    metric = next((m for m in COST_METRICS if any(_num(p["metrics"].get(m)) is not None for p in pts)), None)
    curves: dict[str, list[tuple[float, float]]] = {}
    if metric:
        for p in pts:
            v = _num(p["metrics"].get(metric))
            if v is not None:
                curves.setdefault(p["mode"], []).append((float(p["x"]), v))
    return metric, {m: sorted(c) for m, c in curves.items()}


def swap_crossover(results: Results, engine: str) -> dict[str, Any] | None:
    """Where swap and recompute cost the same for ``engine``.

    Returns ``{x, metric, x_label, xs, swap, recompute}`` (``x`` None when the curves never cross
    within the sweep) from the first sweep holding both modes for the engine, else None.
    """
    for sc in results.scenarios:
        for sw in sc["sweeps"]:
            metric, curves = cost_curves(sw, engine)
            if not metric or "swap" not in curves or "recompute" not in curves:
                continue
            s, r = dict(curves["swap"]), dict(curves["recompute"])
            common = sorted(set(s) & set(r))
            if not common:
                continue
            return {"x": metrics.crossover(common, [s[c] for c in common], [r[c] for c in common]),
                    "metric": metric, "x_label": sw["x_label"], "xs": common,
                    "swap": [s[c] for c in common], "recompute": [r[c] for c in common]}
    return None


def concurrency_knee(results: Results, engine: str) -> tuple[float | None, str]:
    """Knee of the first sweep of ``engine`` with throughput points (not a swap/recompute sweep)."""
    for sc in results.scenarios:
        for sw in sc["sweeps"]:
            pts = [p for p in sw["points"] if p["engine"] == engine and p.get("mode") not in ("swap",)]
            if {p.get("mode") for p in sw["points"]} >= {"swap", "recompute"}:
                continue
            pts = [p for p in pts if _num(p["metrics"].get("output_throughput")) is not None]
            if len(pts) >= 2:
                k = metrics.knee([p["x"] for p in pts], [p["metrics"]["output_throughput"] for p in pts])
                return k, f"{sw['x_label']} ({sc['name']})"
    return None, ""


# --------------------------------------------------------------------------------------------
# the checks


def _check(n: int, title: str, status: str, finding: str, knob: str) -> dict[str, Any]:
    return {"n": n, "title": title, "status": status, "finding": finding, "knob": knob}


def _worst(rows: list[tuple[dict, dict]], key: str) -> tuple[float | None, dict | None, dict | None]:
    best: tuple[float | None, dict | None, dict | None] = (None, None, None)
    for sc, res in rows:
        v = _num(res["metrics"].get(key))
        if v is not None and (best[0] is None or v > best[0]):
            best = (v, sc, res)
    return best


def _where(sc: dict | None, res: dict | None) -> str:
    if sc is None or res is None:
        return ""
    return sc["name"] + (f" [{res['mode']}]" if res.get("mode") else "")


def _check_preemptions(results: Results, engine: str, rows: list) -> dict[str, Any]:
    title = "Is the preemption count growing?"
    knob_base = ("Lower max_num_seqs toward the knee; give the KV pool more blocks (gpu_memory_utilization, "
                 "num_gpu_blocks).")
    rate, sc, res = _worst(rows, "preemptions_per_s")
    if rate is None:
        total, sc, res = _worst(rows, "preemptions")
        if total is None:
            return _check(1, title, NOT_MEASURED, "The engine does not expose preemptions.", knob_base)
    m = res["metrics"]  # type: ignore[index]
    total = _num(m.get("preemptions")) or 0.0
    if total == 0:
        return _check(1, title, OK, "No preemptions in any scenario: the pool never ran dry.",
                      "Nothing to do; raise max_num_seqs if you want more throughput and watch this count.")
    active = _num(m.get("preemption_active_share"))
    share = _num(m.get("preempted_request_share"))
    finding = (f"{total:,.0f} preemptions in {_where(sc, res)} ({fmt_metric('preemptions_per_s', rate)}; "
               f"recompute {fmt_metric('preemptions', m.get('preemptions_recompute'))}, "
               f"swap {fmt_metric('preemptions', m.get('preemptions_swap'))}).")
    if share is not None:
        finding += (f" {share * 100:.0f}% of requests were preempted, one of them "
                    f"{fmt_metric('preemptions', m.get('max_preemptions_per_request'))} times.")
    growth = _sweep_growth(results, engine)
    if growth:
        finding += " " + growth
    # Seed 001: preemptions only at the peak are the safety net working; throughout the run, a
    # capacity gap that tuning cannot close.
    if active is not None:
        finding += f" Preemptions occur in {active * 100:.0f}% of the run."
    structural = active is not None and active >= 0.5
    status = PROBLEM if structural or (share is not None and share > 0.25) else WATCH
    knob = knob_base
    if structural:
        knob += " Preempting through most of the run is a structural capacity gap: add capacity or rate-limit."
    return _check(1, title, status, finding, knob)


def _sweep_growth(results: Results, engine: str) -> str:
    for sc in results.scenarios:
        for sw in sc["sweeps"]:
            pts = sorted((p for p in sw["points"] if p["engine"] == engine
                          and _num(p["metrics"].get("preemptions")) is not None), key=lambda p: p["x"])
            if len(pts) >= 2 and {p.get("mode") for p in sw["points"]} != {"swap", "recompute"}:
                first, last = pts[0], pts[-1]
                trend = "grows" if last["metrics"]["preemptions"] > first["metrics"]["preemptions"] else "does not grow"
                return (f"Across the {sw['x_label']} sweep it {trend}: {first['metrics']['preemptions']:,.0f} at "
                        f"{first['x']:g} -> {last['metrics']['preemptions']:,.0f} at {last['x']:g}.")
    return ""


def _check_kv(rows: list) -> dict[str, Any]:
    title = "Is KV usage pinned near 100%?"
    knob = ("More KV blocks (gpu_memory_utilization, num_gpu_blocks); fewer concurrent sequences "
            "(max_num_seqs); cap max_model_len if long-context bursts fill the pool.")
    pinned, sc, res = _worst(rows, "kv_usage_time_over_95")
    if pinned is None:
        return _check(2, title, NOT_MEASURED, "The engine does not expose KV usage.", knob)
    m = res["metrics"]  # type: ignore[index]
    finding = (f"In {_where(sc, res)} the device pool was above 95% for {pinned * 100:.0f}% of the time "
               f"(mean {fmt_metric('kv_usage_mean', m.get('kv_usage_mean'))}, "
               f"peak {fmt_metric('kv_usage_max', m.get('kv_usage_max'))}).")
    # Rules of thumb: pinned for half the run means the pool is the bottleneck, a tenth is worth watching.
    status = PROBLEM if pinned > 0.5 else WATCH if pinned > 0.1 else OK
    return _check(2, title, status, finding, knob)


def _capacity_tokens(params: dict[str, Any]) -> float | None:
    blocks, size = _num(params.get("num_gpu_blocks")), _num(params.get("block_size"))
    if blocks and size:
        return blocks * size
    return _num(params.get("capacity_tokens"))


def _check_concurrency(results: Results, engine: str, rows: list) -> dict[str, Any]:
    title = "Concurrency and input lengths (max_num_seqs vs capacity)"
    knee, knee_where = concurrency_knee(results, engine)
    eng_opts = (results.engine(engine) or {}).get("options", {})
    facts, status, fits_min = [], OK, None
    for sc, res in rows:
        m, params = res["metrics"], sc.get("parameters", {})
        cap = _capacity_tokens(params)
        per_req = (_num(m.get("prompt_len_mean")) or 0) + (_num(m.get("output_len_mean")) or 0)
        seqs = _num(params.get("max_num_seqs")) or _num(eng_opts.get("max_num_seqs"))
        if not cap or not per_req:
            continue
        fits = cap / per_req
        fits_min = fits if fits_min is None else min(fits, fits_min)
        fact = (f"{_where(sc, res)}: the pool holds ~{cap:,.0f} tokens ≈ {fits:.1f} requests of {per_req:,.0f} "
                f"tokens (prompt mean {m.get('prompt_len_mean') or 0:,.0f}, max {m.get('prompt_len_max') or 0:,.0f})")
        if seqs:
            fact += f"; max_num_seqs = {seqs:g}"
            if seqs > fits and (_num(m.get("preemptions")) or 0) > 0:
                status = PROBLEM
                fact += " (over capacity)"
        fact += (f"; up to {fmt_metric('running_max', m.get('running_max'))} ran at once, "
                 f"{fmt_metric('waiting_max', m.get('waiting_max'))} waited.")
        facts.append(fact)
    if knee is not None:
        facts.append(f"Throughput stops rising at {knee:g} on the {knee_where} sweep (gain < 5% beyond).")
    if not facts:
        return _check(3, title, NOT_MEASURED, "Scenario parameters lack the pool size (num_gpu_blocks, block_size) "
                      "and no concurrency sweep was run.", "Run the preemption storm sweep.")
    targets = [v for v in (knee, math.floor(fits_min) if fits_min else None) if v]
    target = f" ≤ {min(targets):g}" if targets else ""
    knob = (f"Set max_num_seqs{target}; for long prompts enable chunked prefill and size max_num_batched_tokens "
            "(512–2048) so one prefill cannot take a whole step.")
    return _check(3, title, status, " ".join(facts[:3]), knob)


def _check_starvation(rows: list) -> dict[str, Any]:
    title = "Starvation: how long do preempted requests wait?"
    knob = ("Priority scheduling for latency-sensitive traffic; lower max_num_seqs so victims resume sooner; "
            "preemption_mode=swap keeps their progress (no re-prefill).")
    wait, sc, res = _worst(rows, "starvation_max_s")
    if wait is None:
        return _check(4, title, NOT_MEASURED, "The engine does not record preemption and resume times.", knob)
    if wait == 0:
        return _check(4, title, OK, "No preempted request waited.", knob)
    m = res["metrics"]  # type: ignore[index]
    e2e = _num(m.get("e2e_p50"))
    repeat = _num(m.get("max_preemptions_per_request")) or 0
    finding = (f"In {_where(sc, res)} a preempted request waited up to {fmt_time(wait)} "
               f"(mean {fmt_time(m.get('starvation_mean_s'))}) before resuming")
    finding += f", against a median end-to-end time of {fmt_time(e2e)}." if e2e else "."
    if repeat:
        finding += f" One request was preempted {repeat:,.0f} times."
    # A wait longer than a typical whole request, or a request bounced three times, is starvation.
    status = PROBLEM if (e2e and wait > e2e) or repeat >= 3 else WATCH
    return _check(4, title, status, finding, knob)


def _check_swap(results: Results, engine: str, rows: list) -> dict[str, Any]:
    title = "Swap bandwidth: is swap slow against recompute?"
    knob = ("swap_space (host GiB) if swap falls back to recompute; preemption_mode=swap for sequences longer "
            "than the crossover, recompute below it; prefix caching shrinks what recompute redoes.")
    facts, status = [], OK
    bw, sc, res = _worst(rows, "swap_bandwidth")
    if bw is not None:
        m = res["metrics"]  # type: ignore[index]
        moved = (_num(m.get("swapped_out_bytes")) or 0) + (_num(m.get("swapped_in_bytes")) or 0)
        facts.append(f"{_where(sc, res)}: swap moved {fmt_metric('swapped_out_bytes', moved)} at "
                     f"{fmt_metric('swap_bandwidth', bw)} ({fmt_time(m.get('swap_seconds'))} spent copying).")
    fallbacks, fsc, fres = _worst(rows, "swap_fallbacks")
    if fallbacks:
        status = PROBLEM
        facts.append(f"{_where(fsc, fres)}: host swap space ran out {fallbacks:,.0f} times (fell back to recompute).")
    cx = swap_crossover(results, engine)
    if cx:
        ratio = cx["swap"][-1] / cx["recompute"][-1] if cx["recompute"][-1] else None
        if cx["x"] is None:
            cheaper = "swap" if cx["swap"][0] < cx["recompute"][0] else "recompute"
            facts.append(f"{cheaper.capitalize()} is cheaper at every {cx['x_label']} measured "
                         f"(swap costs {fmt_ratio(ratio)} of recompute at {cx['xs'][-1]:g}).")
        else:
            above = "swap" if cx["swap"][-1] < cx["recompute"][-1] else "recompute"
            facts.append(f"Swap and recompute cost the same at {cx['x_label']} ≈ {cx['x']:,.0f}; {above} is cheaper "
                         f"above it (swap costs {fmt_ratio(ratio)} of recompute at {cx['xs'][-1]:g}).")
            lens = [_num(r["metrics"].get("prompt_len_mean")) for _, r in rows]
            lens = [v for v in lens if v]
            if lens and status == OK:
                typical = sorted(lens)[len(lens) // 2]
                side = "above" if typical > cx["x"] else "below"
                better = above if side == "above" else ("recompute" if above == "swap" else "swap")
                facts.append(f"Your prompts average {typical:,.0f} tokens, {side} the crossover: {better} suits them.")
    if not facts:
        return _check(5, title, NOT_MEASURED, "No swap activity or swap-vs-recompute sweep for this engine.", knob)
    return _check(5, title, status, " ".join(facts), knob)


def diagnose(results: Results) -> list[dict[str, Any]]:
    """One entry per engine (the reference first): ``{engine, checks: [5 checks], worst}``."""
    ref = baseline_engine_name(results)
    names = results.engine_names()
    ordered = ([ref] if ref in names else []) + [n for n in names if n != ref]
    out = []
    for engine in ordered:
        rows = [(sc, res) for sc, res in results.iter_results() if res["engine"] == engine]
        if not rows and not any(p["engine"] == engine for sc in results.scenarios for sw in sc["sweeps"]
                                for p in sw["points"]):
            continue
        checks = [_check_preemptions(results, engine, rows), _check_kv(rows),
                  _check_concurrency(results, engine, rows), _check_starvation(rows),
                  _check_swap(results, engine, rows)]
        rank = {PROBLEM: 3, WATCH: 2, OK: 1, NOT_MEASURED: 0}
        out.append({"engine": engine, "checks": checks,
                    "worst": max((c["status"] for c in checks), key=lambda s: rank[s])})
    return out
