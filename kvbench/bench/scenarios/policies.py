"""Preemption-aware policies side by side (docs/simulator.md#preemption-aware-policies): static
configuration, ``preemption_mode="auto"`` and admission control, on one engine in one run.

Two parts, each served in every mode so the modes' ratios never mix moments:

* **mixed victims** (modes ``recompute``, ``swap``, ``auto``): many short requests sharing a system
  prompt (prefix caching on: a recompute of one costs only its own tail, while a swap copies every
  block, shared ones too) plus a few long unique ones (a recompute re-prefills hundreds of tokens),
  under a device pool too small for the mix and a host pool that holds the long ones but not
  everything. Fixed swap fills the host pool with short victims and then has to recompute long
  ones (fallbacks); fixed recompute re-prefills the long ones; auto recomputes the short and swaps
  the long.
* **admission** (on the evening surge's and (full scale) the flash crowd's workloads and pools): vLLM's
  rule (``static``) admits whatever fits now; the watermark admits only if the projected KV use over the
  next steps stays under ``1 - headroom`` of the pool. The trade-off curve: the watermark at headrooms
  0.05 (the engine default, mode ``watermark``), 0.2 and 0.4 (a sweep over the headroom: preemptions,
  throughput and p99 TBT each drawn against it), and the watermark with prefill pacing
  (``watermark+pacing``: at most one prompt per step beside running decodes, the lever that acts on
  the tail gap). The admission goal (at least 5x fewer preemptions and 2x lower p99 TBT than static
  at >= 95% of its throughput; docs/benchmarks.md#scenarios) is judged for every point in a table and a
  note, not claimed: on the tiny model the p99 TBT is set by the prefill steps of new prompts, which no
  admission rule removes (docs/simulator.md#preemption-aware-policies).

Claims are counts (deterministic on the step clock), never times: auto preempted (which modes it
chose depends on the prices measured on the machine, so that is a note) and fell back no more often
than the swap mode (recomputed tokens are in the table, not claimed: the three modes'
schedules diverge after the first preemption, so auto may recompute more than the recompute mode
did); admission
control preempted fewer times than the static configuration on each surge; everything finished.
Times (output throughput, p99 TBT, duration) are in the table as same-run figures. Two claims are
times, decided only on the simulator's cost clock (deterministic, every preemption's cost in its
times; undecided elsewhere): auto's output throughput on the mixed workload is no worse than the
better fixed mode's within 2%, and beat both by more than 2% when its victims mixed (auto chose
each mode at least once). At this scenario's sizes auto priced every victim one way; the mix at
Llama-3-8B/H200 scale is ``kvbench simulate --workload mixed_victims`` (docs/simulator.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.bench.formatting import fmt_metric, fmt_time
from kvbench.bench.scenarios.claims import (
    NOT_EXPOSED,
    NOT_REACHED,
    count_claim,
    decide,
    not_exposed,
    not_shown,
    pressure,
    resting_on,
    shown,
)
from kvbench.bench.scenarios.common import (
    BLOCK_SIZE,
    Job,
    Model,
    Outcome,
    ResultEntry,
    Scenario,
    Served,
    SweepPoint,
    all_finished,
    build_workload,
    describe_spec,
)
from kvbench.bench.scenarios.declare import (
    COST_CLOCK_CLAIM,
    MIN_RATIO_NOISE,
    Headline,
    Pressure,
    num,
    ratio_noise,
    result_of,
)
from kvbench.bench.scenarios.surges import EveningSurge, FlashCrowd
from kvbench.bench.workloads import Poisson, SharedPrefix, Uniform, WorkloadSpec, combine
from kvbench.engines.base import Knobs

MIXED_MODES = ("recompute", "swap", "auto")
ADMISSION_MODES = ("static", "watermark")
SURGES = ("evening_surge", "flash_crowd")
#: the watermark's headroom at each point of the trade-off curve; the first is the engine default,
#: served as mode ``watermark`` (so saved baselines keep matching)
HEADROOMS = (0.05, 0.2, 0.4)
#: prefill pacing of the ``watermark+pacing`` mode: one token, i.e. without chunked prefill at most
#: one prompt per step beside running decodes (a prompt is never split, so it runs alone as that
#: step's prefill), whatever the workload's prompt lengths
PACING_TOKENS = 1
#: the admission goal against the static configuration (docs/benchmarks.md#scenarios)
GOAL_PREEMPTIONS_FEWER = 5.0
GOAL_TBT_LOWER = 2.0
GOAL_THROUGHPUT_KEPT = 0.95


@dataclass(frozen=True)
class PoliciesSize:
    short: WorkloadSpec  # shares one system prompt
    long: WorkloadSpec
    num_gpu_blocks: int
    num_cpu_blocks: int
    surges: tuple[str, ...] = SURGES  # the admission part's workloads (quick: one, to stay quick)


class PreemptionPolicies(Scenario):
    name = "preemption_policies"
    doc = "docs/simulator.md#preemption-aware-policies"
    title = "Preemption policies"
    description = ("Static configuration vs preemption_mode=auto vs admission control, side by side on one engine. "
                   "Mixed victims (short requests sharing a system prompt, prefix caching on, plus a few long ones; "
                   "a host pool that holds the long ones but not everything): recompute, swap and auto. Admission: "
                   "the evening surge and the flash crowd, static vs the watermark at headroom 0.05, 0.2 and 0.4 "
                   "(the trade-off curve: share of the pool kept free of projected use) and the watermark with "
                   "prefill pacing; the admission goal judged for each in a table. Claims: auto preempted and fell "
                   "back no more than swap (its modes in a note); admission control preempted fewer times on each "
                   "surge, and no admission-controlled run more than static; every request finished.")
    needs = ("swap", "prefix_caching", "auto_preemption", "admission_control")
    knobs_needed = ("admission_policy", "admission_headroom", "prefill_pacing_tokens")
    engine_mode_matters = False  # every job sets the mode itself
    sizes = {  # noqa: RUF012
        "quick": PoliciesSize(
            short=WorkloadSpec("short", 12, Uniform(4, 24), Uniform(32, 64), Poisson(24.0),
                               shared_prefix=SharedPrefix(1, 64), seed=11),
            long=WorkloadSpec("long", 4, Uniform(300, 500), Uniform(32, 64), Poisson(4.0), seed=12),
            num_gpu_blocks=40, num_cpu_blocks=40, surges=("evening_surge",)),
        "full": PoliciesSize(
            short=WorkloadSpec("short", 24, Uniform(8, 48), Uniform(32, 96), Poisson(8.0),
                               shared_prefix=SharedPrefix(2, 128), seed=11),
            long=WorkloadSpec("long", 4, Uniform(768, 1024), Uniform(48, 96), Poisson(1.0), seed=12),
            num_gpu_blocks=128, num_cpu_blocks=96),
    }
    pressure = Pressure(preemptions=True, kv_pinned=True)
    score = None  # one engine's modes, not engines, are compared

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        mixed = combine("mixed", build_workload(s.short, model), build_workload(s.long, model))
        jobs = [Job(mixed, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks,
                                 num_cpu_blocks=s.num_cpu_blocks, enable_prefix_caching=True, preemption_mode=mode,
                                 admission_policy="none"), mode=f"mixed/{mode}")
                for mode in MIXED_MODES]
        for surge in (EveningSurge(), FlashCrowd()):
            if surge.name not in s.surges:
                continue
            (job,) = surge.plan(scale, model)
            base = Knobs(block_size=job.knobs.block_size, num_gpu_blocks=job.knobs.num_gpu_blocks,
                         preemption_mode="recompute", admission_policy="none")
            gated = base.merged(Knobs(admission_policy="watermark"))
            jobs.append(Job(job.workload, base, mode=f"{surge.name}/static"))
            for h in HEADROOMS:
                jobs.append(Job(job.workload, gated.merged(Knobs(admission_headroom=h)),
                                mode=admission_mode(surge.name, h), x=h))
            jobs.append(Job(job.workload, gated.merged(Knobs(prefill_pacing_tokens=PACING_TOKENS)),
                            mode=f"{surge.name}/watermark+pacing"))
        return jobs

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "short": describe_spec(s.short), "long": describe_spec(s.long),
                "num_cpu_blocks": s.num_cpu_blocks,
                "admission": f"none vs watermark at headroom {', '.join(f'{h:g}' for h in HEADROOMS)} (horizon: "
                             f"engine default), and watermark + prefill pacing ({PACING_TOKENS} token: one "
                             "prompt per step beside decodes)",
                "surges": ", ".join(s.surges) + " (their workloads and pools at this scale)"}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        by_mode = {run_.job.mode: run_ for run_ in served}
        for run_ in served:
            out.entries.append(ResultEntry(run_.trace, mode=run_.job.mode))
        m = {mode: run_.metrics for mode, run_ in by_mode.items()}

        def count(mode: str, key: str) -> float | None:
            return num(m[mode].get(key))

        swap_a, rec_a = count("mixed/auto", "preemptions_swap"), count("mixed/auto", "preemptions_recompute")
        fb_auto, fb_swap = count("mixed/auto", "swap_fallbacks"), count("mixed/swap", "swap_fallbacks")
        decide(out, {
            # Which modes auto picks depends on the prices it measured on this machine: a note, not a claim
            # (tests/engine/test_policies.py proves both fire, at fixed prices). Preempting at all is the
            # mixed workload's pressure.
            "auto preempted on the mixed workload (its choice made per victim)": pressure(count_claim(
                None if swap_a is None or rec_a is None else swap_a + rec_a, "preemption")),
            "auto fell back to recompute no more often than the swap mode": (
                not_exposed("this engine publishes no swap-fallback counter") if fb_auto is None or fb_swap is None
                else shown(f"{fb_auto:,.0f} vs {fb_swap:,.0f}") if fb_auto <= fb_swap
                else not_shown(f"{fb_auto:,.0f} fallbacks in auto vs {fb_swap:,.0f} in swap mode")),
            "the fixed modes preempted on the mixed workload (the comparison has victims)": pressure(count_claim(
                count("mixed/recompute", "preemptions"), "preemption")),
        })
        cost_clock = all(_on_cost_clock(by_mode[f"mixed/{mode}"].trace) for mode in MIXED_MODES)
        mixed = bool(swap_a) and bool(rec_a)
        out.claims.update(auto_vs_fixed_claims(
            *(count(f"mixed/{mode}", "output_throughput") if cost_clock else None for mode in MIXED_MODES), mixed))
        auto_claims = [c for c in out.claims if c.startswith("auto's output throughput")]
        if not cost_clock:
            out.notes.append("auto vs the fixed modes' throughput: decided on the simulator's cost clock only "
                             "(deterministic, and preemption costs are in its times); here see the table")
            out.undecided_reasons.update(dict.fromkeys(auto_claims, (
                "decided on the simulator's cost clock only: one wall-clock run's times spread more than the 2% "
                "margin on a shared machine")))
            out.undecided_kinds.update(dict.fromkeys(auto_claims, NOT_EXPOSED))
        elif not mixed:
            out.notes.append("auto priced every victim of the mixed workload one way: 'beat both' undecided "
                             "(kvbench simulate --workload mixed_victims shows the mix at Llama-3-8B/H200 scale)")
            out.undecided_reasons.update(dict.fromkeys(auto_claims, (
                "auto priced every victim of the mixed workload one way: nothing for it to beat both modes with")))
            out.undecided_kinds.update(dict.fromkeys(auto_claims, NOT_REACHED))
        for surge in self.size(scale).surges:
            static, gated = count(f"{surge}/static", "preemptions"), count(f"{surge}/watermark", "preemptions")
            curve = [count(mode, "preemptions") for mode in admission_modes(surge)]
            # static preempting is the surge's pressure: with none, admission control had nothing to spare
            pressured = pressure(count_claim(static, "preemption"))
            decide(out, {
                f"admission control preempted fewer times than static on {surge}": resting_on(
                    not_exposed("this engine publishes no preemption counter") if static is None or gated is None
                    else shown(f"{static:,.0f} -> {gated:,.0f}") if gated < static
                    else not_shown(f"{static:,.0f} static vs {gated:,.0f} with the watermark"), pressured),
                f"every admission-controlled run preempted no more often than static on {surge}": (
                    not_exposed("this engine publishes no preemption counter") if static is None or None in curve
                    else shown(f"at most {max(curve):,.0f} vs {static:,.0f} static") if all(c <= static for c in curve)
                    else not_shown(f"up to {max(curve):,.0f} vs {static:,.0f} static")),
            })
            for h in HEADROOMS:
                run_ = by_mode[admission_mode(surge, h)]
                out.points.append(SweepPoint("admission_headroom", "watermark headroom", h, run_.metrics,
                                             mode=surge))
        if swap_a is not None and rec_a is not None:
            out.notes.append(f"auto chose swap {swap_a:,.0f} and recompute {rec_a:,.0f} times on the mixed workload")
        out.claims["every request finished in every mode"] = all(all_finished(r.trace) for r in served)
        return out

    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        engines = list(dict.fromkeys(r["engine"] for r in recorded.get("results", [])))
        engine = reference if reference in engines else (engines[0] if engines else None)
        if engine is None:
            return Headline(self.title, None, "needs a run of this scenario")
        parts = []
        for surge in SURGES:
            s = _metric(recorded, engine, f"{surge}/static", "preemptions")
            w = _metric(recorded, engine, f"{surge}/watermark", "preemptions")
            if s is not None and w is not None:
                parts.append((surge, s, w))
        if not parts:
            return Headline(self.title, None, "needs preemption counts of the static and watermark runs")
        value = ", ".join(f"{s:,.0f} → {w:,.0f}" for _, s, w in parts)
        best = [_metric(recorded, engine, f"mixed/{m}", "duration_s") for m in ("recompute", "swap")]
        auto = _metric(recorded, engine, "mixed/auto", "duration_s")
        detail = ""
        if auto is not None and all(b is not None for b in best):
            detail = f"mixed victims: auto ÷ better fixed mode duration {auto / min(best):.2f} (same run)"
        return Headline(self.title, value, "preemptions static → watermark admission (" + ", ".join(
            p[0] for p in parts) + f"; {engine})", detail)

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        rows = []
        for r in recorded.get("results", []):
            m = r["metrics"]
            rows.append([r["engine"], r.get("mode") or "-",
                         f"{fmt_metric('preemptions', m.get('preemptions_recompute'))} / "
                         f"{fmt_metric('preemptions', m.get('preemptions_swap'))}",
                         fmt_metric("swap_fallbacks", m.get("swap_fallbacks")),
                         fmt_metric("recomputed_tokens", m.get("recomputed_tokens")),
                         fmt_metric("output_throughput", m.get("output_throughput")),
                         fmt_time(num(m.get("tbt_p99"))), fmt_time(num(m.get("duration_s")))])
        tables = [{"title": "Policies side by side", "rows": rows,
                 "columns": ["engine", "workload/mode", "preemptions recompute / swap", "swap fallbacks",
                             "recomputed tokens", "output throughput", "p99 TBT", "duration"],
                 "note": "modes of one engine served in the same run; counts exact on the step clock"}]
        trade = tradeoff_rows(recorded)
        if trade:
            tables.append({"title": "Admission control: the trade-off against static", "rows": trade,
                           "columns": ["engine", "surge / mode", "preemptions (fewer by)",
                                       "output throughput (share kept)", "p99 TBT (lower by)", "p99 TTFT",
                                       "goal met"],
                           "note": f"the admission goal: >= {GOAL_PREEMPTIONS_FEWER:g}x fewer preemptions and >= "
                                   f"{GOAL_TBT_LOWER:g}x lower p99 TBT than static at >= "
                                   f"{GOAL_THROUGHPUT_KEPT:.0%} of its throughput; medians of the repeats, "
                                   "ratios of one run's modes, ± their noise (twice both repeats' relative "
                                   "spreads); 'yes' only beyond the noise"})
        return tables


def admission_mode(surge: str, headroom: float) -> str:
    """The mode name of the watermark at ``headroom`` on ``surge`` (the default headroom: ``watermark``)."""
    return f"{surge}/watermark" if headroom == HEADROOMS[0] else f"{surge}/watermark-headroom-{headroom:g}"


def admission_modes(surge: str) -> list[str]:
    """Every admission-controlled mode of ``surge``, in the order served."""
    return [*(admission_mode(surge, h) for h in HEADROOMS), f"{surge}/watermark+pacing"]


@dataclass(frozen=True)
class GoalCheck:
    """One admission-controlled run against static: how many times fewer preemptions, how many times
    lower p99 TBT, what share of the throughput kept (None: a figure is missing)."""

    fewer_preemptions: float | None
    lower_tbt: float | None
    throughput_kept: float | None

    @property
    def met(self) -> bool | None:
        if None in (self.fewer_preemptions, self.lower_tbt, self.throughput_kept):
            return None
        return (self.fewer_preemptions >= GOAL_PREEMPTIONS_FEWER and self.lower_tbt >= GOAL_TBT_LOWER
                and self.throughput_kept >= GOAL_THROUGHPUT_KEPT)


def goal_check(static: Mapping[str, Any], gated: Mapping[str, Any]) -> GoalCheck:
    """The admission goal for ``gated``'s metrics against ``static``'s. Preemptions "fewer by":
    static / gated, infinite when gated has none and static had some, 1 when neither preempted."""
    sp, gp = num(static.get("preemptions")), num(gated.get("preemptions"))
    fewer = None if sp is None or gp is None else (sp / gp if gp else (math.inf if sp else 1.0))
    st, gt = num(static.get("tbt_p99")), num(gated.get("tbt_p99"))
    so, go = num(static.get("output_throughput")), num(gated.get("output_throughput"))
    return GoalCheck(fewer, st / gt if st is not None and gt else None, go / so if go is not None and so else None)


def tradeoff_rows(recorded: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the trade-off table: every admission-controlled result against the same engine's static
    one, from the medians of the repeats. The goal reads "yes" only when it holds with each time ratio
    moved against it by its noise (:func:`~kvbench.bench.scenarios.declare.ratio_noise`, as the headlines
    use: about two standard deviations), "within noise" when the medians meet it but the noise could undo
    that, "no" when the medians miss it."""
    rows = []
    for r in recorded.get("results", []):
        mode = r.get("mode") or ""
        surge, _, variant = mode.partition("/")
        if surge not in SURGES or variant == "static":
            continue
        static = result_of(recorded, r["engine"], f"{surge}/static")
        if static is None:
            continue
        c, m, sm = goal_check(static["metrics"], r["metrics"]), r["metrics"], static["metrics"]
        tbt_noise = ratio_noise(r, static, "tbt_p99") or 0.0
        tput_noise = ratio_noise(r, static, "output_throughput") or 0.0
        rows.append([r["engine"], mode,
                     f"{fmt_metric('preemptions', m.get('preemptions'))} "
                     f"(vs {fmt_metric('preemptions', sm.get('preemptions'))}: {_times(c.fewer_preemptions)})",
                     f"{fmt_metric('output_throughput', m.get('output_throughput'))} ({_times(c.throughput_kept)}"
                     f"{_pm(tput_noise)})",
                     f"{fmt_time(num(m.get('tbt_p99')))} (vs {fmt_time(num(sm.get('tbt_p99')))}: "
                     f"{_times(c.lower_tbt)}{_pm(tbt_noise)})",
                     f"{fmt_time(num(m.get('ttft_p99')))} (vs {fmt_time(num(sm.get('ttft_p99')))})",
                     _goal_verdict(c, tbt_noise, tput_noise)])
    return rows


