"""The seeds' storm scenarios as data, with one small runner and a claim checker per scenario.

A scenario is a plan (the workloads to serve and the knobs to serve them under, at a ``quick``
or ``full`` scale) plus a judge (what the run must have shown, and the figures it adds). Running
one is always the same: serve every planned :class:`Job` on an engine adapter, then judge::

    outcome = run(PREEMPTION_STORM, adapter, model, "quick", progress)
    record(outcome, results, adapter.describe())        # results entries, sweeps, checks
    assert not outcome.failures(), outcome.explain()    # the scenario did what it claims

Contracts:

* **Claims are about what happened, never about time.** A storm must have preempted, a surge must
  have filled the pool, a crossover sweep must hold both modes at every length. Times are
  measured and reported, never asserted. A claim the engine cannot show (it does not expose the
  counter) is ``None``: reported as a note, neither passed nor failed.
* **Same seed, same requests, every engine.** Workloads come from seeded
  :class:`~kvbench.workloads.WorkloadSpec`; pressure comes from engine-neutral
  :class:`~kvbench.engines.base.Knobs` (pool size, block size, budgets, modes).
* **Modes of one engine are measured side by side in one test** (swap vs recompute, chunked vs
  unchunked, caching on vs off), so their ratio never mixes machines or moments.
* **A run's duration ends at its last token or finish**, for every engine alike: an adapter's
  teardown after the last request (a thread join, a garbage collection) is not serving time.

Scales: ``quick`` runs on the built-in ``tiny`` checkpoint (1,024 positions) and fits, all
scenarios on three engines, in under ten minutes on two CPU cores; ``full`` is sized for the
``small`` checkpoint (4,096 positions) and takes much longer. Sizes are in the tables below.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbench import metrics
from kvbench.engines.base import EngineAdapter, Knobs
from kvbench.trace import Trace, TraceRecorder
from kvbench.workloads import (
    AllAtOnce,
    ClosedLoop,
    Explicit,
    Fixed,
    Poisson,
    Priorities,
    SharedPrefix,
    StepSurge,
    Uniform,
    Workload,
    WorkloadSpec,
    combine,
)

SCALES = ("quick", "full")
BLOCK_SIZE = 16
#: the built-in checkpoint each scale runs on when ``--kvbench-model`` is not given
MODEL_PRESETS = {"quick": "tiny", "full": "small"}
#: KV usage above which a pool counts as filled (seed 000: usage "approaches the limit")
FULL_POOL = 0.9
#: arrival-rate ratio from which a step surge counts as "traffic doubled" (Poisson noise allowed)
DOUBLED = 1.6

Progress = Callable[[int], None]


# --------------------------------------------------------------------------------------------
# models, jobs, outcomes


@dataclass(frozen=True)
class Model:
    """The checkpoint a scenario runs on: where it is and the two numbers the plans need."""

    path: str
    preset: str  # "tiny", "small", or "custom" for --kvbench-model
    vocab_size: int
    max_model_len: int

    @classmethod
    def from_dir(cls, path: str | Path, preset: str = "custom") -> Model:
        cfg = json.loads((Path(path) / "config.json").read_text())
        return cls(str(path), preset, int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048)))


@dataclass(frozen=True)
class Job:
    """One workload a scenario serves, under ``knobs``; ``mode`` names the variant in results
    (``"chunked"``, ``"swap"``...), ``x`` its place on a sweep (concurrency, sequence length)."""

    workload: Workload
    knobs: Knobs
    mode: str | None = None
    x: float | None = None


@dataclass
class Served:
    """A job and what serving it produced."""

    job: Job
    trace: Trace
    _metrics: dict[str, float | None] | None = field(default=None, init=False, repr=False)

    @property
    def metrics(self) -> dict[str, float | None]:
        """``metrics.summarize`` of the trace, computed once."""
        if self._metrics is None:
            self._metrics = metrics.summarize(self.trace)
        return self._metrics


@dataclass
class ResultEntry:
    """One results entry: a run's trace in a mode, with figures the judge adds to the summary."""

    trace: Trace
    mode: str | None = None
    extra: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class SweepPoint:
    sweep: str
    x_label: str
    x: float
    metrics: dict[str, float | None]
    mode: str | None = None


