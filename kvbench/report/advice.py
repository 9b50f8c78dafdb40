"""A recommendation for operators, per engine, from what this run measured (docs/benchmarks.md#the-recommendation).

Three settings, each with the evidence it rests on (the scenario and the figure of the report):

* **Preemption mode by sequence length**: from the swap-vs-recompute crossover of
  :class:`~kvbench.report.figures.Facts` (computed once from the repeats' medians; read here, never
  recomputed): which mode was cheaper at each measured length, grouped into ranges, with the
  lengths where both costs sit inside the noise floor said to be a toss-up.
* **The pool**: for every scenario that drives the pool past capacity on purpose in the engine's own
  configuration (the surges, the storm: declared ``preemptions``, no forced mode, results without a
  mode), whether its preemptions per request stayed within :data:`PREEMPTION_BUDGET`, and if not, the
  pool that would have held every request in flight at the timeline's peak at the mean request's full
  length (prompt + output): no request would then have had to give up its blocks. It is an estimate
  from the run's figures, said as one; the capacity plan (``kvbench simulate``) replays the policies.
  Blocks turn into bytes with the model's KV bytes per token (:func:`kv_bytes_per_token`).
* **Admission**: from the policies scenario's trade-off curve (static vs the watermark at each
  headroom, and with prefill pacing): the setting with the fewest preemptions among those that kept
  at least :data:`~kvbench.bench.scenarios.policies.GOAL_THROUGHPUT_KEPT` of static's throughput
  (ties: the smallest headroom, which holds back the least of the pool).

And the caveat, plainly: figures from the built-in toy checkpoints on CPU (or from a simulator) do not
carry over to a real model on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench.formatting import fmt_bytes, fmt_metric, fmt_time
from kvbench.bench.results import Results
from kvbench.bench.scenarios import policies
from kvbench.bench.scenarios.declare import num, ratio_noise, result_of
from kvbench.core import delivery
from kvbench.report import figures
from kvbench.report.scoreboard import pressure_of
from kvbench.report.words import scenario_title as titled

#: preemptions per request a pool should keep under at the peak (``kvbench simulate``'s default budget)
PREEMPTION_BUDGET = 0.01
#: KV values each token keeps (2 x layers x KV heads x head size) in the built-in checkpoints, by preset:
#: kvbench/models/random_llama.py's PRESETS (tests/kvbench/test_report_advice.py holds this copy to them; the
#: report may not import the engine)
BUILTIN_KV_VALUES_PER_TOKEN = {"tiny": 2 * 2 * 2 * (64 // 4), "small": 2 * 8 * 4 * (512 // 8)}
#: the built-in checkpoints' shapes in words, for the caveat
BUILTIN_DESCRIPTION = {"tiny": "2 layers, hidden size 64", "small": "8 layers, hidden size 512"}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
#: the KV dtype of an engine whose options do not say (the reference engine's and hf-cb's default)
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class Evidence:
    """Where a figure comes from: ``text`` names the scenario and the figure, ``href`` links its section."""

    text: str
    href: str = ""


@dataclass
class Advice:
    """One recommended setting: ``setting`` in a few words, ``detail`` the figures, and the evidence."""

    setting: str
    detail: str
    evidence: list[Evidence] = field(default_factory=list)
    measured: bool = True  # False: nothing in this run speaks to it (``detail`` says why)
    #: False: the run measured it but its evidence does not earn a recommendation (no setting met the goal, no
    #: cost curve behind a size, no mode cheaper beyond the noise); ``detail`` says what was found
    earned: bool = True


@dataclass(frozen=True)
class PoolRow:
    """One scenario's pool figures for one engine."""

    scenario: str
    href: str
    pool_blocks: float
    preemptions: float
    per_request: float | None
    within_budget: bool
    peak_in_flight: float | None
    request_tokens: float | None
    needed_blocks: int | None  # None: within budget, or no estimate (``note`` says why)
    needed_bytes: float | None
    note: str = ""

    @property
    def title(self) -> str:
        """The scenario's title in words."""
        return titled(self.scenario)