def _goal_verdict(c: GoalCheck, tbt_noise: float, throughput_noise: float) -> str:
    if c.met is None:
        return "–"
    if not c.met:
        return "no"
    assert c.lower_tbt is not None and c.throughput_kept is not None
    beyond = (c.lower_tbt / (1 + tbt_noise) >= GOAL_TBT_LOWER
              and c.throughput_kept * (1 - throughput_noise) >= GOAL_THROUGHPUT_KEPT)
    return "yes" if beyond else "within noise"


def _pm(noise: float) -> str:
    return f" ± {noise:.0%}" if noise else ""


def _times(ratio: float | None) -> str:
    if ratio is None:
        return "–"
    return "all" if math.isinf(ratio) else f"{ratio:.2f}x"


def _metric(recorded: Mapping[str, Any], engine: str, mode: str, key: str) -> float | None:
    r = result_of(recorded, engine, mode)
    return num(r["metrics"].get(key)) if r else None


#: how far auto's throughput may sit from the better fixed mode's and still be "the same"
#: (declare.MIN_RATIO_NOISE: the simulator is deterministic, so a single run's jitter floor is all)
AUTO_TOLERANCE = MIN_RATIO_NOISE
AUTO_NO_WORSE = (f"auto's output throughput on the mixed workload is no worse than the better fixed mode's "
                 f"(within {AUTO_TOLERANCE:.0%}) {COST_CLOCK_CLAIM}")
