"""Traffic surges: the evening wave of long-context requests and the flash crowd (docs/benchmarks.md#scenarios)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbench.bench.formatting import fmt_metric, fmt_time
from kvbench.bench.scenarios.claims import (
    decide,
    kv_filled,
    not_shown,
    preempted_after,
    pressure,
    shown,
)
from kvbench.bench.scenarios.common import (
    BLOCK_SIZE,
    DOUBLED,
    FULL_POOL,
    Job,
    Model,
    Outcome,
    ResultEntry,
    Scenario,
    Served,
    all_finished,
    build_workload,
    describe_spec,
    percentile,
    preemptions_between,
    ttft_by,
)
from kvbench.bench.scenarios.declare import Headline, Pressure, Score, num, others_first
from kvbench.bench.workloads import (
    Poisson,
    StepSurge,
    Uniform,
    WorkloadSpec,
    combine,
)
from kvbench.core.trace import Trace
from kvbench.drivers.step_loop import workload_clock
from kvbench.engines.base import Knobs

# --------------------------------------------------------------------------------------------
# 1. evening surge


@dataclass(frozen=True)
class SurgeSize:
    steady: WorkloadSpec
    wave: WorkloadSpec
    wave_start_s: float
    num_gpu_blocks: int


class EveningSurge(Scenario):
    name = "evening_surge"
    title = "Evening surge"
    description = ("Steady short traffic, then a wave of long-context requests: the wave fills the KV "
                   "pool and the scheduler starts preempting. Claims: KV usage peaks above 90%, the wave "
                   "preempted running requests, every request finished.")
    sizes = {  # noqa: RUF012
        "quick": SurgeSize(
            steady=WorkloadSpec("steady", 40, Uniform(32, 128), Uniform(32, 64), Poisson(8.0), seed=0),
            wave=WorkloadSpec("wave", 12, Uniform(512, 768), Uniform(96, 160), Poisson(10.0), seed=1),
            wave_start_s=3.0, num_gpu_blocks=128),
        # full (as every full size: see "Scales" in kvbench/bench/scenarios/__init__.py): the wave's
        # prompts are longer than the tiny model's whole context
        "full": SurgeSize(
            steady=WorkloadSpec("steady", 44, Uniform(48, 192), Uniform(24, 64), Poisson(2.0), seed=0),
            wave=WorkloadSpec("wave", 10, Uniform(768, 1152), Uniform(48, 96), Poisson(2.0), seed=1),
            wave_start_s=10.0, num_gpu_blocks=160),
    }
    pressure = Pressure(preemptions=True, kv_pinned=True)
    score = Score("ttft_p99_wave", False, label="p99 TTFT of the long-context wave",
                  why="the surge is the long-context wave: how long its slowest users wait for a first token")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        wave = build_workload(s.wave, model).shifted(s.wave_start_s)
        workload = combine(self.name, build_workload(s.steady, model), wave)
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks))]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "steady": describe_spec(s.steady), "wave": describe_spec(s.wave),
                "wave_start_s": s.wave_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        (run_,) = served
        s, trace = self.size(scale), run_.trace
        long_from = s.wave.input_len.bounds()[0]
        out = self.outcome(scale, model)
        wave, steady = ttft_by(trace, lambda r: r.prompt_len >= long_from), ttft_by(trace, lambda r: r.prompt_len
                                                                                   < long_from)
        extra = {"ttft_p50_steady": percentile(steady, 50), "ttft_p99_steady": percentile(steady, 99),
                 "ttft_p50_wave": percentile(wave, 50), "ttft_p99_wave": percentile(wave, 99),
                 **before_after(trace, s.wave_start_s)}
        out.entries.append(ResultEntry(trace, extra=extra))
        # both are the wave's own pressure, read from the engine's evidence (its preemption counter, its own
        # steps) before a sampled gauge: not reached is undecided, never the engine's failure
        decide(out, {
            f"the wave filled the KV pool (peak usage > {FULL_POOL:.0%})": pressure(
                kv_filled(trace, s.wave_start_s, FULL_POOL)),
            # counted from the wave's start: preemptions of the steady traffic alone would not show it
            "the wave preempted running requests": pressure(preempted_after(trace, s.wave_start_s, "the wave")),
        })
        out.claims["every request finished"] = all_finished(trace)
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        return surge_headline(recorded, reference, "Evening surge", "the wave")

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [surge_table(recorded, "the wave")]


# --------------------------------------------------------------------------------------------
# 2. flash crowd


@dataclass(frozen=True)
class FlashSize:
    spec: WorkloadSpec  # arrival: a StepSurge whose second phase doubles the first's rate
    num_gpu_blocks: int

    @property
    def surge_start_s(self) -> float:
        assert isinstance(self.spec.arrival, StepSurge)
        return float(self.spec.arrival.phases[0][0])

    @property
    def surge_end_s(self) -> float:
        assert isinstance(self.spec.arrival, StepSurge)
        return float(sum(d for d, _ in self.spec.arrival.phases[:2]))


class FlashCrowd(Scenario):
    name = "flash_crowd"
    title = "Flash crowd"
    description = ("Traffic doubles within a minute (a marketing pop-up, say), a step surge whose "
                   "second phase pushes concurrency just over what the KV pool holds. Claims: arrivals doubled, "
                   "the engine preempted, every request finished. Preemptions before vs after the step tell a "
                   "safety net (only at the peak) from a structural capacity gap (throughout).")
    sizes = {  # noqa: RUF012
        # Rates high enough that even a fast engine on the tiny model runs over its 48 blocks after
        # the step (at 4 -> 8 req/s a faster reference engine kept up and never preempted).
        "quick": FlashSize(WorkloadSpec("flash", 72, Uniform(64, 256), Uniform(32, 96),
                                        StepSurge(((3.0, 8.0), (3.0, 16.0))), seed=2), num_gpu_blocks=48),
        "full": FlashSize(WorkloadSpec("flash", 84, Uniform(96, 320), Uniform(32, 96),
                                       StepSurge(((8.0, 3.5), (8.0, 7.0))), seed=2), num_gpu_blocks=128),
    }
    pressure = Pressure(preemptions=True, kv_pinned=True)
    score = Score("ttft_p99_after_surge", False, label="p99 TTFT of requests arriving after the surge",
                  why="a flash crowd is felt as waiting: how long the slowest newcomers wait once traffic doubles")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        return [Job(build_workload(s.spec, model), Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks))]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec), "surge_start_s": s.surge_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        (run_,) = served
        s, trace = self.size(scale), run_.trace
        t_surge = s.surge_start_s
        out = self.outcome(scale, model)
        extra = {**before_after(trace, t_surge), "arrival_rate_ratio": arrival_rate_ratio(trace, t_surge,
                                                                                           s.surge_end_s)}
        before, after = extra["preemptions_before_surge"], extra["preemptions_after_surge"]
        notes = []
        if before is not None and after is not None and before + after:
            notes.append("preemptions only after the surge: the safety net at work" if before == 0 else
                         f"{before:,.0f} preemptions before the surge: a structural capacity gap "
                         "(docs/benchmarks.md#diagnosis)")
        out.entries.append(ResultEntry(trace, extra=extra, notes=notes))
        ratio = extra["arrival_rate_ratio"]
        decide(out, {
            # the workload's own doing (the driver released it): a precondition, never the engine's failure
            f"traffic doubled at t={t_surge:g}s (arrival rate x{DOUBLED} or more)": pressure(
                shown(f"arrival rate x{ratio:.2f}") if ratio is not None and ratio >= DOUBLED
                else not_shown("arrival rate " + ("not measurable (no arrival before the surge)" if ratio is None
                                                  else f"x{ratio:.2f} only"))),
            # counted from the step: preemptions before it would not be the surge's doing
            "the surge pushed concurrency over capacity (preemptions after it began)": pressure(
                preempted_after(trace, t_surge, "the surge")),
        })
        out.claims["every request finished"] = all_finished(trace)
        return out


    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        return surge_headline(recorded, reference, "Flash crowd", "the surge")

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [surge_table(recorded, "the surge")]


def before_after(trace: Trace, t_surge: float) -> dict[str, float | None]:
    """Preemptions, and TTFT of the requests arriving, before and after ``t_surge``. Preemption
    counts are None when the engine records no per-request preemptions (it cannot tell when)."""
    known = not ({"preemptions", "events"} & set(trace.not_exposed))
    clock = workload_clock(trace)  # arrivals on the workload's clock, also on the step clock
    before = ttft_by(trace, lambda r: clock(r.arrival) < t_surge)
    after = ttft_by(trace, lambda r: clock(r.arrival) >= t_surge)
    return {"preemptions_before_surge": float(preemptions_between(trace, 0.0, t_surge)) if known else None,
            "preemptions_after_surge": float(preemptions_between(trace, t_surge, math.inf)) if known else None,
            "ttft_p50_before_surge": percentile(before, 50), "ttft_p99_before_surge": percentile(before, 99),
            "ttft_p50_after_surge": percentile(after, 50), "ttft_p99_after_surge": percentile(after, 99),
            "surge_start_s": t_surge}


def surge_headline(recorded: Mapping[str, Any], reference: str | None, title: str, what: str) -> Headline:
    """Preemptions before -> after the surge began, per engine (counts: no noise to speak of)."""
    rows = []
    engines = list(dict.fromkeys(r["engine"] for r in recorded.get("results", [])))
    for engine in ([reference] if reference in engines else []) + others_first(engines, reference):
        m = next(r["metrics"] for r in recorded["results"] if r["engine"] == engine)
        b, a = num(m.get("preemptions_before_surge")), num(m.get("preemptions_after_surge"))
        if b is not None and a is not None:
            rows.append((engine, b, a, m))
    if not rows:
        return Headline(title, None, f"needs per-request preemption times before and after {what}")
    engine, b, a, m = rows[0]
    detail = "; ".join(f"{e} {bb:,.0f} → {aa:,.0f}" for e, bb, aa, _ in rows[1:])
    ttft = (f"p99 TTFT {fmt_time(num(m.get('ttft_p99_before_surge')))} → "
            f"{fmt_time(num(m.get('ttft_p99_after_surge')))}")
    return Headline(title, f"{b:,.0f} → {a:,.0f}", f"preemptions before → after {what} began ({engine}); {ttft}",
                    detail)


def surge_table(recorded: Mapping[str, Any], what: str) -> dict[str, Any]:
    rows = []
    for r in recorded.get("results", []):
        m = r["metrics"]
        rows.append([r["engine"] + (f" [{r['mode']}]" if r.get("mode") else ""),
                     fmt_metric("preemptions", m.get("preemptions_before_surge")),
                     fmt_metric("preemptions", m.get("preemptions_after_surge")),
                     fmt_time(num(m.get("ttft_p50_before_surge"))), fmt_time(num(m.get("ttft_p50_after_surge"))),
                     fmt_time(num(m.get("ttft_p99_before_surge"))), fmt_time(num(m.get("ttft_p99_after_surge")))])
    return {"title": f"Before and after {what} began", "rows": rows,
            "columns": ["engine", "preemptions before", "preemptions after", "p50 TTFT before", "p50 TTFT after",
                        "p99 TTFT before", "p99 TTFT after"],
            "note": "TTFT of the requests arriving before / after; preemptions by when they happened"}


def arrival_rate_ratio(trace: Trace, t_step: float, t_end: float) -> float | None:
    """Arrivals per second in ``[t_step, t_end)`` over arrivals per second in ``[0, t_step)``."""
    clock = workload_clock(trace)  # on the step clock, a release's wall time maps back to its step's virtual time
    arrivals = [clock(r.arrival) for r in trace.requests.values()]
    before = sum(1 for a in arrivals if a < t_step) / t_step
    after = sum(1 for a in arrivals if t_step <= a < t_end) / (t_end - t_step)
    return after / before if before > 0 else None