@dataclass
class Outcome:
    """What a scenario run showed: results entries, sweep points and its claims.

    ``claims`` maps a claim, worded as a statement, to True (shown), False (not shown: the
    benchmark fails) or None (the engine does not expose what it takes to tell).
    """

    scenario: Scenario
    scale: str
    parameters: dict[str, Any]
    entries: list[ResultEntry] = field(default_factory=list)
    points: list[SweepPoint] = field(default_factory=list)
    claims: dict[str, bool | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        return [claim for claim, held in self.claims.items() if held is False]

    def explain(self) -> str:
        lines = [f"{self.scenario.name} ({self.scale}): claims not shown:"]
        lines += [f"  - {c}" for c in self.failures()]
        lines += [f"  note: {n}" for n in self.notes]
        for e in self.entries:
            m = metrics.summarize(e.trace)
            lines.append(f"  [{e.mode or '-'}] " + ", ".join(
                f"{k}={m.get(k)}" for k in ("requests_finished", "preemptions", "recomputed_tokens", "swap_fallbacks",
                                             "kv_usage_max", "prefix_cache_hits", "prefill_chunks")))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the scenario base class


class Scenario:
    """A named storm: ``sizes[scale]`` is its data, ``plan`` the jobs, ``judge`` the claims.

    ``needs``: capabilities the engine must have (the benchmark skips otherwise).
    ``knobs_needed``: :class:`Knobs` fields the plan sets to values some engines cannot take (an
    adapter lists those in ``unsupported_knobs``; the benchmark skips with the adapter's reason).
    ``engine_mode_matters``: False when the scenario sets the preemption mode itself (or never
    preempts), so two engine specs that differ only in ``preemption_mode`` would measure the same.
    """

    name: str = ""
    seed_doc: str = ""
    title: str = ""
    description: str = ""
    needs: tuple[str, ...] = ()
    knobs_needed: tuple[str, ...] = ()
    engine_mode_matters: bool = True
    sizes: Mapping[str, Any] = {}  # scale -> size; read-only, set by subclasses

    def size(self, scale: str) -> Any:
        if scale not in SCALES:
            raise ValueError(f"scale {scale!r} is not one of {SCALES}")
        return self.sizes[scale]

    def plan(self, scale: str, model: Model) -> list[Job]:
        raise NotImplementedError

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        """What results files and the report show about the setup (pool size and block size included)."""
        size = self.size(scale)
        return {"scale": scale, "model": model.preset, "block_size": BLOCK_SIZE,
                "num_gpu_blocks": size.num_gpu_blocks, "source": f"seed {self.seed_doc}"}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        raise NotImplementedError

    def num_requests(self, scale: str, model: Model) -> int:
        """How many requests ``plan`` serves in all (a progress bar's total)."""
        return sum(len(job.workload) for job in self.plan(scale, model))

    def outcome(self, scale: str, model: Model) -> Outcome:
        return Outcome(self, scale, self.parameters(scale, model))


def _build(spec: WorkloadSpec, model: Model) -> Workload:
    return spec.build(model.vocab_size, max_prompt_len=model.max_model_len - 1)


def describe_spec(spec: WorkloadSpec) -> str:
    """A workload spec in words, for the report's parameter chips (its JSON form is in the spec)."""
    parts = [f"{spec.num_requests} requests", f"prompts {_lengths(spec.input_len)}",
             f"outputs {_lengths(spec.output_len)}", _arrivals(spec.arrival)]
    if spec.shared_prefix is not None:
        sp = spec.shared_prefix
        parts[1] = f"prompts {sp.prefix_len} shared + {_lengths(spec.input_len)}"
        if sp.num_groups > 1:
            parts[1] += f" ({sp.num_groups} prefixes)"
    if spec.priorities is not None and len(spec.priorities.levels) == 1:
        parts.append(f"priority {spec.priorities.levels[0]}")
    return ", ".join(p for p in parts if p)


def _lengths(dist: Any) -> str:
    if isinstance(dist, Fixed):
        return str(dist.n)
    if isinstance(dist, Uniform):
        return f"{dist.low}-{dist.high}"
    if isinstance(dist, Explicit):
        return "/".join(str(v) for v in dist.values)
    low, high = dist.bounds()
    return f"{dist.kind} {low}-{high}"


def _arrivals(arrival: Any) -> str:
    if isinstance(arrival, Poisson):
        return f"Poisson {arrival.rate:g}/s"
    if isinstance(arrival, StepSurge):
        return "then ".join(f"{rate:g}/s for {d:g}s " for d, rate in arrival.phases).strip()
    if isinstance(arrival, AllAtOnce):
        return "all at t=0"
    if isinstance(arrival, ClosedLoop):
        return "closed loop"
    return str(arrival.to_dict())


# --------------------------------------------------------------------------------------------
# serving


def _accepts_progress(adapter: EngineAdapter) -> bool:
    try:
        return "progress" in inspect.signature(adapter.serve).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def serve(adapter: EngineAdapter, job: Job, scenario: str, progress: Progress | None = None) -> Trace:
    """Serve one job and return its trace, its duration ending at the last token or finish.

    Progress is reported per finished request when the adapter can (``serve(progress=...)``),
    else all at once when the workload is done.
    """
    recorder = TraceRecorder(adapter.name, scenario)
    if progress is not None and _accepts_progress(adapter):
        adapter.serve(job.workload, recorder, job.knobs, progress=progress)  # type: ignore[call-arg]
    else:
        adapter.serve(job.workload, recorder, job.knobs)
        if progress is not None:
            progress(len(job.workload))
    trace = recorder.finish()
    trace.duration = last_event(trace) or trace.duration
    return trace


def last_event(trace: Trace) -> float:
    """The time of the last token, finish or step of a trace (0 for an empty one)."""
    times = [t for r in trace.requests.values() for t in (*r.token_times[-1:], r.finished or 0.0)]
    times += [s.t for s in trace.steps[-1:]]
    return max(times, default=0.0)


def run(scenario: Scenario, adapter: EngineAdapter, model: Model, scale: str,
        progress: Progress | None = None) -> Outcome:
    """Serve every job of ``scenario.plan`` on ``adapter`` in order, then judge the runs."""
    served = [Served(job, serve(adapter, job, scenario.name, progress)) for job in scenario.plan(scale, model)]
    return scenario.judge(served, scale, model)


def record(outcome: Outcome, results: Any, engine: Mapping[str, Any] | str,
           slos: str | Mapping[str, float] | None = None) -> None:
    """Add an outcome to a :class:`~kvbench.results.Results`: one entry per result (summary +
    the judge's extra figures + timelines), every sweep point, and the claims as checks.
    Claims the engine could not show (None) become notes rather than checks."""
    checks = {c: bool(v) for c, v in outcome.claims.items() if v is not None}
    unknown = [f"not measurable on this engine: {c}" for c, v in outcome.claims.items() if v is None]
    params = {**outcome.parameters}
    for entry in outcome.entries:
        summary = {**metrics.summarize(entry.trace, slos), **entry.extra}
        results.add_scenario_result(outcome.scenario.name, engine, summary, series=metrics.series(entry.trace),
                                    checks=checks, notes=[*entry.notes, *outcome.notes, *unknown], mode=entry.mode,
                                    parameters=params, description=outcome.scenario.description)
    if not outcome.entries:
        results.scenario(outcome.scenario.name, create=True, parameters=params,
                         description=outcome.scenario.description)
    for p in outcome.points:
        results.add_sweep_point(outcome.scenario.name, p.sweep, p.x, engine, p.metrics, mode=p.mode,
                                x_label=p.x_label)


# --------------------------------------------------------------------------------------------
# claims shared by scenarios


def all_finished(trace: Trace) -> bool:
    """Every request finished, none with an error (an engine that drops requests has not served them)."""
    return bool(trace.requests) and all(r.finished is not None and r.finish_reason != "error"
                                        for r in trace.requests.values())


def _positive(value: float | None) -> bool | None:
    return None if value is None else value > 0


def _pct(values: Sequence[float], q: float) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(vals, q)) if vals else None


