"""The machinery every scenario shares: models, jobs, outcomes, the Scenario base class, serving,
recording into results, and the claims more than one scenario makes (see :mod:`kvbench.bench.scenarios`)."""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.bench import metrics, repeats, sampler_cost
from kvbench.bench.job_settings import distinct, job_settings
from kvbench.bench.matched_knobs import stated
from kvbench.bench.scenarios.declare import Headline, Pressure, Score
from kvbench.bench.workloads import (
    AllAtOnce,
    ClosedLoop,
    Explicit,
    Fixed,
    Poisson,
    StepSurge,
    Uniform,
    Workload,
    WorkloadSpec,
)
from kvbench.core import delivery
from kvbench.core.jsonable import jsonable
from kvbench.core.kv_budget import request_tokens
from kvbench.core.trace import Trace, TraceRecorder
from kvbench.drivers.lockstep import serve_lockstep
from kvbench.drivers.step_loop import workload_clock
from kvbench.engines.base import EngineAdapter, Knobs

SCALES = ("quick", "full")
#: virtual seconds per engine step on the step clock, by scale: about one decode step of the scale's
#: model on a 2-core CPU (docs/journal/measurements.md#step-costs-behind-the-scenario-sizes), so open-loop rates mean
#: what they say
STEP_SECONDS = {"quick": 0.01, "full": 0.1}
BLOCK_SIZE = 16
#: the built-in checkpoint each scale runs on when ``--kvbench-model`` is not given
MODEL_PRESETS = {"quick": "tiny", "full": "small"}
#: KV usage above which a pool counts as filled: the pool is near its limit, new blocks come only from
#: preempting or finishing a request
FULL_POOL = 0.9
#: arrival-rate ratio from which a step surge counts as "traffic doubled" (Poisson noise allowed)
DOUBLED = 1.6