AUTO_BEATS_BOTH = (f"auto's output throughput on the mixed workload beat both fixed modes' by more than "
                   f"{AUTO_TOLERANCE:.0%} {COST_CLOCK_CLAIM}")


def auto_vs_fixed_claims(auto: float | None, recompute: float | None, swap: float | None,
                         mixed: bool = True) -> dict[str, bool | None]:
    """The claims on auto from the three modes' output throughput (None: not decided here).

    No worse: ``auto >= (1 - tol) x max(recompute, swap)``. Better than both: ``auto > (1 + tol) x
    max(...)``, which an auto that always made one fixed mode's choice (forced to always swap, say)
    cannot show, whatever the workload; decided only when the victims mixed (``mixed``: auto chose each
    mode at least once), since a run whose victims were all priced one way has no mix to win from."""
    if auto is None or recompute is None or swap is None:
        return {AUTO_NO_WORSE: None, AUTO_BEATS_BOTH: None}
    best = max(recompute, swap)
    return {AUTO_NO_WORSE: auto >= (1 - AUTO_TOLERANCE) * best,
            AUTO_BEATS_BOTH: auto > (1 + AUTO_TOLERANCE) * best if mixed else None}


def _on_cost_clock(trace: Any) -> bool:
    """Whether a trace's times are the simulator's cost clock: deterministic and carrying every
    preemption's cost. Not a real engine (a single run's times on a shared machine spread far more than
    the tolerance) and not the step clock (a step is a step there, whatever it recomputed or copied)."""
    return trace.engine.split(":", 1)[0] == "sim" and trace.step_seconds is None and "clock=step" not in trace.engine