def ttft_by(trace: Trace, keep: Callable[[Any], bool]) -> list[float]:
    """TTFTs of the requests ``keep`` selects (requests without a token are left out)."""
    return [r.token_times[0] - r.arrival for r in trace.requests.values() if keep(r) and r.token_times]


def preemptions_between(trace: Trace, t0: float, t1: float) -> int:
    return sum(1 for r in trace.requests.values() for t, _ in r.preemptions if t0 <= t < t1)


# --------------------------------------------------------------------------------------------
# 1. evening surge (seed 000)


@dataclass(frozen=True)
class SurgeSize:
    steady: WorkloadSpec
    wave: WorkloadSpec
    wave_start_s: float
    num_gpu_blocks: int


class EveningSurge(Scenario):
    name = "evening_surge"
    seed_doc = "000"
    title = "Evening surge"
    description = ("Steady short traffic, then a wave of long-context requests (seed 000): the wave fills the KV "
                   "pool and the scheduler starts preempting. Claims: KV usage peaks above 90%, the wave "
                   "preempted running requests, every request finished.")
    sizes = {  # noqa: RUF012
        "quick": SurgeSize(
            steady=WorkloadSpec("steady", 40, Uniform(32, 128), Uniform(32, 64), Poisson(8.0), seed=0),
            wave=WorkloadSpec("wave", 12, Uniform(512, 768), Uniform(96, 160), Poisson(10.0), seed=1),
            wave_start_s=3.0, num_gpu_blocks=128),
        "full": SurgeSize(
            steady=WorkloadSpec("steady", 300, Uniform(64, 512), Uniform(64, 256), Poisson(5.0), seed=0),
            wave=WorkloadSpec("wave", 60, Uniform(2048, 3072), Uniform(512, 1000), Poisson(1.0), seed=1),
            wave_start_s=45.0, num_gpu_blocks=1024),
    }

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = combine(self.name, _build(s.steady, model), _build(s.wave, model).shifted(s.wave_start_s))
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks))]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "steady": describe_spec(s.steady), "wave": describe_spec(s.wave),
                "wave_start_s": s.wave_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        (run_,) = served
        s, m, trace = self.size(scale), run_.metrics, run_.trace
        long_from = s.wave.input_len.bounds()[0]
        out = self.outcome(scale, model)
        wave, steady = ttft_by(trace, lambda r: r.prompt_len >= long_from), ttft_by(trace, lambda r: r.prompt_len
                                                                                   < long_from)
        extra = {"ttft_p50_steady": _pct(steady, 50), "ttft_p99_steady": _pct(steady, 99),
                 "ttft_p50_wave": _pct(wave, 50), "ttft_p99_wave": _pct(wave, 99),
                 "preemptions_before_wave": float(preemptions_between(trace, 0.0, s.wave_start_s))}
        out.entries.append(ResultEntry(trace, extra=extra))
        kv = m["kv_usage_max"]
        out.claims = {
            f"the wave filled the KV pool (peak usage > {FULL_POOL:.0%})": None if kv is None else kv > FULL_POOL,
            "the wave preempted running requests": _positive(m["preemptions"]),
            "every request finished": all_finished(trace),
        }
        return out


# --------------------------------------------------------------------------------------------
# 2. flash crowd (seed 001)


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
    seed_doc = "001"
    title = "Flash crowd"
    description = ("Traffic doubles within a minute (seed 001: a marketing pop-up at 10am), a step surge whose "
                   "second phase pushes concurrency just over what the KV pool holds. Claims: arrivals doubled, "
                   "the engine preempted, every request finished. Preemptions before vs after the step tell a "
                   "safety net (only at the peak) from a structural capacity gap (throughout).")
    sizes = {  # noqa: RUF012
        "quick": FlashSize(WorkloadSpec("flash", 72, Uniform(64, 256), Uniform(32, 96),
                                        StepSurge(((6.0, 4.0), (6.0, 8.0))), seed=2), num_gpu_blocks=64),
        "full": FlashSize(WorkloadSpec("flash", 360, Uniform(256, 1024), Uniform(128, 512),
                                       StepSurge(((60.0, 2.0), (60.0, 4.0))), seed=2), num_gpu_blocks=512),
    }

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        return [Job(_build(s.spec, model), Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks))]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec), "surge_start_s": s.surge_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        (run_,) = served
        s, trace, m = self.size(scale), run_.trace, run_.metrics
        t_surge = s.surge_start_s
        out = self.outcome(scale, model)
        before, after = preemptions_between(trace, 0.0, t_surge), preemptions_between(trace, t_surge, math.inf)
        extra = {"preemptions_before_surge": float(before), "preemptions_after_surge": float(after),
                 "arrival_rate_ratio": arrival_rate_ratio(trace, t_surge, s.surge_end_s)}
        notes = []
        if m["preemptions"]:
            notes.append("preemptions only after the surge: the safety net at work" if before == 0 else
                         f"{before} preemptions before the surge: a structural capacity gap (seed 001)")
        out.entries.append(ResultEntry(trace, extra=extra, notes=notes))
        ratio = extra["arrival_rate_ratio"]
        out.claims = {
            f"traffic doubled at t={t_surge:g}s (arrival rate x{DOUBLED} or more)": ratio is not None
            and ratio >= DOUBLED,
            "the surge pushed concurrency over capacity (preemptions)": _positive(m["preemptions"]),
            "every request finished": all_finished(trace),
        }
        return out