@dataclass
class Recommendation:
    """Everything the report recommends for one engine."""

    engine: str
    mode: Advice
    pool: Advice
    pools: list[PoolRow]
    admission: Advice
    caveat: str = ""


# --------------------------------------------------------------------------------------------
# the model's KV size


def model_presets(results: Results) -> list[str]:
    """The checkpoints the scenarios ran on ("tiny", "small", "custom"), as recorded in their parameters."""
    return list(dict.fromkeys(str(m) for sc in results.scenarios
                              if (m := sc.get("parameters", {}).get("model")) is not None))


def kv_bytes_per_token(results: Results, engine: str) -> tuple[float | None, str]:
    """(bytes of KV one token keeps in ``engine``'s cache, how that is known), or (None, why not).

    An engine that declares ``kv_bytes_per_token`` in its description is taken at its word; a simulated
    engine simulates its own model (not the scenario's checkpoint), so without that declaration it is
    unknown; otherwise the built-in checkpoint the scenarios ran on, at the engine's ``dtype`` option
    (default float32)."""
    desc = results.engine(engine) or {}
    declared = num(desc.get("kv_bytes_per_token"))
    if declared:
        return declared, "as the engine declares"
    if desc.get("simulated"):
        return None, f"the simulated model ({desc.get('model') or 'unknown'}) does not record its KV size"
    presets = model_presets(results)
    if len(presets) != 1 or presets[0] not in BUILTIN_KV_VALUES_PER_TOKEN:
        return None, ("the results do not record the model's KV size" if not presets or presets == ["custom"]
                      else f"the scenarios ran on several models ({', '.join(presets)})")
    dtype = str((desc.get("options") or {}).get("dtype") or DEFAULT_DTYPE).lower()
    if dtype not in DTYPE_BYTES:
        return None, f"unknown KV dtype {dtype!r}"
    per_token = BUILTIN_KV_VALUES_PER_TOKEN[presets[0]] * DTYPE_BYTES[dtype]
    return float(per_token), f"the built-in {presets[0]} model, {dtype} KV: {per_token:,} B per token"


# --------------------------------------------------------------------------------------------
# the caveat


def caveat(results: Results) -> str:
    """Why the figures may not carry over, in words ("" for a real model on a GPU)."""
    presets = [p for p in model_presets(results) if p in BUILTIN_DESCRIPTION]
    device = str((results.machine or {}).get("device") or "unknown device")
    on_cpu = device.lower().startswith("cpu")
    simulated = [e["name"] for e in results.engines if e.get("simulated")]
    parts = []
    if presets or on_cpu:
        model = (f"the built-in {' and '.join(presets)} model{'s' if len(presets) > 1 else ''} (random weights, "
                 f"{'; '.join(BUILTIN_DESCRIPTION[p] for p in presets)})" if presets else "this run's model")
        parts.append(f"These figures come from {model} on {'CPU' if on_cpu else device}. Its step times, and so "
                     "the swap-vs-recompute crossover, the throughputs and the admission trade-off, do not "
                     "carry over to a real model on a GPU: read them as a description of this run, and measure "
                     "on your model and hardware (or plan with kvbench simulate) before setting production "
                     "values.")
    if simulated:
        parts.append(f"Simulated engines ({', '.join(simulated)}): their times are simulated seconds on a hardware "
                     "profile, not measurements.")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# preemption mode


