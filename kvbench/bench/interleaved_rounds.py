"""Several engines on the same closed-loop work, rounds interleaved, every ratio taken within a round.

What ``kvbench head-to-head`` runs. Each engine is an ordinary ``--engine`` spec, optionally labelled
(``LABEL=SPEC``: ``vllm=server:preset=vllm``); every engine serves the same workload (token-id prompts,
greedy, EOS ignored, every request ``prompt`` + ``output`` tokens, ``concurrency`` requests in flight)
under the same knobs (block size, a pool that holds every running request's KV, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``), except the knobs set apart for one engine.

Per checkpoint, each engine is built once and warmed up with an untimed job (a server starts then and is
kept for every concurrency and round). The rounds are interleaved: in each round every engine serves
each concurrency once, the engines' order rotating from round to round, with ``cool_down`` seconds of
quiet before each timed job (a peer's scheduler may spin for a while after its last step, on the cores
the next engine runs on). Every ratio is taken within a round, and shown as median [min-max] over the
rounds (:func:`kvbench.bench.formatting.fmt_median_range`). Nothing here asserts a time; what it checks
is that every request finished, and the table says when one did not.

Threads: each launched server's processes are read back from ``/proc`` after its warm-up (threads, CPU
affinity, the ``OMP_*``/``KMP_*``/``VLLM_CPU*`` settings of its environment) with what its log says
about threads, so a comparison shows each side's effective settings. ``threads="matched"`` runs the
reference engine (in process, and every ``server:preset=reference``) on ``nproc - 1`` torch threads,
as many as vLLM's CPU worker binds OpenMP threads to; ``"default"`` leaves each side as it starts by
itself. docs/benchmarks.md#head-to-head says how to read the table.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # kvbench.bench.scenarios imports this module (its head_to_head scenario): imported at run time
    from kvbench.bench.scenarios.common import Job, Model
from kvbench.bench import metrics
from kvbench.bench.formatting import fmt_median_range
from kvbench.bench.results import commit_info
from kvbench.bench.workloads import ClosedLoop, Fixed, Workload, WorkloadSpec
from kvbench.core.trace import Trace, TraceRecorder
from kvbench.engines.base import EngineAdapter, Knobs
from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.registry import EngineSpec, adapter_class, parse_engine_spec

#: what a label may be made of: no ``:`` (every spec with options has one before its first ``=``, so
#: ``LABEL=SPEC`` and a bare spec cannot be confused)
_LABEL = re.compile(r"[A-Za-z0-9_.+-]+")
#: the seed of every timed workload (each concurrency builds its own from it), and of the warm-up
WORKLOAD_SEED, WARMUP_SEED = 21, 1
THREAD_MODES = ("default", "matched")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Contender:
    """One engine of a head-to-head: the name its rows carry (its label, else the spec's canonical name)
    and its spec."""

    name: str
    spec: EngineSpec


def parse_contender(text: str) -> Contender:
    """``LABEL=SPEC`` or a bare ``SPEC`` (:func:`kvbench.engines.registry.parse_engine_spec`'s form);
    :class:`kvbench.engines.registry.EngineSpecError` (a ValueError) for a spec that does not parse."""
    label, eq, rest = text.partition("=")
    if eq and _LABEL.fullmatch(label.strip()) and rest.strip():
        return Contender(label.strip(), parse_engine_spec(rest))
    spec = parse_engine_spec(text)
    return Contender(spec.name, spec)


def parse_contenders(texts: Sequence[str]) -> list[Contender]:
    """Every ``--engine`` value; ValueError for none or two with the same name. One engine alone is
    allowed: its rounds are timed the same way, with no ratio."""
    contenders = [parse_contender(t) for t in texts]
    if not contenders:
        raise ValueError("--engine: name the engines to compare (--engine [LABEL=]SPEC, repeatable)")
    names = [c.name for c in contenders]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"--engine: two engines named {', '.join(map(repr, twice))}; label one of them "
                         "(LABEL=SPEC, e.g. fast=reference:attention_backend=cpp)")
    return contenders


def parse_knob_overrides(items: Sequence[str], engine_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["ENGINE:KEY=VALUE", ...]`` -> ``{engine: {knob: value}}``. ENGINE is an engine's name in this run
    (its label, or its spec as named); the knob setting is what follows the last ``:``. Values read as
    JSON where they parse (numbers, true/false) and as strings otherwise. ValueError naming the item for
    a malformed one, an unknown knob or an engine the run does not have."""
    knob_names = {f.name for f in fields(Knobs)}
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        engine, sep, setting = item.rpartition(":")
        key, eq, value = setting.partition("=")
        if not (sep and eq and engine and key):
            raise ValueError(f"--knob: expected ENGINE:KEY=VALUE, got {item!r}")
        if key not in knob_names:
            raise ValueError(f"--knob {item!r}: unknown knob {key!r}; expected one of {', '.join(sorted(knob_names))}")
        if engine not in engine_names:
            raise ValueError(f"--knob {item!r}: no engine named {engine!r} in this run "
                             f"(engines: {', '.join(engine_names)})")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(engine, {})[key] = parsed
    return out


@dataclass(frozen=True)
class Setup:
    """The work every engine serves and the knobs they share. Errors name the field."""

    concurrency: tuple[int, ...] = (16, 64)
    rounds: int = 2
    requests: int = 128
    prompt: int = 128
    output: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # vLLM's CPU server default, so a peer runs as it starts
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    cool_down: float = 1.5
    threads: str = "default"
    metrics_interval: float = 0.1
    #: each engine runs in each of these dtypes in turn (:func:`with_dtype`); empty: as its spec says
    dtypes: tuple[str, ...] = ()
    knob_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("rounds", "requests", "prompt", "output", "max_num_seqs", "max_num_batched_tokens",
                     "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency must be one or more values >= 1, got {list(self.concurrency)}")
        if self.cool_down < 0 or self.metrics_interval < 0:
            raise ValueError(f"cool_down and metrics_interval must be >= 0, got {self.cool_down} and "
                             f"{self.metrics_interval}")
        if self.threads not in THREAD_MODES:
            raise ValueError(f"threads must be one of {', '.join(THREAD_MODES)}, got {self.threads!r}")

    def knobs(self) -> Knobs:
        """The knobs every engine shares: a pool that holds every running request's KV (no preemption),
        ``max_model_len`` = prompt + output, and prefix caching off (vLLM's default is on; the prompts share
        no prefix, so it would only add its bookkeeping)."""
        max_len = self.prompt + self.output
        blocks = self.max_num_seqs * -(-max_len // self.block_size) + 8
        return Knobs(block_size=self.block_size, num_gpu_blocks=blocks, max_num_seqs=self.max_num_seqs,
                     max_model_len=max_len, max_num_batched_tokens=self.max_num_batched_tokens,
                     enable_prefix_caching=False)

    def knobs_of(self, engine: str) -> Knobs:
        """The shared knobs with ``engine``'s own set apart."""
        return self.knobs().merged(Knobs(**dict(self.knob_overrides.get(engine, {}))))


@dataclass
class Cell:
    """One checkpoint x concurrency: per engine, each round's output tok/s, TTFT p50 (s) and requests
    finished."""

    model: str
    concurrency: int
    dtype: str | None = None
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    ttft_p50: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, list[int]] = field(default_factory=dict)
    #: per engine, every request of any round that got another number of output tokens than it asked for
    miscounted: dict[str, list[str]] = field(default_factory=dict)
    #: the first round's greedy outputs, each engine's against the first engine's of its dtype
    #: (:meth:`kvbench.bench.scenarios.closed_loop.Agreement.to_dict`)
    agreement: list[dict[str, Any]] = field(default_factory=list)

    def add(self, engine: str, m: Mapping[str, float | None]) -> None:
        self.tok_s.setdefault(engine, []).append(float(m["output_throughput"] or 0.0))
        ttft = m.get("ttft_p50")
        self.ttft_p50.setdefault(engine, []).append(math.nan if ttft is None else float(ttft))
        self.finished.setdefault(engine, []).append(int(m["requests_finished"] or 0))


def checkpoint_layouts(contenders: Sequence[Contender]) -> list:
    """Each engine's KV layout as its spec declares it: what picks a checkpoint every engine loads
    (:func:`kvbench.models.builtin.checkpoint_for`)."""
    return [adapter_class(c.spec.kind).kv_layout_for(dict(c.spec.options)) for c in contenders]


def matched_threads() -> int:
    """vLLM's CPU worker binds OpenMP threads to every core but the one it reserves: ``nproc - 1``, at least 1."""
    return max(1, (os.cpu_count() or 2) - 1)


def with_dtype(contender: Contender, dtype: str | None) -> dict[str, str]:
    """The contender's options with ``dtype`` set: its kind's ``dtype`` option, or ``--dtype`` appended to a
    launched server's ``args`` (the flag of the reference server and vLLM alike). ValueError naming the
    engine when its spec already names a dtype or its kind takes none (a running server: ``openai``)."""
    options = dict(contender.spec.options)
    if dtype is None:
        return options
    keys = adapter_class(contender.spec.kind).option_keys
    if "dtype" in options or "--dtype" in options.get("args", "").split():
        raise ValueError(f"--dtype {dtype}: engine {contender.name!r} names its own dtype in its spec; "
                         "give the dtype one way")
    # the server kind's own dtype option is llama.cpp's (which GGUF to convert to); every other preset
    # takes the --dtype flag its server documents
    launched_with_flag = "args" in keys and options.get("preset", "reference") != "llamacpp"
    if "dtype" in keys and not launched_with_flag:
        options["dtype"] = dtype
    elif "args" in keys:
        options["args"] = f"{options.get('args', '')} --dtype {dtype}".strip()
    else:
        raise ValueError(f"--dtype {dtype}: engine {contender.name!r} ({contender.spec.kind}) takes no dtype "
                         "option: run it in the dtype it was started with, without --dtype")
    return options


def make_engines(contenders: Sequence[Contender], model_dir: str | Path, setup: Setup,
                 log_dir: Path, dtype: str | None = None) -> dict[str, EngineAdapter]:
    """The adapters, by name, in ``dtype`` (:func:`with_dtype`; None: as each spec says). Engines whose
    kind takes them get ``metrics_interval`` and ``log_dir`` from ``setup`` unless their spec sets them.
    Reference servers run ``matched_threads()`` torch threads (``threads="matched"``) or their own default
    (``"default"``: not this process's count)."""
    engines: dict[str, EngineAdapter] = {}
    for c in contenders:
        cls = adapter_class(c.spec.kind)
        options = with_dtype(c, dtype)
        if "metrics_interval" in cls.option_keys:
            options.setdefault("metrics_interval", f"{setup.metrics_interval:g}")
        if "log_dir" in cls.option_keys:
            options.setdefault("log_dir", str(log_dir))
        adapter = cls(str(model_dir), options, name=c.name)
        if isinstance(adapter, ServerAdapter) and adapter.preset.name == "reference":
            adapter.env_overrides["OMP_NUM_THREADS"] = (str(matched_threads()) if setup.threads == "matched"
                                                        else None)
        engines[c.name] = adapter
    return engines


def closed_loop(model: Model, n: int, prompt: int, output: int, concurrency: int, seed: int) -> Workload:
    """``n`` requests of ``prompt`` token ids and ``output`` tokens each (greedy, EOS ignored), ``concurrency``
    in flight: the work of a head-to-head."""
    from kvbench.bench.scenarios.common import build_workload

    spec = WorkloadSpec("head_to_head", n, Fixed(prompt), Fixed(output), ClosedLoop(concurrency), seed=seed)
    return build_workload(spec, model)


def knobs_taken(adapter: EngineAdapter, knobs: Knobs) -> tuple[Knobs, dict[str, str]]:
    """``knobs`` less those ``adapter`` cannot set (its ``unsupported_knobs``), with why each was left out.
    A head-to-head's knobs match the engines wherever they can: a knob an engine has no way to set (hf-cb's
    ``max_model_len``) is left out for that engine and said, rather than leaving the engine out."""
    dropped = {k: adapter.unsupported_knobs[k] for k, v in knobs.as_dict().items()
               if v is not None and k in adapter.unsupported_knobs}
    return (Knobs(**{k: v for k, v in knobs.as_dict().items() if k not in dropped}), dropped)


def warm_up(engines: Mapping[str, EngineAdapter], model: Model, knobs_of: Callable[[str], Knobs], prompt: int,
            progress: Progress = lambda line: None) -> None:
    """Serve each engine an untimed job (8 requests of ``prompt`` + 8 tokens, 8 in flight) under the knobs it
    will be timed with: a server starts then, and a first run's one-off costs (allocations, compilation) stay
    out of the timed rounds."""
    from kvbench.bench.scenarios.common import Job

    warm = closed_loop(model, 8, prompt, 8, 8, seed=WARMUP_SEED)
    for name, adapter in engines.items():
        t0 = time.perf_counter()
        serve(adapter, Job(warm, knobs_of(name)), "head_to_head_warmup")
        progress(f"   {name}: started and warmed up in {time.perf_counter() - t0:.0f} s")


def serve(adapter: EngineAdapter, job: Job, scenario: str, **kwargs: Any) -> Trace:
    """:func:`kvbench.bench.scenarios.common.serve`, imported when first called (the scenarios package imports
    this module for its head-to-head scenario)."""
    from kvbench.bench.scenarios.common import serve as serve_job

    return serve_job(adapter, job, scenario, **kwargs)


#: what :func:`serve_rounds` calls after each timed job: (round, job index, engine, its trace)
OnServed = Callable[[int, int, str, Trace], None]


def serve_rounds(engines: Mapping[str, EngineAdapter], plan: Callable[[], Sequence[Job]], rounds: int, *,
                 cool_down: float, knobs_of: Callable[[str, Job], Knobs] | None = None,
                 scenario: str = "head_to_head", step_seconds: float | None = None, keep_outputs: bool = False,
                 on_served: OnServed | None = None,
                 catch: bool = False) -> tuple[list[list[dict[str, Trace]]], dict[str, Exception]]:
    """The interleaved rounds: in each round, every job of ``plan()`` (built afresh each round) is served on
    every engine in turn, the engines' order rotating with the round and the job (so that no engine always
    serves right after another), ``cool_down`` seconds of quiet before each timed job (a peer's scheduler
    may spin for a while after its last step, on the cores the next engine runs on).

    ``knobs_of(engine, job)``: the knobs ``engine`` serves ``job`` with (default: the job's).
    ``step_seconds``: the step clock for a ``steppable`` engine (:func:`kvbench.bench.scenarios.common.serve`).
    ``keep_outputs``: each request's output token ids kept in its trace (a cross-check reads them).

    Returns ``(served, failed)``: ``served[round][job][engine]`` is a trace; ``failed[engine]`` the exception
    serving it raised. With ``catch`` such an engine is left out of every later job and round and the others
    go on; without, the exception propagates."""
    names = list(engines)
    failed: dict[str, Exception] = {}
    served: list[list[dict[str, Trace]]] = []
    for r in range(rounds if names else 0):
        jobs = plan()
        this_round: list[dict[str, Trace]] = []
        for j, job in enumerate(jobs):
            k = (r + j) % len(names)  # the order rotates: no engine always serves right after another
            traces: dict[str, Trace] = {}
            for name in names[k:] + names[:k]:
                if name in failed:
                    continue
                time.sleep(cool_down)
                mine = job if knobs_of is None else replace(job, knobs=knobs_of(name, job))
                recorder = TraceRecorder(engines[name].name, scenario, keep_outputs=keep_outputs)
                try:
                    traces[name] = serve(engines[name], mine, scenario, step_seconds=step_seconds, recorder=recorder)
                except Exception as e:  # handed to the caller: that engine's result, not the others'
                    if not catch:
                        raise
                    failed[name] = e
                    continue
                if on_served is not None:
                    on_served(r, j, name, traces[name])
            this_round.append(traces)
        served.append(this_round)
    return served, failed


def run_rounds(engines: Mapping[str, EngineAdapter], model: Model, setup: Setup, dtype: str | None = None,
               progress: Progress = lambda line: None) -> tuple[list[Cell], dict[str, Any]]:
    """Warm each engine up (untimed), then serve ``setup.rounds`` interleaved rounds of every concurrency
    (:func:`serve_rounds`); returns one cell per concurrency and each launched server's thread settings, by
    engine. Each cell also holds the requests that got another number of output tokens than asked, and the
    first round's greedy outputs cross-checked engine against engine (the scenario's own checks:
    :mod:`kvbench.bench.scenarios.closed_loop`). The caller owns the adapters (and closes them)."""
    from kvbench.bench.scenarios.closed_loop import cross_check, engine_dtype
    from kvbench.bench.scenarios.closed_loop import miscounted as miscounted_in
    from kvbench.bench.scenarios.common import Job

    def knobs_of(name: str) -> Knobs:
        return knobs_taken(engines[name], setup.knobs_of(name))[0]

    warm_up(engines, model, knobs_of, setup.prompt, progress)
    threads = {f"{name} ({model.preset}{', ' + dtype if dtype else ''})": server_threads(adapter)
               for name, adapter in engines.items() if isinstance(adapter, ServerAdapter)}
    cells = [Cell(model.preset, c, dtype) for c in setup.concurrency]

    def plan() -> list[Job]:
        return [Job(closed_loop(model, setup.requests, setup.prompt, setup.output, c, WORKLOAD_SEED), setup.knobs())
                for c in setup.concurrency]

    first: list[dict[str, Trace]] = [{} for _ in setup.concurrency]  # the first round's traces, for the cross-check

    def served(r: int, j: int, name: str, trace: Trace) -> None:
        m = metrics.summarize(trace)
        cells[j].add(name, m)
        if wrong := miscounted_in(trace):
            cells[j].miscounted.setdefault(name, []).extend(f"round {r + 1}: {w}" for w in wrong)
        if r == 0:
            first[j][name] = trace
        progress(f"   round {r + 1} c={setup.concurrency[j]:<3} {name:<12} {m['output_throughput'] or 0:8,.0f} tok/s  "
                 f"TTFT p50 {m['ttft_p50'] if m['ttft_p50'] is not None else math.nan:6.3f} s  "
                 f"finished {int(m['requests_finished'] or 0)}/{setup.requests}")

    serve_rounds(engines, plan, setup.rounds, cool_down=setup.cool_down,
                 knobs_of=lambda name, job: knobs_of(name), keep_outputs=True, on_served=served)
    dtypes = {name: engine_dtype(adapter) for name, adapter in engines.items()}
    for cell, traces in zip(cells, first, strict=True):
        cell.agreement = [a.to_dict() for a in cross_check({n: [t] for n, t in traces.items()}, dtypes)]
    return cells, threads


def head_to_head(contenders: Sequence[Contender], checkpoints: Mapping[str, str | Path], setup: Setup, *,
                 log_dir: Path, command: str = "", progress: Progress = lambda line: None) -> dict[str, Any]:
    """Run the head-to-head on every checkpoint (name -> folder) and return its record: what
    :func:`report` renders and ``--json`` saves. With ``threads="matched"`` this process's torch threads
    (the in-process engines') are set for the run and restored after."""
    import torch  # only for a run: rendering a saved record needs none of it

    from kvbench.bench.scenarios.common import Model

    started = datetime.datetime.now(datetime.UTC)
    torch_threads = torch.get_num_threads()
    if setup.threads == "matched":
        torch.set_num_threads(matched_threads())
    try:
        progress(f"head-to-head: {started:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {os.cpu_count()} cores, "
                 f"load {os.getloadavg()[0]:.1f}, threads={setup.threads} (this process: "
                 f"{torch.get_num_threads()} torch threads), server logs in {log_dir}")
        cells: list[Cell] = []
        threads: dict[str, Any] = {}
        client_threads = torch.get_num_threads()
        for model_name, ckpt in checkpoints.items():
            model = Model.from_dir(ckpt, model_name)
            for dtype in setup.dtypes or (None,):
                progress(f"\n== {model_name} ({Path(ckpt).name}){', ' + dtype if dtype else ''}: {setup.requests} "
                         f"requests x {setup.prompt} prompt + {setup.output} output, knobs {setup.knobs().as_dict()}")
                engines = make_engines(contenders, ckpt, setup, log_dir, dtype)
                try:
                    model_cells, model_threads = run_rounds(engines, model, setup, dtype, progress)
                finally:
                    for adapter in engines.values():
                        adapter.close()
                cells += model_cells
                threads.update(model_threads)
    finally:
        torch.set_num_threads(torch_threads)
    return {"started": started.isoformat(timespec="seconds"), "command": command,
            "commit": (commit_info(Path(__file__).parent)["id"] or "?")[:7], "cores": os.cpu_count(),
            "engines": {c.name: c.spec.name for c in contenders}, "requests": setup.requests,
            "threads_mode": setup.threads, "client_torch_threads": client_threads,
            "knob_overrides": {k: dict(v) for k, v in setup.knob_overrides.items()},
            "metrics_interval": setup.metrics_interval, "cool_down_s": setup.cool_down,
            "cells": [asdict(c) for c in cells], "threads": threads}


# -- thread settings, read from the running processes -------------------------------------------------


def process_threads(pgid: int) -> list[dict[str, Any]]:
    """Every process of group ``pgid``: name, threads, CPUs it may run on, OMP settings in its environment.
    A process that ends while it is read is left out."""
    rows = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getpgid(pid) != pgid:
                continue
            status = (entry / "status").read_text()
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
            threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
            rows.append({
                "pid": pid, "comm": (entry / "comm").read_text().strip(), "cmd": cmd[:100],
                "threads": int(threads.group(1)) if threads else None,
                "cpus": sorted(os.sched_getaffinity(pid)),
                "omp": {k: v for k, v in env.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "VLLM_CPU"))},
            })
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(rows, key=lambda r: r["pid"])