def arrival_rate_ratio(trace: Trace, t_step: float, t_end: float) -> float | None:
    """Arrivals per second in ``[t_step, t_end)`` over arrivals per second in ``[0, t_step)``."""
    arrivals = [r.arrival for r in trace.requests.values()]
    before = sum(1 for a in arrivals if a < t_step) / t_step
    after = sum(1 for a in arrivals if t_step <= a < t_end) / (t_end - t_step)
    return after / before if before > 0 else None


# --------------------------------------------------------------------------------------------
# 3. preemption storm (seed 004)


@dataclass(frozen=True)
class StormSize:
    spec: WorkloadSpec  # its arrival process is replaced by ClosedLoop(c) for each concurrency c
    concurrencies: tuple[int, ...]
    num_gpu_blocks: int


class PreemptionStorm(Scenario):
    name = "preemption_storm"
    seed_doc = "004"
    title = "Preemption storm"
    description = ("Closed-loop concurrency swept past what the KV pool holds (seed 004, section 4.3): throughput "
                   "rises, then preemption and recomputation eat the gain. The same requests at every point. "
                   "The result shown is the top of the sweep; the knee is where throughput stops rising. "
                   "Claims: no preemption at the lowest concurrency, preemptions at the highest, growing with "
                   "concurrency, and preempted work redone or swapped.")
    sizes = {  # noqa: RUF012
        "quick": StormSize(WorkloadSpec("storm", 16, Uniform(32, 128), Fixed(192), ClosedLoop(1), seed=3),
                           concurrencies=(2, 4, 6, 8, 12, 16), num_gpu_blocks=128),
        "full": StormSize(WorkloadSpec("storm", 96, Uniform(512, 1536), Fixed(384), ClosedLoop(1), seed=3),
                          concurrencies=(2, 4, 8, 12, 16, 24, 32, 48), num_gpu_blocks=1024),
    }

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks)
        return [Job(_build(dataclasses.replace(s.spec, arrival=ClosedLoop(c)), model), knobs, x=float(c))
                for c in s.concurrencies]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec),
                "concurrencies": list(s.concurrencies)}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        points = sorted(served, key=lambda sv: sv.job.x or 0.0)
        xs = [sv.job.x or 0.0 for sv in points]
        knee = metrics.knee(xs, [sv.metrics["output_throughput"] for sv in points])
        for sv in points:
            out.points.append(SweepPoint("concurrency", "concurrent requests", sv.job.x or 0.0, sv.metrics))
        top = points[-1]
        extra = {"knee_concurrency": knee, "concurrency": top.job.x}
        out.entries.append(ResultEntry(top.trace, extra=extra, notes=[
            f"the storm at concurrency {top.job.x:g}; throughput stops rising at {knee:g}" if knee is not None
            else f"the storm at concurrency {top.job.x:g}"]))
        out.claims = storm_claims([sv.metrics for sv in points], [sv.trace for sv in points])
        return out


def storm_claims(sweep: Sequence[Mapping[str, float | None]], traces: Sequence[Trace]) -> dict[str, bool | None]:
    """Claims of a concurrency sweep, given each point's metrics (lowest concurrency first)."""
    low, top = sweep[0], sweep[-1]
    pre_low, pre_top = low["preemptions"], top["preemptions"]
    waste = [top.get("recomputed_tokens"), top.get("swap_outs")]
    waste_known = [w for w in waste if w is not None]
    return {
        "the lowest concurrency ran without preemption": None if pre_low is None else pre_low == 0,
        "the highest concurrency preempted (a storm)": _positive(pre_top),
        "preemptions grew with concurrency": None if pre_low is None or pre_top is None else pre_top > pre_low,
        "preempted work was recomputed or swapped": None if not waste_known else sum(waste_known) > 0,
        "every request finished at every point": all(all_finished(t) for t in traces),
    }


# --------------------------------------------------------------------------------------------
# 4. swap vs recompute crossover


@dataclass(frozen=True)
class CrossoverSize:
    lengths: tuple[int, ...]  # the victim's sequence length when it is preempted
    repeats: int
    holder_tokens: int = BLOCK_SIZE  # the holder's prompt fills whole blocks: its first decode needs a block
    holder_outputs: int = 12  # the holder decodes this long (within its second block) before it frees
    victim_outputs: int = 3  # decodes after the resume

    @property
    def num_gpu_blocks(self) -> list[int]:
        """Per length: the holder's block plus the victim's prompt blocks, not one spare."""
        return [1 + math.ceil((length - 1) / BLOCK_SIZE) for length in self.lengths]