def mode_advice(cx: figures.Crossover | None, href: str) -> Advice:
    """The preemption mode by sequence length from one engine's crossover (None: not measured)."""
    if cx is None:
        return Advice("not measured", "The swap-vs-recompute scenario did not run on this engine (or measured "
                      "only one mode), so this run cannot say which mode suits it.", measured=False)
    spans: list[tuple[str | None, float, float]] = []  # (cheaper mode or None: either, from, to)
    for x in cx.xs:
        cheaper = cx.cheaper_at(x)
        if spans and spans[-1][0] == cheaper:
            spans[-1] = (cheaper, spans[-1][1], x)
        else:
            spans.append((cheaper, x, x))

    def span_text(mode: str | None, lo: float, hi: float) -> str:
        where = f"{lo:,.0f} tokens" if lo == hi else f"{lo:,.0f}–{hi:,.0f} tokens"
        return f"{where}: {mode}" if mode else f"{where}: either (within the noise)"

    decided = {m for m, _, _ in spans if m}
    if not decided:
        setting = "either mode"
        return Advice(setting, f"Swap and recompute cost the same within the noise at every length measured "
                      f"({cx.xs[0]:,.0f}–{cx.xs[-1]:,.0f} tokens), so this run recommends neither.",
                      [Evidence(f"{titled(cx.scenario)}: “Preempt-and-resume cost” chart", href)], earned=False)
    elif len(decided) == 1:
        (only,) = decided
        first = next(lo for m, lo, _ in spans if m)
        setting = only if first == cx.xs[0] else f"{only} from {first:,.0f} tokens"
    else:
        setting = " then ".join(f"{m} from {lo:,.0f}" for m, lo, _ in spans if m) + " tokens"
    i_max = len(cx.xs) - 1
    costs = (f"at {cx.xs[i_max]:,.0f} tokens swap {fmt_time(cx.swap[i_max])} vs recompute "
             f"{fmt_time(cx.recompute[i_max])}")
    # one statement, read off the same medians the cost chart draws: where the curves cross inside the noise,
    # the crossing is not a landmark and is not named (the spans already say "either" there)
    where = (f" The curves cross near {cx.text} tokens." if cx.x is not None and not cx.within_noise else "")
    detail = (f"Cheaper mode by sequence length at preemption: {'; '.join(span_text(*s) for s in spans)}; "
              f"{costs} (medians of the repeats, as the cost chart draws them).{where}")
    return Advice(setting, detail, [Evidence(f"{titled(cx.scenario)}: “Preempt-and-resume cost” and “Swap ÷ "
                                             "recompute cost” charts", href)])


# --------------------------------------------------------------------------------------------
# pool


def _pool_scenarios(results: Results) -> list[tuple[int, dict[str, Any]]]:
    """(index, scenario) of the scenarios that drive the pool past capacity in the engine's own configuration."""
    out = []
    for i, sc in enumerate(results.scenarios):
        p = pressure_of(sc)
        if p is not None and p.preemptions and not p.forced_mode:
            out.append((i, sc))
    return out


def _peak_in_flight(res: Mapping[str, Any]) -> float | None:
    """The most requests in flight (running, waiting or swapped) at once on the timeline, never fewer than
    the most that ran or waited at once."""
    s, m = res.get("series") or {}, res.get("metrics") or {}
    cols = [s.get(k) or [] for k in ("num_running", "num_waiting", "num_swapped")]
    peak = max((sum(num(c[i]) or 0.0 for c in cols if i < len(c)) for i in range(max(map(len, cols)))),
               default=None)
    floors = [v for v in (num(m.get("running_max")), num(m.get("waiting_max"))) if v is not None]
    if peak is None and not floors:
        return None
    return float(math.ceil(max([peak or 0.0, *floors]) - 1e-9))  # a binned timeline averages within a bin