def server_threads(adapter: ServerAdapter) -> dict[str, Any]:
    """The running server's processes and, from its log, what it said about threads."""
    process = adapter.process
    if process is None:
        return {}
    said: list[str] = []
    if adapter.logs:
        lines = Path(adapter.logs[-1]).read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "OpenMP thread binding info" in line:  # vLLM's CPU worker: the binding follows on 4 lines
                said += [line.strip()] + [x.strip() for x in lines[i + 1:i + 5]]
            elif re.search(r"max_num_batched_tokens|torch threads|num_threads", line):
                said.append(line.strip()[-200:])
    return {"processes": process_threads(process.pgid), "log": said[:12]}


def describe_threads(name: str, info: Mapping[str, Any]) -> list[str]:
    out = [f"  {name}:"]
    for p in info.get("processes", []):
        out.append(f"    pid {p['pid']} {p['comm']:<16} threads {p['threads']!s:>3}  cpus {p['cpus']}  "
                   f"{' '.join(f'{k}={v}' for k, v in sorted(p['omp'].items())) or '(no OMP_* set)'}")
    out += [f"    log: {line}" for line in info.get("log", [])]
    return out


# -- the table --------------------------------------------------------------------------------------


def round_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` for every round both have (a zero or missing denominator gives NaN, left out)."""
    return [x / y for x, y in zip(a, b, strict=False) if y and not math.isnan(x / y)]


def unfinished(record: Mapping[str, Any]) -> list[str]:
    """Each engine x checkpoint x concurrency where a round finished fewer requests than it was given, in
    words; empty when every request of every job finished (or the record does not say how many were
    given)."""
    requests = record.get("requests")
    if requests is None:
        return []
    out = []
    for c in record["cells"]:
        for engine, finished in c["finished"].items():
            if min(finished or [0]) < requests:
                where = c["model"] + (f"/{c['dtype']}" if c.get("dtype") else "")
                out.append(f"{engine} at {where}, c={c['concurrency']}: {min(finished or [0])} of {requests} "
                           "requests finished in its worst round")
    return out


def failures(record: Mapping[str, Any]) -> list[str]:
    """What makes a run fail (the command exits 1), in words: :func:`unfinished` jobs, requests that got another
    number of output tokens than asked, and float32 engines whose greedy outputs agree with the first's on fewer
    than half the requests (a smaller divergence is a finding, shown in the table's notes, not a failure)."""
    out = unfinished(record)
    for c in record["cells"]:
        where = c["model"] + (f"/{c['dtype']}" if c.get("dtype") else "") + f", c={c['concurrency']}"
        for engine, wrong in (c.get("miscounted") or {}).items():
            out.append(f"{engine} at {where}: {len(wrong)} requests got another number of output tokens than asked "
                       f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''})")
        for a in c.get("agreement") or []:
            if a["dtype"] == "float32" and a["compared"] and 2 * a["identical"] < a["compared"]:
                out.append(f"{a['engines'][1]} at {where}: greedy outputs against {a['engines'][0]}'s: {a['words']}")
    return out


def report(record: Mapping[str, Any], baseline: str | None = None) -> str:
    """The record as a Markdown table: per checkpoint, concurrency and engine, output tok/s and TTFT p50
    as median [min-max] over the rounds, and each one's ratios to ``baseline`` (default: the first
    engine) taken within each round. ValueError naming the engines when ``baseline`` is not one."""
    cells = [Cell(**c) for c in record["cells"]]
    names = list(record.get("engines") or dict.fromkeys(e for c in cells for e in c.tok_s))
    base = baseline or names[0]
    if base not in names:
        raise ValueError(f"--baseline {base!r}: not an engine of this run (engines: {', '.join(names)})")
    requests = record.get("requests")
    short = unfinished(record)
    lines = [f"\n# head-to-head: {record['started']}, commit {record['commit']}, threads={record['threads_mode']}",
             f"# {record['command']}",
             f"# /metrics sampled every {record.get('metrics_interval', 0.1):g} s during runs (0: not at all); "
             f"{record.get('cool_down_s', 0):g} s of quiet before each timed job", ""]
    lines += [f"{name} = {spec}" for name, spec in (record.get("engines") or {}).items() if name != spec]
    lines += ["", f"| model | conc. | engine | output tok/s | TTFT p50 s | finished | tok/s ÷ {base} | "
              f"TTFT ÷ {base} |", "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for engine in c.tok_s:
            vs_tok = vs_ttft = ""
            if engine != base and base in c.tok_s:
                vs_tok = fmt_median_range(round_ratios(c.tok_s[engine], c.tok_s[base]), "{:.2f}x")
                vs_ttft = fmt_median_range(round_ratios(c.ttft_p50[engine], c.ttft_p50[base]), "{:.2f}x")
            least = min(c.finished.get(engine) or [0])
            model = c.model + (f"/{c.dtype}" if c.dtype else "")
            lines.append(f"| {model} | {c.concurrency} | {engine} | {fmt_median_range(c.tok_s[engine])} | "
                         f"{fmt_median_range(c.ttft_p50[engine], '{:.2f}')} | "
                         f"{least if requests is None else f'{least}/{requests}'} | {vs_tok} | {vs_ttft} |")
    for name, overrides in (record.get("knob_overrides") or {}).items():
        lines.append(f"\n{name} ran with " + ", ".join(f"{k}={v}" for k, v in overrides.items())
                     + " (the others with the knobs above)")
    lines += [f"\nNOT ALL FINISHED: {line}" for line in short]
    lines += [f"\nFAILED: {line}" for line in failures(record)[len(short):]]
    agreements = [(c, a) for c in cells for a in c.agreement]
    if agreements:
        lines += ["", "greedy outputs, the first round's, request by request, each engine against the first of its "
                      "dtype (a divergence is a finding; fewer than half identical in float32 fails):"]
        lines += [f"  {c.model}{'/' + c.dtype if c.dtype else ''} c={c.concurrency}: {a['engines'][1]} vs "
                  f"{a['engines'][0]} ({a['dtype']}): {a['words']}" for c, a in agreements]
    lines += ["", f"ratios: within each round, median [min-max] over the rounds; TTFT ÷ {base} below 1 means the "
              f"engine answered first. Thread settings seen:"]
    for name, info in (record.get("threads") or {}).items():
        lines += describe_threads(name, info)
    return "\n".join(lines)