class SwapVsRecompute(Scenario):
    name = "swap_vs_recompute"
    seed_doc = "000, 004"
    title = "Swap vs recompute crossover"
    description = (
        "What one preempt-and-resume costs, by the victim's sequence length L, in each mode (seeds 000 and 004: "
        "swap pays copies, recompute pays a prefill). Two requests: a holder (one full block of prompt) and a "
        "victim of L-1 prompt tokens, admitted together into a pool with no spare block, so the holder's first "
        "decode preempts the victim; the victim resumes when the holder finishes. cost_s = (step that preempted "
        "- decode step) + (step that resumed - decode step), from the driver's step times, each the minimum "
        "over repeats (noise only adds time); modes interleaved. Prefix caching and chunked prefill are off so "
        "that recompute redoes all L tokens. Claims: every run preempted and resumed the victim exactly once, "
        "in its mode.")
    needs = ("swap", "recompute", "events")
    knobs_needed = ("enable_chunked_prefill",)
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": CrossoverSize(lengths=(8, 16, 32, 64, 128, 256, 512, 1000), repeats=5),
        "full": CrossoverSize(lengths=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4000), repeats=5),
    }
    modes = ("recompute", "swap")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        jobs = []
        for length in s.lengths:
            check_crossover_length(length, s, model)
            victim_prompt = length - 1  # plus the token its prefill samples = L at preemption
            spec = WorkloadSpec(f"crossover-{length}", 2, Explicit((s.holder_tokens, victim_prompt)),
                                Explicit((s.holder_outputs, 1 + s.victim_outputs)), AllAtOnce(), seed=4)
            blocks = 1 + math.ceil(victim_prompt / BLOCK_SIZE)  # the holder's block and the victim's: none spare
            workload = _build(spec, model)
            for _ in range(s.repeats):
                for mode in self.modes:  # interleaved: drift in machine speed hits both modes alike
                    knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=blocks, preemption_mode=mode,
                                  num_cpu_blocks=blocks + 1 if mode == "swap" else 0,
                                  enable_prefix_caching=False, enable_chunked_prefill=False)
                    jobs.append(Job(workload, knobs, mode=mode, x=float(length)))
        return jobs

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "lengths": list(s.lengths), "repeats": s.repeats,
                "holder_tokens": s.holder_tokens, "holder_outputs": s.holder_outputs,
                "victim_outputs": s.victim_outputs}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        costs: dict[tuple[str, float], list[ResumeCost]] = {}
        bad: list[str] = []
        for sv in served:
            cost = resume_cost(sv.trace, VICTIM, sv.job.mode or "")
            if cost is None:
                bad.append(f"{sv.job.mode} at L={sv.job.x:g}")
            else:
                costs.setdefault((sv.job.mode or "", sv.job.x or 0.0), []).append(cost)
        for (mode, x), cs in sorted(costs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            out.points.append(SweepPoint("seq_len", "sequence length at preemption (tokens)", x,
                                         summarize_costs(cs), mode=mode))
        lengths = sorted({sv.job.x or 0.0 for sv in served})
        by_mode = {mode: {p.x: p.metrics["cost_s"] for p in out.points if p.mode == mode} for mode in self.modes}
        cross = metrics.crossover(lengths, [by_mode["swap"].get(x) for x in lengths],
                                  [by_mode["recompute"].get(x) for x in lengths])
        out.parameters["crossover_seq_len"] = cross
        if bad:
            out.notes.append("runs without exactly one preemption and resume of the victim: " + ", ".join(bad))
        out.claims = {
            "every run preempted the victim once, in its mode, and resumed it": not bad,
            "both modes measured at every length": all(x in by_mode[m] for m in self.modes for x in lengths),
        }
        return out


VICTIM = "r0001"  # the second request of a crossover workload (the first is the holder)


def check_crossover_length(length: int, size: CrossoverSize, model: Model) -> None:
    """A length must fit the model next to the holder, in one unchunked step."""
    need = length - 1 + size.holder_tokens
    if length < 2 or need > model.max_model_len or length + size.victim_outputs > model.max_model_len:
        raise ValueError(f"crossover length {length} does not fit: the victim's prompt ({length - 1}) plus the "
                         f"holder's ({size.holder_tokens}) must fit one step of max_model_len={model.max_model_len}")


@dataclass(frozen=True)
class ResumeCost:
    """One preempt-and-resume, read off a trace: the two steps it touched and the plain decode steps."""

    preempt_step_s: float  # swap: a decode plus the copy out; recompute: a decode (freeing is bookkeeping)
    resume_step_s: float  # swap: the copy in plus a decode; recompute: the prefill of all L tokens
    decode_step_s: float  # the fastest plain decode step of the run

    @property
    def cost_s(self) -> float:
        return self.preempt_step_s + self.resume_step_s - 2 * self.decode_step_s


def resume_cost(trace: Trace, victim: str, mode: str) -> ResumeCost | None:
    """The steps of one preempt-and-resume of ``victim``, or None unless the trace shows exactly one
    preemption of ``victim`` in ``mode`` followed by exactly one resume (and some plain decode steps:
    no prefill, no preemption, not the resume)."""
    r = trace.requests.get(victim)
    if r is None or len(r.preemptions) != 1 or len(r.resumes) != 1 or r.preemptions[0][1] != mode:
        return None
    t_pre, t_res = r.preemptions[0][0], r.resumes[0]
    if not t_pre < t_res:
        return None
    by_t = {s.t: s for s in trace.steps}
    pre, res = by_t.get(t_pre), by_t.get(t_res)
    decodes = [s.duration for s in trace.steps if s.num_prefill_tokens == 0 and s.num_preempted == 0
               and s.num_decode_tokens > 0 and s.t not in (t_pre, t_res)]
    if pre is None or res is None or not decodes:
        return None
    return ResumeCost(pre.duration, res.duration, min(decodes))


def summarize_costs(costs: Sequence[ResumeCost]) -> dict[str, float | None]:
    """A sweep point's metrics over repeats.

    ``cost_s`` (what the report plots) = fastest preempting step + fastest resuming step - 2 x
    fastest decode step, each the minimum over all repeats: on a shared machine timing noise only
    ever adds time (``timeit``'s argument for the minimum), so minima compare like with like. The
    median of the per-run costs is kept as ``cost_median_s``.
    """
    pre, res = min(c.preempt_step_s for c in costs), min(c.resume_step_s for c in costs)
    decode = min(c.decode_step_s for c in costs)
    return {"cost_s": pre + res - 2 * decode, "cost_median_s": float(np.median([c.cost_s for c in costs])),
            "preempt_extra_s": pre - decode, "resume_extra_s": res - decode, "decode_step_s": decode,
            "repeats": float(len(costs))}


# --------------------------------------------------------------------------------------------
# 5. prefix caching and recompute (seed 004, section 3.4)


@dataclass(frozen=True)
class PrefixSize:
    spec: WorkloadSpec  # shared system prompt, closed loop past capacity
    num_gpu_blocks: int


class PrefixCachingRecompute(Scenario):
    name = "prefix_caching_recompute"
    seed_doc = "004"
    title = "Prefix caching and recompute"
    description = ("Every request starts with the same system prompt; closed-loop concurrency past capacity, "
                   "preemption by recompute, with and without prefix caching (seed 004, 3.4: a recompute that "
                   "hits the cached prefix only redoes the tail). Claims: without caching the "
                   "engine preempted and recomputed; with caching the shared prompt hit the cache and fewer tokens "
                   "were recomputed (caching also shrinks what each request holds, so it may preempt less).")
    needs = ("prefix_caching", "recompute")
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": PrefixSize(WorkloadSpec("prefix", 32, Uniform(32, 96), Fixed(64), ClosedLoop(12),
                                         shared_prefix=SharedPrefix(1, 256), seed=5), num_gpu_blocks=96),
        "full": PrefixSize(WorkloadSpec("prefix", 96, Uniform(64, 256), Fixed(256), ClosedLoop(24),
                                        shared_prefix=SharedPrefix(1, 1024), seed=5), num_gpu_blocks=512),
    }
    modes = ("no_prefix_caching", "prefix_caching")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = _build(s.spec, model)
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks, preemption_mode="recompute",
                                    enable_prefix_caching=mode == "prefix_caching"), mode=mode)
                for mode in self.modes]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "workload": describe_spec(s.spec), "preemption_mode": "recompute"}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        by_mode = {sv.job.mode: sv for sv in served}
        off, on = by_mode["no_prefix_caching"].metrics, by_mode["prefix_caching"].metrics
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode))
        out.claims = prefix_claims(off, on)
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        if off["recomputed_tokens"] and on["recomputed_tokens"] is not None:
            out.notes.append(f"prefix caching recomputed {on['recomputed_tokens']:,.0f} tokens against "
                             f"{off['recomputed_tokens']:,.0f} without "
                             f"({1 - on['recomputed_tokens'] / off['recomputed_tokens']:.0%} fewer)")
        return out