def pool_row(sc: Mapping[str, Any], res: Mapping[str, Any], href: str, bytes_per_token: float | None,
             budget: float = PREEMPTION_BUDGET) -> PoolRow | None:
    """One scenario's pool figures for one result (None: the pool's size was not recorded, or the engine does not
    expose its preemptions)."""
    params, m = sc.get("parameters", {}), res.get("metrics", {})
    pool = num(params.get("num_gpu_blocks")) or num((res.get("counters") or {}).get("num_gpu_blocks"))
    block = num(params.get("block_size"))
    if not pool or not block:
        return None
    if num(m.get("preemptions")) is None:  # not exposed: no row rather than one that reads "0 preemptions"
        return None
    preemptions, requests = num(m.get("preemptions")) or 0.0, num(m.get("requests"))
    per_request = preemptions / requests if requests else None
    within = per_request is not None and per_request <= budget
    peak = _peak_in_flight(res)
    tokens = (num(m.get("prompt_len_mean")) or 0.0) + (num(m.get("output_len_mean")) or 0.0) or None
    needed, note = None, ""
    if not within:
        if peak is None or tokens is None:
            note = "no estimate: the timeline or the request lengths were not recorded"
        else:
            needed = math.ceil(peak * math.ceil(tokens / block))
            if needed <= pool:
                needed, note = None, ("no estimate: the mean request understates this workload (at its length the "
                                      "peak fits the pool that preempted)")
    return PoolRow(sc["name"], href, pool, preemptions, per_request, within, peak, tokens, needed,
                   needed * block * bytes_per_token if needed is not None and bytes_per_token else None, note)


def pool_advice(rows: list[PoolRow], bytes_per_token: float | None, bytes_note: str, block_size: float | None,
                budget: float = PREEMPTION_BUDGET, plan_href: str | None = None) -> Advice:
    """The pool from the scenarios' peaks. A size is recommended only beside its cost curve (preemptions
    against pool size, the capacity plan's at ``plan_href``): one estimate from a run's peak, without the
    curve, is not evidence enough to size a pool by, so without a plan the estimate stays in the table."""
    if not rows:
        return Advice("not measured", "No scenario drove this engine's own configuration past its pool (the "
                      "surges, the storm).", measured=False)

    def size(blocks: float) -> str:
        return f"{blocks:,.0f} blocks" + (f" ({fmt_bytes(blocks * block_size * bytes_per_token)})"
                                          if bytes_per_token and block_size else "")

    over = [r for r in rows if r.needed_blocks is not None]
    evidence = [Evidence(f"{titled(r.scenario)}: “Waiting requests” and “KV usage” timelines", r.href)
                for r in rows]
    kv = (f" KV size: {bytes_note}; for another model, the same blocks hold the same tokens at its KV size."
          if bytes_per_token else f" Sizes in blocks only: {bytes_note}.")
    if over and not plan_href:
        worst = max(over, key=lambda r: r.needed_blocks or 0)
        return Advice("no size earned", f"The pool ran short: on the {titled(worst.scenario).lower()}, "
                      f"{fmt_metric('preemptions', worst.preemptions)} preemptions in a pool of "
                      f"{size(worst.pool_blocks)} ({worst.per_request:.2g} per request, budget {budget:g}). No cost "
                      "curve (preemptions against pool size) backs a size, so none is recommended; the capacity "
                      "plan draws that curve (kvbench simulate --report DIR, beside this report).", evidence,
                      earned=False)
    if over:
        worst = max(over, key=lambda r: r.needed_blocks or 0)
        evidence.append(Evidence("the capacity plan: preemptions against pool size", plan_href or ""))
        setting = f"≈ {size(worst.needed_blocks or 0)}"
        detail = (f"The largest estimate, from the {titled(worst.scenario).lower()}: "
                  f"{worst.peak_in_flight:,.0f} requests in flight at the peak, at the mean request's full length "
                  f"({worst.request_tokens:,.0f} tokens), need "
                  f"{size(worst.needed_blocks or 0)} against the {size(worst.pool_blocks)} that preempted "
                  f"{fmt_metric('preemptions', worst.preemptions)} times: a pool that size holds every request in "
                  f"flight at once, so none has to give up its blocks (budget: {budget:g} preemptions per "
                  f"request). An estimate from the run's figures; the capacity plan replays the scheduler.{kv}")
    elif all(r.within_budget for r in rows):
        largest = max(rows, key=lambda r: r.pool_blocks)
        setting = f"{size(largest.pool_blocks)} suffice"
        detail = (f"Every scenario's pool kept preemptions within the budget ({budget:g} per request) at its peak; "
                  f"the largest was {size(largest.pool_blocks)}.{kv}")
    else:
        setting = "no estimate"
        detail = "; ".join(f"{titled(r.scenario)}: {r.note}" for r in rows if r.note) + "." + kv
    return Advice(setting, detail, evidence)


