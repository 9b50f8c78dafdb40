"""Past capacity: the preemption storm swept by concurrency and swap-space exhaustion
(docs/benchmarks.md#scenarios)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.bench import metrics
from kvbench.bench.formatting import fmt_metric
from kvbench.bench.scenarios.claims import (
    DID_NOT_FIRE,
    Decision,
    count_claim,
    decide,
    held,
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
from kvbench.bench.scenarios.declare import Headline, Pressure, Score, engines_reference_first, num, ratio_headline
from kvbench.bench.workloads import (
    ClosedLoop,
    Fixed,
    Uniform,
    WorkloadSpec,
)
from kvbench.core.trace import Trace
from kvbench.engines.base import Knobs

# --------------------------------------------------------------------------------------------
# 3. preemption storm


@dataclass(frozen=True)
class StormSize:
    spec: WorkloadSpec  # its arrival process is replaced by ClosedLoop(c) for each concurrency c
    concurrencies: tuple[int, ...]
    num_gpu_blocks: int


class PreemptionStorm(Scenario):
    name = "preemption_storm"
    title = "Preemption storm"
    description = ("Closed-loop concurrency swept past what the KV pool holds: throughput "
                   "rises, then preemption and recomputation eat the gain. The same requests at every point. "
                   "The result shown is the top of the sweep; the knee is where throughput stops rising. "
                   "Claims: no preemption at the lowest concurrency, preemptions at the highest, growing with "
                   "concurrency, and preempted work redone or swapped.")
    sizes = {  # noqa: RUF012
        "quick": StormSize(WorkloadSpec("storm", 16, Uniform(32, 128), Fixed(192), ClosedLoop(1), seed=3),
                           concurrencies=(2, 4, 6, 8, 12, 16), num_gpu_blocks=128),
        # full: sequences no longer than quick's (320 tokens at most). On CPU the small model's decode
        # attention grows with batch x longest sequence, so with 384-token prompts throughput stayed flat
        # over the sweep and the pool admitted the same batch from concurrency 8 up (one schedule at
        # four points); at these lengths throughput rises to a knee, then preemptions take it back
        # (docs/journal/measurements.md#the-full-preemption-storm)
        "full": StormSize(WorkloadSpec("storm", 32, Uniform(64, 192), Fixed(128), ClosedLoop(1), seed=3),
                          concurrencies=(4, 8, 12, 16, 24), num_gpu_blocks=160),
    }
    pressure = Pressure(preemptions=True, kv_pinned=True)
    score = Score("output_throughput", True, label="output throughput at the top of the sweep",
                  why="past capacity a storm costs throughput: what the engine still delivers when overloaded")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks)
        return [Job(build_workload(dataclasses.replace(s.spec, arrival=ClosedLoop(c)), model), knobs, x=float(c))
                for c in s.concurrencies]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec),
                "concurrencies": list(s.concurrencies)}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        points = sorted(served, key=lambda sv: sv.job.x or 0.0)
        xs = [sv.job.x or 0.0 for sv in points]
        knee = knee_within(xs, [sv.metrics["output_throughput"] for sv in points])
        for sv in points:
            out.points.append(SweepPoint("concurrency", "concurrent requests", sv.job.x or 0.0, sv.metrics))
        top = points[-1]
        extra = {"knee_concurrency": knee, "concurrency": top.job.x}
        # the knee is not restated here: this is one repeat's, and the report shows the knee of the
        # repeats' medians (one number per fact)
        out.entries.append(ResultEntry(top.trace, extra=extra, notes=[
            f"the storm at concurrency {top.job.x:g}, the top of the sweep"]))
        decide(out, storm_decisions([sv.metrics for sv in points], xs))
        out.claims["every request finished at every point"] = all(all_finished(sv.trace) for sv in points)
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        h = ratio_headline(recorded, reference, title="Throughput in the preemption storm",
                           metric="output_throughput", what="output throughput at the top of the sweep")
        knees = "; ".join(f"{row[0]} {row[1]}" for row in _knee_rows(recorded))
        return Headline(h.title, h.value, h.caption, f"{h.detail} · knee: {knees}" if knees else h.detail,
                        h.within_noise)

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        rows = _knee_rows(recorded)
        if not rows:
            return []
        return [{"title": "Where throughput stops rising", "columns": ["engine", "knee", "throughput at the top",
                                                                       "preemptions at the top"], "rows": rows,
                 "note": "knee: the first concurrency beyond which throughput gains less than 5%"}]


def knee_within(xs: Sequence[float], ys: Sequence[float | None]) -> float | None:
    """The knee of a sweep (:func:`kvbench.bench.metrics.knee`), None when there is none within it:
    metrics.knee answers the last x when throughput was still rising there, which is not a knee."""
    k = metrics.knee(xs, ys)
    return None if k is None or (len(xs) > 1 and k == max(xs)) else k


def _knee_rows(recorded: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for sw in recorded.get("sweeps", []):
        groups: dict[tuple[str, str | None], list[dict]] = {}
        for p in sw["points"]:
            groups.setdefault((p["engine"], p.get("mode")), []).append(p)
        for (engine, mode), pts in groups.items():
            pts = sorted(pts, key=lambda p: p["x"])
            xs = [float(p["x"]) for p in pts]
            tps = [num(p["metrics"].get("output_throughput")) for p in pts]
            if len(pts) < 2 or all(t is None for t in tps):
                continue
            k = knee_within(xs, tps)
            where = f"{k:g}" if k is not None else f"none within the sweep ({xs[0]:g}–{xs[-1]:g})"
            top = pts[-1]["metrics"]
            rows.append([engine + (f" [{mode}]" if mode else ""), where,
                         fmt_metric("output_throughput", top.get("output_throughput")),
                         fmt_metric("preemptions", top.get("preemptions"))])
    return rows


def storm_decisions(sweep: Sequence[Mapping[str, float | None]],
                    xs: Sequence[float] | None = None) -> dict[str, Decision]:
    """Claims of a concurrency sweep from each point's metrics (lowest concurrency first; ``xs`` its
    concurrencies, for the words). Preemption counts are the engine's own counters over each point's run (a
    server's ``/metrics`` scraped before and after it): exact on every engine that publishes them.

    The sweep's two ends are the workload's own pressure (below capacity at the bottom, past it at the top):
    not reached is undecided, and the claims resting on them say so."""
    low, top = sweep[0], sweep[-1]
    at_low, at_top = (f" at concurrency {xs[0]:g}", f" at concurrency {xs[-1]:g}") if xs else ("", "")
    pre_low, pre_top = low.get("preemptions"), top.get("preemptions")
    calm = pressure(
        not_exposed("this engine publishes no preemption counter") if pre_low is None
        else shown(f"0 preemptions{at_low}") if pre_low == 0
        else not_shown(f"the sweep does not start below this engine's capacity: {pre_low:,.0f} preemptions{at_low}"))
    storm = pressure(count_claim(pre_top, "preemption"))
    grew = resting_on(
        not_exposed("this engine publishes no preemption counter") if pre_low is None or pre_top is None
        else shown(f"{pre_low:,.0f}{at_low} -> {pre_top:,.0f}{at_top}") if pre_top > pre_low
        else not_shown(f"{pre_low:,.0f}{at_low} -> {pre_top:,.0f}{at_top}"), calm, storm)
    waste = {k: top.get(k) for k in ("recomputed_tokens", "swap_outs")}
    known = {k: v for k, v in waste.items() if v is not None}
    redone = resting_on(
        not_exposed("this engine publishes neither a recomputed-token nor a swap-out counter") if not known
        else shown(", ".join(f"{k} {v:,.0f}" for k, v in known.items())) if sum(known.values()) > 0
        else not_shown(", ".join(f"{k} 0" for k in known) + f" beside {pre_top or 0:,.0f} preemptions{at_top}",
                       DID_NOT_FIRE), storm)
    return {"the lowest concurrency ran without preemption": calm, "the highest concurrency preempted (a storm)": storm,
            "preemptions grew with concurrency": grew, "preempted work was recomputed or swapped": redone}


def storm_claims(sweep: Sequence[Mapping[str, float | None]], traces: Sequence[Trace]) -> dict[str, bool | None]:
    """:func:`storm_decisions` as plain verdicts, with "every request finished at every point"."""
    return {**held(storm_decisions(sweep)), "every request finished at every point": all(all_finished(t)
                                                                                        for t in traces)}


# --------------------------------------------------------------------------------------------
# 8. swap-space exhaustion


@dataclass(frozen=True)
class ExhaustionSize:
    spec: WorkloadSpec  # closed loop past capacity
    num_gpu_blocks: int
    ample_cpu_blocks: int
    small_cpu_blocks: int  # room for one to three victims (quick: a quarter of the device pool; full: 15%)


class SwapSpaceExhaustion(Scenario):
    name = "swap_space_exhaustion"
    title = "Swap-space exhaustion"
    description = ("A preemption storm in swap mode with the host (swap) pool ample, then too small (when "
                   "swap space runs out the scheduler falls back to recompute, and the preemption pattern "
                   "changes abruptly). The moment of the first fallback and the swaps before it are reported. "
                   "Claims: ample, it swapped and never fell back; too small, it swapped first, then fell back.")
    needs = ("swap",)
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": ExhaustionSize(WorkloadSpec("exhaustion", 24, Uniform(64, 192), Fixed(128), ClosedLoop(16), seed=10),
                                num_gpu_blocks=96, ample_cpu_blocks=1024, small_cpu_blocks=24),
        "full": ExhaustionSize(WorkloadSpec("exhaustion", 32, Uniform(128, 384), Fixed(96), ClosedLoop(16), seed=10),
                               num_gpu_blocks=160, ample_cpu_blocks=2048, small_cpu_blocks=24),
    }
    modes = ("ample_swap_space", "exhausted_swap_space")
    pressure = Pressure(preemptions=True, kv_pinned=True, forced_mode="swap", swap_fallback=True)
    score = Score("output_throughput", True, mode="exhausted_swap_space", label="output throughput, small host pool",
                  why="when the host pool runs out, swap falls back to recompute: what that costs in work done")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = build_workload(s.spec, model)
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks, preemption_mode="swap",
                                    num_cpu_blocks=cpu), mode=mode)
                for mode, cpu in zip(self.modes, (s.ample_cpu_blocks, s.small_cpu_blocks), strict=True)]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec), "preemption_mode": "swap",
                "num_cpu_blocks_ample": s.ample_cpu_blocks, "num_cpu_blocks_small": s.small_cpu_blocks}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        by_mode = {sv.job.mode: sv for sv in served}
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra={
                **first_fallback(sv.trace), "num_cpu_blocks": float(sv.job.knobs.num_cpu_blocks or 0)}))
        decide(out, exhaustion_decisions(by_mode["ample_swap_space"].metrics, by_mode["exhausted_swap_space"].metrics))
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        title = "Swap-space exhaustion"
        for engine in engines_reference_first(recorded, reference):
            small = next((r["metrics"] for r in recorded["results"] if r["engine"] == engine
                          and r.get("mode") == "exhausted_swap_space"), None)
            if small is None:
                continue
            t, swaps = num(small.get("first_fallback_s")), num(small.get("swaps_before_first_fallback"))
            if t is None:
                # the per-request records saw no fallback: the engine's own counters say whether it had none (a
                # count missing or not exposed never reads as none)
                fb, outs = num(small.get("swap_fallbacks")), small.get("swap_outs")
                if fb:
                    return Headline(title, f"{fmt_metric('swap_fallbacks', fb)} fallbacks",
                                    f"swap fell back to recompute ({engine}; when is not recorded)",
                                    f"{fmt_metric('swap_outs', outs)} swaps out")
                if fb is None and swaps is None:
                    return Headline(title, None, f"fallbacks not exposed ({engine})",
                                    f"{fmt_metric('swap_outs', outs)} swaps out")
                return Headline(title, "no fallback", f"the small host pool never ran out ({engine})",
                                f"{swaps:,.0f} swaps" if swaps is not None else
                                f"{fmt_metric('swap_outs', outs)} swaps out")
            usage = num(small.get("cpu_kv_usage_at_first_fallback"))
            return Headline(title, f"after {swaps or 0:,.0f} swaps", f"first fallback to recompute ({engine})",
                            f"at {t:.2f} s" + (f", host pool {usage:.0%} full" if usage is not None else ""))
        return Headline(title, None, "needs a run with the small host pool")


def first_fallback(trace: Trace) -> dict[str, float | None]:
    """When swap first fell back to recompute in a swap-mode run (its first recompute preemption),
    how many swaps came before, and how full the host pool was just before it."""
    if not metrics.per_request_preemptions_known(trace):  # records miss what the engine counted: not "none"
        return {"first_fallback_s": None, "swaps_before_first_fallback": None, "cpu_kv_usage_at_first_fallback": None}
    marks = sorted((t, mode) for r in trace.requests.values() for t, mode in r.preemptions)
    t_first = next((t for t, mode in marks if mode == "recompute"), None)
    if t_first is None:
        return {"first_fallback_s": None, "swaps_before_first_fallback": float(len(marks)),
                "cpu_kv_usage_at_first_fallback": None}
    usage = [s.cpu_kv_usage for s in trace.steps if s.t < t_first and s.cpu_kv_usage is not None]
    return {"first_fallback_s": t_first, "swaps_before_first_fallback": float(sum(1 for t, m in marks
                                                                                  if m == "swap" and t < t_first)),
            "cpu_kv_usage_at_first_fallback": usage[-1] if usage else None}


def exhaustion_decisions(ample: Mapping[str, float | None], small: Mapping[str, float | None]) -> dict[str, Decision]:
    """Claims of the two host pools from their runs' metrics. Swapping at all is the workload's pressure (a
    storm in swap mode); falling back, with a host pool too small, is the mechanism."""
    fb_ample = ample.get("swap_fallbacks")
    swapped = pressure(count_claim(ample.get("preemptions_swap"), "swap-preemption"))
    swapped_small = pressure(count_claim(small.get("preemptions_swap"), "swap-preemption"))
    return {
        "ample host pool: preempted by swap": swapped,
        "ample host pool: never fell back to recompute": resting_on(
            not_exposed("this engine publishes no swap-fallback counter") if fb_ample is None
            else shown("0 swap fallbacks") if fb_ample == 0 else not_shown(f"{fb_ample:,.0f} swap fallbacks"),
            swapped),
        "small host pool: swapped before it ran out": swapped_small,
        "small host pool: swap fell back to recompute": resting_on(count_claim(small.get("swap_fallbacks"),
                                                                               "swap-fallback"), swapped_small),
    }


def exhaustion_claims(ample: Mapping[str, float | None], small: Mapping[str, float | None]) -> dict[str, bool | None]:
    """:func:`exhaustion_decisions` as plain verdicts."""
    return held(exhaustion_decisions(ample, small))