def prefix_claims(off: Mapping[str, float | None], on: Mapping[str, float | None]) -> dict[str, bool | None]:
    """Claims of the prefix-caching scenario from the metrics without (``off``) and with (``on``) caching."""
    rec_off, rec_on = off.get("recomputed_tokens"), on.get("recomputed_tokens")
    return {
        "without caching, the closed loop went past capacity (preemptions)": _positive(off["preemptions"]),
        "without caching, preempted work was recomputed": _positive(rec_off),
        "with caching, the shared prompt hit the cache": _positive(on.get("prefix_cache_hits")),
        "caching recomputed fewer tokens": None if rec_off is None or rec_on is None else rec_on < rec_off,
    }


# --------------------------------------------------------------------------------------------
# 6. chunked prefill and decode stalls (seeds 000 and 004, section 3.3)


@dataclass(frozen=True)
class ChunkedSize:
    decoders: WorkloadSpec  # short prompts, long outputs, at t=0
    long_prompts: WorkloadSpec  # long prompts arriving while the decoders run
    long_start_s: float
    budgets: tuple[int, int]  # (the ITL budget, the throughput budget) in tokens per step
    num_gpu_blocks: int
    budget_note: str = ""


class ChunkedPrefillStalls(Scenario):
    name = "chunked_prefill_stalls"
    seed_doc = "000, 004"
    title = "Chunked prefill and decode stalls"
    description = ("Requests decoding while long prompts arrive. Unchunked, a long prefill takes a whole step and "
                   "every decode waits for it (a TBT spike); chunked, the prefill is split under a token budget "
                   "and decodes ride along every step (seed 000: 512 tokens favours inter-token latency, 2048 and "
                   "up throughput). Modes: unchunked, chunked (the small budget), chunked_large (the large one). "
                   "No preemption: the pool is roomy. Claims: unchunked prefilled a long prompt in one step "
                   "beside decodes; chunked split the long prompts and kept every step within its budget.")
    needs = ("chunked_prefill",)
    knobs_needed = ("enable_chunked_prefill",)  # off, for the unchunked mode
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": ChunkedSize(
            decoders=WorkloadSpec("decoders", 6, Uniform(16, 32), Fixed(400), AllAtOnce(), seed=6),
            long_prompts=WorkloadSpec("long", 6, Uniform(704, 832), Fixed(4), Poisson(8.0), seed=7),
            long_start_s=0.1, budgets=(128, 512), num_gpu_blocks=512,
            budget_note="512 and 2048 at full scale (3,072-token prompts) scaled by 1/4 to the tiny model's "
                        "768-token prompts: 128 and 512"),
        "full": ChunkedSize(
            decoders=WorkloadSpec("decoders", 16, Uniform(64, 128), Fixed(1000), AllAtOnce(), seed=6),
            long_prompts=WorkloadSpec("long", 8, Uniform(2816, 3328), Fixed(8), Poisson(2.0), seed=7),
            long_start_s=1.0, budgets=(512, 2048), num_gpu_blocks=2048,
            budget_note="512 (vLLM's chunked-prefill default, tuned for ITL) and 2048 (its advice for throughput)"),
    }
    modes = ("unchunked", "chunked", "chunked_large")

    def budget_of(self, mode: str, scale: str) -> int | None:
        small, large = self.size(scale).budgets
        return {"unchunked": None, "chunked": small, "chunked_large": large}[mode]

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = combine(self.name, _build(s.decoders, model), _build(s.long_prompts, model).shifted(s.long_start_s))
        jobs = []
        for mode in self.modes:
            budget = self.budget_of(mode, scale)
            jobs.append(Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks,
                                            enable_chunked_prefill=budget is not None, max_num_batched_tokens=budget,
                                            enable_prefix_caching=False), mode=mode))
        return jobs

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "decoders": describe_spec(s.decoders),
                "long_prompts": describe_spec(s.long_prompts), "budget_chunked": s.budgets[0],
                "budget_chunked_large": s.budgets[1], "budgets_note": s.budget_note}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        s = self.size(scale)
        out = self.outcome(scale, model)
        long_from = s.long_prompts.input_len.bounds()[0]
        by_mode = {sv.job.mode: sv for sv in served}
        for sv in served:
            budget = self.budget_of(sv.job.mode or "", scale)
            steps = sv.trace.steps
            extra = {"budget": float(budget) if budget else None,
                     "max_step_tokens": float(max((st.num_prefill_tokens + st.num_decode_tokens for st in steps),
                                                  default=0)),
                     "stall_steps": float(len(stall_steps(sv.trace, long_from)))}
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra=extra))
        out.claims = chunked_claims(by_mode["unchunked"].trace,
                                    {self.budget_of(m, scale) or 0: by_mode[m].trace for m in self.modes[1:]},
                                    long_from)
        out.claims["no preemption muddied the comparison"] = all(
            sv.metrics["preemptions"] in (0, None) for sv in served)
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out