# --------------------------------------------------------------------------------------------
# admission


def admission_setting(variant: str) -> str:
    """A policies-scenario mode's variant ("static", "watermark-headroom-0.2", ...) as knob settings."""
    if variant == "static":
        return "admission_policy=none"
    headroom = policies.HEADROOMS[0]
    if variant.startswith("watermark-headroom-"):
        headroom = float(variant.removeprefix("watermark-headroom-"))
    setting = f"admission_policy=watermark, admission_headroom={headroom:g}"
    if variant.endswith("+pacing"):
        setting += f", prefill_pacing_tokens={policies.PACING_TOKENS}"
    return setting


def admission_advice(results: Results, engine: str, href_of: Mapping[str, str]) -> Advice:
    """The admission setting from the policies scenario's trade-off curve for ``engine`` (the first surge
    it ran); not measured when the scenario did not run on it."""
    for sc in results.scenarios:
        for surge in policies.SURGES:
            static = result_of(sc, engine, f"{surge}/static")
            gated = [r for mode in policies.admission_modes(surge) if (r := result_of(sc, engine, mode))]
            if static is None or not gated:
                continue
            return _pick_admission(sc, surge, static, gated, href_of.get(sc["name"], ""))
    return Advice("not measured", "The policies scenario (static vs watermark admission) did not run on this "
                  "engine.", measured=False)


def _pick_admission(sc: Mapping[str, Any], surge: str, static: Mapping[str, Any], gated: list[Mapping[str, Any]],
                    href: str) -> Advice:
    evidence = [Evidence(f"{titled(sc['name'])}: “Admission control: the trade-off against static” table and "
                         "the watermark-headroom charts", href)]
    on = f"On the {titled(surge).lower()}"
    sp = num(static["metrics"].get("preemptions"))
    if sp is None:  # not exposed is not "did not preempt"
        return Advice("no setting earned", f"{on}, the engine does not expose its preemptions: nothing to judge "
                      "admission control by.", evidence)
    if not sp:
        return Advice("admission_policy=none", f"{on}, static admission did not preempt: admission control "
                      "has nothing to save here.", evidence)
    met = []
    for r in gated:
        c = policies.goal_check(static["metrics"], r["metrics"])
        if goal_met_beyond_noise(c, r, static):
            met.append((num(r["metrics"].get("preemptions")) or 0.0, r, c))
    best = min(met, key=lambda k: k[0]) if met else None  # min keeps the first (smallest headroom) of ties
    if best is None:
        return Advice("no setting earned", f"{on}, no admission-controlled setting met the goal beyond "
                      f"the noise (≥ {policies.GOAL_PREEMPTIONS_FEWER:g}× fewer preemptions, ≥ "
                      f"{policies.GOAL_TBT_LOWER:g}× lower p99 TBT, ≥ {policies.GOAL_THROUGHPUT_KEPT:.0%} of static's "
                      "throughput; see the trade-off table's “goal met” column), so this run recommends none.",
                      evidence, earned=False)
    n, r, c = best
    noise = ratio_noise(r, static, "output_throughput")
    variant = str(r.get("mode") or "").partition("/")[2]
    return Advice(admission_setting(variant),
                  f"{on}: {fmt_metric('preemptions', n)} preemptions against static's "
                  f"{fmt_metric('preemptions', sp)}, at {c.throughput_kept:.0%}"
                  f"{f' ± {noise:.0%}' if noise else ''} of its output throughput (p99 TBT "
                  f"{fmt_time(num(r['metrics'].get('tbt_p99')))} vs {fmt_time(num(static['metrics'].get('tbt_p99')))}):"
                  f" the fewest preemptions among the settings that met the goal beyond the noise (ties: the "
                  "smallest headroom).", evidence)