Progress = Callable[[int], None]
#: the claim every scenario makes besides its own ("every request finished", "... at every point")
SANITY_CLAIM = "every request finished"


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
    #: what the engine itself said it ran the job with (:meth:`EngineAdapter.confirmed_settings`), read right
    #: after the job for a scenario that ``reads_settings``; empty otherwise
    settings: dict[str, Any] = field(default_factory=dict)
    #: what the job ran with, as results record it (:func:`kvbench.bench.job_settings.job_settings`: the knobs the
    #: adapter received, what the engine confirms, a server's launch command, the engine's version)
    ran_with: dict[str, Any] = field(default_factory=dict)

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
    #: why a claim left None could not be decided, where the judge knows better than UNDECIDED_REASON
    undecided_reasons: dict[str, str] = field(default_factory=dict)
    #: which way each undecided claim stayed open (:data:`kvbench.bench.scenarios.claims.KINDS`)
    undecided_kinds: dict[str, str] = field(default_factory=dict)
    #: the evidence each decided claim was decided on, in words, where its judge says (results: ``claim_evidence``)
    claim_evidence: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the judged outcomes of every repeat, this one first; their entries and points line up
    #: index by index with this one's (same plan, same judge). Filled in by :func:`run`.
    repeats: list[Outcome] = field(default_factory=list, repr=False)
    #: virtual seconds per step when the runs were on the step clock, None on the wall clock
    step_seconds: float | None = None
    #: the engines whose repeats were served in the same rounds as this one's (this one among them;
    #: empty when it ran alone): repeat i of each was measured next to repeat i of the others
    interleaved: tuple[str, ...] = ()
    #: each entry's trace (by ``id``) -> :func:`job_key` of the job that served it. Filled in by :func:`run`
    job_keys: dict[int, str] = field(default_factory=dict, repr=False)
    #: the machine's 1-minute load average when this repeat's round began (None where the OS has none):
    #: repeats served back to back share it, measurements minutes apart may not (recorded per repeat)
    machine_load: float | None = None
    #: (entry trace ``id``, job mode, :attr:`Served.ran_with`) of every job served. Filled in by :func:`run`
    ran_with: list[tuple[int, str | None, dict[str, Any]]] = field(default_factory=list, repr=False)

    def failures(self) -> list[str]:
        return [claim for claim, held in self.claims.items() if held is False]

    def undecided_reason(self) -> str | None:
        """Why no claim about the scenario's mechanism could be decided (every one None), or None when
        at least one was: such a benchmark proves nothing and is skipped with this reason. "Every
        request finished" is a sanity claim any engine can show; alone it does not make a benchmark."""
        about = {c: v for c, v in self.claims.items() if not c.startswith(SANITY_CLAIM)}
        if not about or any(v is not None for v in about.values()):
            return None
        return (f"{self.scenario.name}: every claim is undecidable on this engine (it does not expose what they "
                "need): " + "; ".join(about))

    def explain(self) -> str:
        lines = [f"{self.scenario.name} ({self.scale}): claims not shown:"]
        lines += [f"  - {c}" + (f": {self.claim_evidence[c]}" if c in self.claim_evidence else "")
                  for c in self.failures()]
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
    #: the doc section a reader opens for the scenario (recorded in its parameters as ``doc``)
    doc: str = "docs/benchmarks.md#scenarios"
    title: str = ""
    description: str = ""
    needs: tuple[str, ...] = ()
    knobs_needed: tuple[str, ...] = ()
    engine_mode_matters: bool = True
    sizes: Mapping[str, Any] = {}  # scale -> size; read-only, set by subclasses
    #: what the report reads (see :mod:`~kvbench.bench.scenarios.declare`): the pressure created on
    #: purpose, the metric the scoreboard ranks engines by (None: no ranking, e.g. one engine's modes)
    pressure: Pressure = Pressure()
    score: Score | None = Score("output_throughput", True, label="output throughput")
    #: True: each job's :attr:`Served.settings` holds what the engine confirms it ran with (a claim proven from
    #: outside, as chunked prefill's split from the budget the server states)
    reads_settings: bool = False

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
                "num_gpu_blocks": size.num_gpu_blocks, "doc": self.doc}

    def judge(self, served: list[Served], scale: str, model: Model) -> Outcome:
        raise NotImplementedError

    def num_requests(self, scale: str, model: Model) -> int:
        """How many requests ``plan`` serves in all (a progress bar's total)."""
        return sum(len(job.workload) for job in self.plan(scale, model))

    def outcome(self, scale: str, model: Model) -> Outcome:
        return Outcome(self, scale, self.parameters(scale, model))

    # -- what the report reads: plain dicts of a results file in, plain values out ------------------

    def headline(self, recorded: Mapping[str, Any], reference: str | None) -> Headline:
        """This scenario's card on the first screen, from its recorded results-file entry."""
        return Headline(self.title or self.name, None, "this scenario declares no headline")

    def tables(self, recorded: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Tables that make the scenario's point (``{"title", "columns", "rows", "note"}``; cells are
        strings), shown under its description."""
        return []


def build_workload(spec: WorkloadSpec, model: Model) -> Workload:
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


def serve(adapter: EngineAdapter, job: Job, scenario: str, progress: Progress | None = None,
          step_seconds: float | None = None, recorder: TraceRecorder | None = None,
          settings: dict[str, Any] | None = None, ran_with: dict[str, Any] | None = None) -> Trace:
    """Serve one job and return its trace, its duration ending at the last token or finish.

    ``step_seconds``: serve on the step clock (:mod:`kvbench.drivers.step_loop`) when the adapter is
    ``steppable``; ignored (wall clock) otherwise. Progress is reported per finished request when
    the adapter can (``serve(progress=...)``), else all at once when the workload is done.
    ``recorder``: record into this one (a lockstep participant's, :mod:`kvbench.drivers.lockstep`)
    instead of a new one. ``settings``: filled with what the engine confirms it ran this job with. ``ran_with``:
    filled with the job's settings record (:func:`kvbench.bench.job_settings.job_settings`; never raises).
    """
    recorder = recorder if recorder is not None else TraceRecorder(adapter.name, scenario)
    # the scenario's pools are in the reference engine's blocks: the same pressure, in tokens, in this
    # engine's terms (e.g. vLLM's CPU build takes blocks of 32 only)
    job = replace(job, knobs=adapter.engine_knobs(
        job.knobs, [request_tokens(len(r.prompt_token_ids), r.max_tokens) for r in job.workload.requests]))
    # and the behaviour the scenario leaves unset stated the same on every engine (kvbench.bench.matched_knobs)
    job = replace(job, knobs=stated(job.knobs, adapter))
    kwargs: dict[str, Any] = {}
    if step_seconds is not None and getattr(adapter, "steppable", False):
        kwargs["step_seconds"] = step_seconds
    if progress is not None and _accepts_progress(adapter):
        adapter.serve(job.workload, recorder, job.knobs, progress=progress, **kwargs)  # type: ignore[call-arg]
    else:
        adapter.serve(job.workload, recorder, job.knobs, **kwargs)  # type: ignore[call-arg]
        if progress is not None:
            progress(len(job.workload))
    trace = recorder.finish()
    trace.duration = last_event(trace) or trace.duration
    if settings is not None:  # asked right after the run, with the knobs it ran with (a server keeps them)
        settings.update(adapter.confirmed_settings(job.knobs))
    if ran_with is not None:  # the knobs as the adapter's entry point hands them on (knobs_for)
        ran_with.update(job_settings(adapter, adapter.knobs_for(job.knobs)))
    return trace


def _server(adapter: EngineAdapter, job: Job, scenario: str, progress: Progress | None,
            step_seconds: float | None, ran_with: dict[str, Any] | None = None) -> Callable[[TraceRecorder], None]:
    """``serve`` of one job as a lockstep participant: into the recorder it is given."""
    def run(recorder: TraceRecorder) -> None:
        serve(adapter, job, scenario, progress, step_seconds, recorder=recorder, ran_with=ran_with)

    return run


def _ended(trace: Trace) -> Trace:
    trace.duration = last_event(trace) or trace.duration
    return trace


def last_event(trace: Trace) -> float:
    """The time of the last token, finish or step of a trace (0 for an empty one)."""
    times = [t for r in trace.requests.values() for t in (*r.token_times[-1:], r.finished or 0.0)]
    times += [s.t for s in trace.steps[-1:]]
    return max(times, default=0.0)


def run(scenario: Scenario, adapter: EngineAdapter, model: Model, scale: str,
        progress: Progress | None = None, repeats: int = 1, step_seconds: float | None = None) -> Outcome:
    """Serve every job of ``scenario.plan`` on ``adapter`` in order, ``repeats`` times over, judging
    each repeat; returns the first repeat's outcome with all of them in ``outcome.repeats``.

    ``step_seconds`` puts a ``steppable`` adapter on the step clock (identical counts every repeat,
    wall-clock timings); other adapters run on the wall clock. Raises ValueError for ``repeats < 1``,
    and whatever serving or judging raised. :func:`run_interleaved` serves several engines.
    """
    result = run_interleaved(scenario, {adapter.name: adapter}, model, scale, progress, repeats, step_seconds)
    outcome = result[adapter.name]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def run_interleaved(scenario: Scenario, adapters: Mapping[str, EngineAdapter], model: Model, scale: str,
                    progress: Progress | None = None, repeats: int = 1,
                    step_seconds: float | None = None) -> dict[str, Outcome | Exception]:
    """Serve ``scenario`` on every adapter (by engine name), ``repeats`` rounds, interleaved by job.

    Schedule: round ``r`` serves job 1 on every engine, then job 2 on every engine, and so on;
    round ``r + 1`` starts only when round ``r`` is done. Within a job, the ``steppable`` engines
    (two or more) are served in lockstep, one engine step of each in turn, each timed on its own
    clock (:mod:`kvbench.drivers.lockstep`); the others one after another, in the mapping's order.
    So repeat ``r`` of one engine and repeat ``r`` of another were measured under the same load
    (milliseconds apart in lockstep, seconds apart otherwise), and their ratio (what the gate
    compares, :mod:`kvbench.bench.gate`) cancels a machine that got busier or quieter over the
    minutes a benchmark takes. Serving all of one engine's repeats before the other's did not: a
    self-gated run moved a p99 TTFT ratio from 0.73 to 1.19 that way. The order is the same every
    round and every run, so whatever it favours, it favours the baseline alike.

    Each engine's repeats are judged separately; its value is its first repeat's :class:`Outcome`
    with all of them in ``outcome.repeats`` (``outcome.interleaved`` names every engine served in
    the same rounds), or the exception serving or judging it raised: that engine is dropped from
    later rounds and the others go on, so one broken engine fails only its own benchmark.
    Raises ValueError for ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    clocks = {name: step_seconds if getattr(a, "steppable", False) else None for name, a in adapters.items()}
    judged: dict[str, list[Outcome]] = {name: [] for name in adapters}
    failed: dict[str, Exception] = {}
    for _ in range(repeats):
        load = machine_load()
        live = [name for name in adapters if name not in failed]
        plans = {name: scenario.plan(scale, model) for name in live}  # fresh workloads for every serve
        served: dict[str, list[Served]] = {name: [] for name in live}
        for j in range(max((len(plan) for plan in plans.values()), default=0)):
            now = [name for name in live if name not in failed and j < len(plans[name])]
            stepped = [name for name in now if getattr(adapters[name], "steppable", False)]
            lockstep = stepped if len(stepped) > 1 else []
            if lockstep:
                ran: dict[str, dict[str, Any]] = {name: {} for name in lockstep}
                traces = serve_lockstep({name: (adapters[name].name, scenario.name, _server(
                    adapters[name], plans[name][j], scenario.name, progress, clocks[name], ran[name]))
                    for name in lockstep})
                for name in lockstep:
                    trace = traces[name]
                    if isinstance(trace, Exception):
                        failed[name] = trace
                    else:
                        served[name].append(Served(plans[name][j], _ended(trace), ran_with=ran[name]))
            for name in (n for n in now if n not in lockstep):
                job = plans[name][j]
                said: dict[str, Any] | None = {} if scenario.reads_settings else None
                ran_with: dict[str, Any] = {}
                try:
                    served[name].append(Served(job, serve(adapters[name], job, scenario.name, progress,
                                                          clocks[name], settings=said, ran_with=ran_with),
                                               settings=said or {}, ran_with=ran_with))
                except Exception as e:  # handed to that engine's benchmark, which raises it
                    failed[name] = e
        for name in live:
            if name in failed:
                continue
            try:
                outcome = scenario.judge(served[name], scale, model)
            except Exception as e:  # as above
                failed[name] = e
                continue
            say_why_unfinished(outcome)
            outcome.job_keys = {id(s.trace): job_key(s.job, adapters[name]) for s in served[name]}
            outcome.machine_load = load
            outcome.ran_with = [(id(s.trace), s.job.mode, s.ran_with) for s in served[name]]
            judged[name].append(outcome)
    together = tuple(adapters) if len(adapters) > 1 else ()
    result: dict[str, Outcome | Exception] = {}
    for name in adapters:
        if name in failed:
            result[name] = failed[name]
            continue
        first = judged[name][0]
        first.repeats, first.step_seconds, first.interleaved = judged[name], clocks[name], together
        result[name] = first
    return result


def machine_load() -> float | None:
    """The machine's 1-minute load average (None where the OS does not report one)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def job_key(job: Job, adapter: EngineAdapter | None = None) -> str:
    """A short fingerprint of what a job serves: every request (tokens, lengths, arrival, abort, priority,
    sampling) and the settings: the adapter's effective engine configuration where it offers one
    (``engine_config(knobs)``: a knob left unset and one set to the engine's default then agree), else the
    knobs. Two results of one engine with the same key served an identical workload under identical
    settings, wherever in a run they were measured: what they differ by is the measurement's own noise
    (:func:`kvbench.bench.repeats.identical_schedule_drift`)."""
    import contextlib
    import dataclasses
    import hashlib

    settings: Any = job.knobs.as_dict()
    config = getattr(adapter, "engine_config", None)
    if callable(config):
        # an adapter whose config cannot be built here keeps its knobs: they say enough
        with contextlib.suppress(Exception):
            settings = dataclasses.asdict(config(job.knobs))
    w = job.workload
    payload = {"concurrency": w.concurrency, "settings": settings,
               "requests": [[r.prompt_token_ids, r.max_tokens, round(r.arrival_time, 6), r.priority, r.abort_at,
                             r.temperature, r.seed] for r in w.requests]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: why a claim left None is undecided: the scenario's judge could not tell from what the engine exposes (its
#: notes say more where a scenario knows more, e.g. a mechanism that did not fire)
UNDECIDED_REASON = "the engine does not expose what it takes to tell, or the mechanism did not fire"


def record(outcome: Outcome, results: Any, engine: Mapping[str, Any] | str,
           slos: str | Mapping[str, float] | None = None) -> None:
    """Add an outcome to a :class:`~kvbench.bench.results.Results`: one entry per result (summary +
    the judge's extra figures + timelines), every sweep point, and the claims as checks.
    Claims the engine could not show (None) are ``undecided``, each with its reason, never checks (never passed)."""
    checks = {c: bool(v) for c, v in outcome.claims.items() if v is not None}
    undecided = {c: outcome.undecided_reasons.get(c, UNDECIDED_REASON) for c, v in outcome.claims.items() if v is None}
    params = {**outcome.parameters}
    runs = outcome.repeats or [outcome]
    clock = {"clock": "wall" if outcome.step_seconds is None else "step", "step_seconds": outcome.step_seconds,
             "interleaved": list(outcome.interleaved)}
    for j, entry in enumerate(outcome.entries):
        # each repeat's machine load beside its figures: what two measurements of one workload minutes apart
        # differ by is mostly the shared machine's load (docs/benchmarks.md#noise)
        per_repeat = [{**metrics.summarize(o.entries[j].trace, slos), **o.entries[j].extra,
                       **({"machine_load_1min": o.machine_load} if o.machine_load is not None else {})}
                      for o in runs]
        medians, spreads = repeats.aggregate(per_repeat)
        notes = [*entry.notes, *outcome.notes]
        exact = outcome.step_seconds is not None
        if exact and (moved := repeats.differing(per_repeat, [k for k in medians if repeats.is_count(k)])):
            # the step clock makes a deterministic engine's counts repeat; these did not
            exact = False
            notes.append(f"counts differed between step-clock repeats (gated with statistics): {', '.join(moved)}")
        added = results.add_scenario_result(outcome.scenario.name, engine, medians,
                                            series=metrics.series(entry.trace),
                                            checks=checks, undecided=undecided, notes=notes, mode=entry.mode,
                                            parameters=params, description=outcome.scenario.description,
                                            repeats=per_repeat, spread=spreads, clock={**clock, "exact_counts": exact},
                                            undecided_kinds={c: outcome.undecided_kinds[c] for c in undecided
                                                             if c in outcome.undecided_kinds},
                                            claim_evidence={c: e for c, e in outcome.claim_evidence.items()
                                                            if c in checks},
                                            counters=entry.trace.counters)  # the first repeat's, as the series
        if (how := delivery.of_traces(o.entries[j].trace for o in runs)) is not None:
            added["delivery"] = how  # how tokens reached the client, every repeat pooled (kvbench.core.delivery)
        # what kvbench's own /metrics sampler cost this engine's streams (kvbench.bench.sampler_cost)
        added["sampler_cost"] = sampler_cost.of_traces(o.entries[j].trace for o in runs)
        if (key := outcome.job_keys.get(id(entry.trace))) is not None:
            added["workload_key"] = key  # identical workloads found across scenarios: the noise they show
        if ran := next((r for t, _, r in outcome.ran_with if t == id(entry.trace) and r), None):
            added["settings"] = jsonable(ran)  # what this entry's job ran with (kvbench.bench.job_settings)
    # the declared pressure travels with the results, so a report of this file can judge against it
    recorded = results.scenario(outcome.scenario.name, create=True, parameters=params,
                                description=outcome.scenario.description)
    recorded["pressure"] = outcome.scenario.pressure.to_dict()
    if outcome.ran_with:  # every distinct knob set this engine ran here once (a sweep's jobs share theirs)
        name = results.add_engine(engine)["name"]
        recorded["settings"] = [s for s in recorded.get("settings", []) if s.get("engine") != name] + [
            {"engine": name, **jsonable(s)} for s in distinct((mode, r) for _, mode, r in outcome.ran_with)]
    for j, p in enumerate(outcome.points):
        per_repeat = [dict(o.points[j].metrics) for o in runs]
        medians, spreads = repeats.aggregate(per_repeat)
        results.add_sweep_point(outcome.scenario.name, p.sweep, p.x, engine, medians, mode=p.mode,
                                x_label=p.x_label, repeats=per_repeat, spread=spreads)


# --------------------------------------------------------------------------------------------
# claims shared by scenarios


#: how a request the engine served ends; a rejection, an error or an abort nobody asked for is not that
SERVED_FINISH_REASONS = ("length", "stop")


def unserved(trace: Trace) -> str | None:
    """How ``trace``'s requests that were not served ended, in words ("3 of 52 not served: 3 error ("Context size
    has been exceeded."))"), or None when every one was served (or aborted: a workload's own aborts are judged by
    :func:`all_finished` with the ids it asked to abort)."""
    ends: dict[str, list[Any]] = {}
    for r in trace.requests.values():
        if r.finished is None:
            ends.setdefault("never finished", []).append(r)
        elif r.finish_reason not in SERVED_FINISH_REASONS and r.finish_reason != "abort":
            ends.setdefault(str(r.finish_reason), []).append(r)
    if not ends:
        return None
    count = sum(len(v) for v in ends.values())
    parts = []
    for reason, requests in ends.items():
        error = next((r.error_event for r in requests if r.error_event), None)
        parts.append(f"{len(requests)} {reason}" + (f' ("{error[:120]}")' if error else ""))
    return f"{count} of {len(trace.requests)} not served: {', '.join(parts)}"


def say_why_unfinished(outcome: Outcome) -> None:
    """Give each failed "every request finished" claim of ``outcome`` its evidence (:func:`unserved` per entry),
    so the report and the failure say how the requests ended, not only that they did not all end well."""
    why = [f"{e.mode + ': ' if e.mode else ''}{said}" for e in outcome.entries if (said := unserved(e.trace))]
    for claim, held in outcome.claims.items():
        if claim.startswith(SANITY_CLAIM) and held is False and why and claim not in outcome.claim_evidence:
            outcome.claim_evidence[claim] = "; ".join(why)


def all_finished(trace: Trace, asked_to_abort: Collection[str] = ()) -> bool:
    """Every request finished and was served: ``"length"`` or ``"stop"``, or ``"abort"`` for one the
    workload asked to abort (``asked_to_abort``). An engine that rejects, fails or aborts requests of
    its own accord has not served them."""
    return bool(trace.requests) and all(
        r.finished is not None
        and (r.finish_reason in SERVED_FINISH_REASONS or (r.finish_reason == "abort" and rid in asked_to_abort))
        for rid, r in trace.requests.items())


def positive(value: float | None) -> bool | None:
    return None if value is None else value > 0


def percentile(values: Sequence[float], q: float) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(vals, q)) if vals else None


def ttft_by(trace: Trace, keep: Callable[[Any], bool]) -> list[float]:
    """TTFTs of the requests ``keep`` selects (requests without a token are left out)."""
    return [r.token_times[0] - r.arrival for r in trace.requests.values() if keep(r) and r.token_times]


def preemptions_between(trace: Trace, t0: float, t1: float) -> int:
    """Preemptions in ``[t0, t1)`` on the workload's clock (on the step clock, by the step's virtual time)."""
    clock = workload_clock(trace)
    return sum(1 for r in trace.requests.values() for t, _ in r.preemptions if t0 <= clock(t) < t1)