def stall_steps(trace: Trace, long_from: int) -> list[int]:
    """Indexes of steps that prefilled at least ``long_from`` tokens while other requests decoded."""
    return [i for i, s in enumerate(trace.steps) if s.num_prefill_tokens >= long_from and s.num_decode_tokens > 0]


def chunked_claims(unchunked: Trace, chunked: Mapping[int, Trace], long_from: int) -> dict[str, bool | None]:
    """Claims from the unchunked run and the chunked runs by budget (steps must carry token counts)."""
    claims: dict[str, bool | None] = {
        "unchunked: a long prompt was prefilled in one step beside decodes": bool(stall_steps(unchunked, long_from)),
    }
    for budget, trace in chunked.items():
        chunks = trace.counters.get("prefill_chunks")
        claims[f"budget {budget}: long prompts were split into chunks"] = (
            None if chunks is None else chunks > 0)
        claims[f"budget {budget}: no step went over the budget"] = bool(trace.steps) and all(
            s.num_prefill_tokens + s.num_decode_tokens <= budget for s in trace.steps)
        claims[f"budget {budget}: prefill chunks rode along with decodes"] = any(
            s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in trace.steps)
    return claims


# --------------------------------------------------------------------------------------------
# 7. priority: online traffic beside offline batch work (seed 001)


@dataclass(frozen=True)
class PrioritySize:
    offline: WorkloadSpec  # priority 1, all at t=0: a batch job that fills the pool
    online: WorkloadSpec  # priority 0, Poisson arrivals while the batch runs
    online_start_s: float
    num_gpu_blocks: int


HIGH, LOW = 0, 1  # vLLM's convention: lower is more important


class PriorityOnlineOffline(Scenario):
    name = "priority_online_offline"
    seed_doc = "001"
    title = "Priority: online beside offline"
    description = ("A batch of offline work (priority 1) fills the pool; online requests (priority 0) arrive while "
                   "it runs (seed 001: preemption as the means of fairness). Modes: the priority policy, and FCFS "
                   "as the control. Figures: TTFT of each class. Claims: under the priority policy online "
                   "traffic preempted offline work and no online request was preempted for offline work; every "
                   "request finished.")
    needs = ("priority",)
    knobs_needed = ("scheduling_policy",)
    sizes = {  # noqa: RUF012
        "quick": PrioritySize(
            offline=WorkloadSpec("offline", 16, Uniform(192, 320), Fixed(128), AllAtOnce(),
                                 priorities=Priorities((LOW,), (1.0,)), seed=8),
            online=WorkloadSpec("online", 20, Uniform(32, 96), Fixed(32), Poisson(5.0),
                                priorities=Priorities((HIGH,), (1.0,)), seed=9),
            online_start_s=0.3, num_gpu_blocks=96),
        "full": PrioritySize(
            offline=WorkloadSpec("offline", 64, Uniform(1024, 2048), Fixed(512), AllAtOnce(),
                                 priorities=Priorities((LOW,), (1.0,)), seed=8),
            online=WorkloadSpec("online", 120, Uniform(64, 256), Fixed(128), Poisson(2.0),
                                priorities=Priorities((HIGH,), (1.0,)), seed=9),
            online_start_s=5.0, num_gpu_blocks=1024),
    }
    modes = ("priority", "fcfs")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = combine(self.name, _build(s.offline, model), _build(s.online, model).shifted(s.online_start_s))
        return [Job(workload, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=s.num_gpu_blocks, scheduling_policy=mode),
                    mode=mode) for mode in self.modes]

    def parameters(self, scale: str, model: Model) -> dict[str, Any]:
        s = self.size(scale)
        return {**super().parameters(scale, model), "offline": describe_spec(s.offline),
                "online": describe_spec(s.online), "online_start_s": s.online_start_s}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        out = self.outcome(scale, model)
        for sv in served:
            out.entries.append(ResultEntry(sv.trace, mode=sv.job.mode, extra=class_figures(sv.trace)))
        prio = next(sv for sv in served if sv.job.mode == "priority")
        out.claims = priority_claims(prio.trace)
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out