def goal_met_beyond_noise(c: policies.GoalCheck, gated: Mapping[str, Any], static: Mapping[str, Any]) -> bool:
    """The trade-off table's "goal met: yes": the goal holds with each time ratio moved against it by its
    noise (the policies scenario's rule; "within noise" and "no" earn no recommendation)."""
    if not c.met or c.lower_tbt is None or c.throughput_kept is None:
        return False
    if delivery.not_comparable_among("tbt_p99", [gated, static]):  # a bursty server's gaps earn nothing
        return False
    tbt_noise = ratio_noise(gated, static, "tbt_p99") or 0.0
    tput_noise = ratio_noise(gated, static, "output_throughput") or 0.0
    return (c.lower_tbt / (1 + tbt_noise) >= policies.GOAL_TBT_LOWER
            and c.throughput_kept * (1 - tput_noise) >= policies.GOAL_THROUGHPUT_KEPT)


# --------------------------------------------------------------------------------------------
# entry point


def same_engine_but_mode(results: Results, a: str, b: str) -> bool:
    """True when engines ``a`` and ``b`` are one kind with the same options apart from ``preemption_mode``."""
    da, db = results.engine(a) or {}, results.engine(b) or {}

    def rest(d: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in (d.get("options") or {}).items() if k != "preemption_mode"}

    return a != b and bool(da) and da.get("kind") == db.get("kind") and rest(da) == rest(db)


def recommendations(results: Results, run_facts: figures.Facts | None = None,
                    budget: float = PREEMPTION_BUDGET, plan_href: str | None = None) -> list[Recommendation]:
    """One :class:`Recommendation` per engine of ``results`` (section links ``#scenario-N`` as rendered);
    ``plan_href``: the capacity plan beside the report, whose cost curve a pool size needs."""
    run_facts = run_facts or figures.Facts.of(results)
    href_of = {sc["name"]: f"#scenario-{i + 1}" for i, sc in enumerate(results.scenarios)}
    pool_scenarios = _pool_scenarios(results)
    out = []
    for engine in results.engine_names():
        cx = run_facts.crossovers.get(engine)
        shared = ""
        if cx is None:  # the crossover scenario forces each mode: an engine that differs only in its mode shares it
            shared = next((e for e in run_facts.crossovers if same_engine_but_mode(results, e, engine)), "")
            cx = run_facts.crossovers.get(shared) if shared else None
        per_token, bytes_note = kv_bytes_per_token(results, engine)
        rows, block = [], None
        for _, sc in pool_scenarios:
            res = result_of(sc, engine)
            if res is None:
                continue
            row = pool_row(sc, res, href_of[sc["name"]], per_token, budget)
            if row is not None:
                rows.append(row)
                block = block or num(sc.get("parameters", {}).get("block_size"))
        simulated = bool((results.engine(engine) or {}).get("simulated"))
        mode = mode_advice(cx, href_of.get(cx.scenario, "") if cx else "")
        if shared:  # said once, where it was measured; here a pointer to it
            mode = Advice(mode.setting, f"As for {shared}: the same engine with another preemption mode, and the "
                          "swap-vs-recompute scenario sets the mode itself, so its measurement holds here.",
                          mode.evidence, mode.measured, mode.earned)
        out.append(Recommendation(engine, mode,
                                  pool_advice(rows, per_token, bytes_note, block, budget, plan_href), rows,
                                  admission_advice(results, engine, href_of),
                                  "simulated: times are simulated seconds" if simulated else ""))
    return out