def class_figures(trace: Trace) -> dict[str, float | None]:
    """TTFT percentiles and preemptions of each priority class, and the high/low TTFT ratio."""
    out: dict[str, float | None] = {}
    for name, level in (("high", HIGH), ("low", LOW)):
        ttfts = ttft_by(trace, lambda r, level=level: r.priority == level)
        out[f"ttft_p50_{name}"] = _pct(ttfts, 50)
        out[f"ttft_p99_{name}"] = _pct(ttfts, 99)
        out[f"preemptions_{name}"] = float(sum(len(r.preemptions) for r in trace.requests.values()
                                               if r.priority == level))
    hi, lo = out["ttft_p50_high"], out["ttft_p50_low"]
    out["ttft_p50_high_over_low"] = hi / lo if hi is not None and lo else None
    return out


def priority_claims(trace: Trace) -> dict[str, bool | None]:
    """Claims of the priority-policy run (per-request preemption records required)."""
    if "preemptions" in trace.not_exposed or "events" in trace.not_exposed:
        return {"online traffic preempted offline work": None,
                "no online request was preempted while offline work ran": None}
    low = [t for r in trace.requests.values() if r.priority == LOW for t, _ in r.preemptions]
    high = [t for r in trace.requests.values() if r.priority == HIGH for t, _ in r.preemptions]
    return {"online traffic preempted offline work": bool(low),
            # A high-priority victim is legitimate only when nothing of low priority was left running.
            "no online request was preempted while offline work ran": not any(
                any(_running_at(r, t) for r in trace.requests.values() if r.priority == LOW) for t in high)}


def _running_at(r: Any, t: float) -> bool:
    """Whether request ``r`` held the engine at ``t``: admitted, not finished, not preempted then."""
    if r.admitted is None or r.admitted > t or (r.finished is not None and r.finished <= t):
        return False
    out_since = [p for p, _ in r.preemptions if p <= t]
    back_since = [x for x in r.resumes if x <= t]
    return len(back_since) >= len(out_since)


# --------------------------------------------------------------------------------------------
# 8. swap-space exhaustion (seeds 001 and 004)


@dataclass(frozen=True)
class ExhaustionSize:
    spec: WorkloadSpec  # closed loop past capacity
    num_gpu_blocks: int
    ample_cpu_blocks: int
    small_cpu_blocks: int  # a quarter of the device pool: room for two or three victims


class SwapSpaceExhaustion(Scenario):
    name = "swap_space_exhaustion"
    seed_doc = "001, 004"
    title = "Swap-space exhaustion"
    description = ("A preemption storm in swap mode with the host (swap) pool ample, then too small (seed 001: "
                   "when swap space runs out the scheduler falls back to recompute, and the preemption pattern "
                   "changes abruptly). The moment of the first fallback and the swaps before it are reported. "
                   "Claims: ample, it swapped and never fell back; too small, it swapped first, then fell back.")
    needs = ("swap",)
    engine_mode_matters = False
    sizes = {  # noqa: RUF012
        "quick": ExhaustionSize(WorkloadSpec("exhaustion", 24, Uniform(64, 192), Fixed(128), ClosedLoop(16), seed=10),
                                num_gpu_blocks=96, ample_cpu_blocks=1024, small_cpu_blocks=24),
        "full": ExhaustionSize(WorkloadSpec("exhaustion", 96, Uniform(256, 768), Fixed(512), ClosedLoop(32), seed=10),
                               num_gpu_blocks=512, ample_cpu_blocks=8192, small_cpu_blocks=128),
    }
    modes = ("ample_swap_space", "exhausted_swap_space")

    def plan(self, scale: str, model: Model) -> list[Job]:
        s = self.size(scale)
        workload = _build(s.spec, model)
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
        out.claims = exhaustion_claims(by_mode["ample_swap_space"].metrics, by_mode["exhausted_swap_space"].metrics)
        out.claims["every request finished"] = all(all_finished(sv.trace) for sv in served)
        return out


def first_fallback(trace: Trace) -> dict[str, float | None]:
    """When swap first fell back to recompute in a swap-mode run (its first recompute preemption),
    how many swaps came before, and how full the host pool was just before it."""
    marks = sorted((t, mode) for r in trace.requests.values() for t, mode in r.preemptions)
    t_first = next((t for t, mode in marks if mode == "recompute"), None)
    if t_first is None:
        return {"first_fallback_s": None, "swaps_before_first_fallback": float(len(marks)),
                "cpu_kv_usage_at_first_fallback": None}
    usage = [s.cpu_kv_usage for s in trace.steps if s.t < t_first and s.cpu_kv_usage is not None]
    return {"first_fallback_s": t_first, "swaps_before_first_fallback": float(sum(1 for t, m in marks
                                                                                  if m == "swap" and t < t_first)),
            "cpu_kv_usage_at_first_fallback": usage[-1] if usage else None}


def exhaustion_claims(ample: Mapping[str, float | None], small: Mapping[str, float | None]) -> dict[str, bool | None]:
    fb_ample, fb_small = ample.get("swap_fallbacks"), small.get("swap_fallbacks")
    return {
        "ample host pool: preempted by swap": _positive(ample.get("preemptions_swap")),
        "ample host pool: never fell back to recompute": None if fb_ample is None else fb_ample == 0,
        "small host pool: swapped before it ran out": _positive(small.get("preemptions_swap")),
        "small host pool: swap fell back to recompute": _positive(fb_small),
    }


# --------------------------------------------------------------------------------------------
# the registry

EVENING_SURGE = EveningSurge()
FLASH_CROWD = FlashCrowd()
PREEMPTION_STORM = PreemptionStorm()
SWAP_VS_RECOMPUTE = SwapVsRecompute()
PREFIX_CACHING = PrefixCachingRecompute()
CHUNKED_PREFILL = ChunkedPrefillStalls()
PRIORITY = PriorityOnlineOffline()
SWAP_EXHAUSTION = SwapSpaceExhaustion()

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    EVENING_SURGE, FLASH_CROWD, PREEMPTION_STORM, SWAP_VS_RECOMPUTE, PREFIX_CACHING, CHUNKED_PREFILL, PRIORITY,
    SWAP_EXHAUSTION)}
