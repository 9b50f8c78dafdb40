"""The simulator at scale: workloads, one run or a sweep of knobs on a ``sim`` engine, the runs table.

``kvbench simulate`` (:mod:`kvbench.cli`) is a thin face over this module and
:mod:`kvbench.sim.capacity_plan`. A sweep serves one workload on a ``sim`` engine once per
combination of knob values (:func:`run_sweep`); each run keeps its headline figures (:class:`SimRun`),
and :func:`kvbench.sim.capacity_plan.capacity_plan` reads the grid into a plan (knee concurrency,
the pool for a preemption budget, swap vs recompute with the cost model's crossover length).

Every time here is simulated seconds on the sim engine's hardware profile.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.bench import metrics
from kvbench.bench.workloads import Poisson, SharedPrefix, Uniform, Workload, WorkloadSpec, combine
from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.core.trace import TraceRecorder

#: the figures a plan prints per run
HEADLINE = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99", "preemptions_recompute", "preemptions_swap",
            "recomputed_tokens", "swapped_out_bytes")


def _lengths(low: int, high: int, scale: float) -> Uniform:
    """``Uniform(low, high)`` with both bounds times ``scale``, rounded down (at least 1 token)."""
    return Uniform(max(1, math.floor(low * scale)), max(1, math.floor(high * scale)))


def evening_surge_specs(num_requests: int = 10_000, seed: int = 0,
                        length_scale: float = 1.0) -> list[tuple[WorkloadSpec, float]]:
    """:func:`evening_surge_at_scale`'s specs, each with the seconds its arrivals are shifted by."""
    wave_n = max(1, num_requests * 16 // 100)
    steady = WorkloadSpec("steady", num_requests - wave_n, _lengths(64, 512, length_scale),
                          _lengths(64, 256, length_scale), Poisson(40.0), seed=seed)
    wave = WorkloadSpec("wave", wave_n, _lengths(2048, 3072, length_scale), _lengths(512, 1000, length_scale),
                        Poisson(16.0), seed=seed + 1)
    return [(steady, 0.0), (wave, 100.0)]


def evening_surge_at_scale(num_requests: int = 10_000, vocab_size: int = 32_000, max_model_len: int = 8192,
                           seed: int = 0, length_scale: float = 1.0) -> Workload:
    """The evening surge (the ``evening_surge`` scenario, docs/benchmarks.md#scenarios) at production scale: 84%
    steady short traffic (64-512 prompt,
    64-256 output tokens, Poisson 40/s), then from t=100 s a wave of 16% long-context requests
    (2048-3072 prompt, 512-1000 output, Poisson 16/s): the full-scale scenario's shape, 28x the requests.
    ``length_scale`` multiplies every length (arrivals unchanged): see :func:`fit_length_scale`."""
    return _build("evening_surge_at_scale", evening_surge_specs(num_requests, seed, length_scale), vocab_size,
                  max_model_len, length_scale)


def mixed_victims_specs(num_requests: int = 1600, seed: int = 0,
                        length_scale: float = 1.0) -> list[tuple[WorkloadSpec, float]]:
    """:func:`mixed_victims_at_scale`'s specs, each with the seconds its arrivals are shifted by."""
    long_n = max(1, num_requests // 16)
    short = WorkloadSpec("short", num_requests - long_n, _lengths(16, 128, length_scale),
                         _lengths(512, 1024, length_scale), Poisson(32.0),
                         shared_prefix=SharedPrefix(2, max(1, math.floor(256 * length_scale))), seed=seed + 11)
    long = WorkloadSpec("long", long_n, _lengths(3072, 6144, length_scale), _lengths(256, 512, length_scale),
                        Poisson(2.0), seed=seed + 12)
    return [(short, 0.0), (long, 0.0)]


def mixed_victims_at_scale(num_requests: int = 1600, vocab_size: int = 32_000, max_model_len: int = 8192,
                           seed: int = 0, length_scale: float = 1.0) -> Workload:
    """Short and long victims mixed, at Llama-3-8B/H200 scale (``preemption_mode=auto``,
    docs/simulator.md#preemption-aware-policies): 15 of
    16 requests short (a 256-token system prompt of 2, shared, then 16-128 tokens of their own; 512-1024
    output tokens; Poisson 32/s), 1 of 16 long and unique (3,072-6,144-token prompts, 256-512 output
    tokens; Poisson 2/s). Serve it with prefix caching on and a pool too small for it
    (``num_gpu_blocks_override=8000``): a short victim is cheap to recompute (its prompt is mostly
    shared) while a swap copies its shared blocks and brings them back unshared; a long victim is
    dear to recompute once its blocks are drawn, and cheap to swap. ``length_scale`` as
    :func:`evening_surge_at_scale`'s."""
    return _build("mixed_victims_at_scale", mixed_victims_specs(num_requests, seed, length_scale), vocab_size,
                  max_model_len, length_scale)


def _build(name: str, specs: list[tuple[WorkloadSpec, float]], vocab_size: int, max_model_len: int,
           length_scale: float) -> Workload:
    if not (math.isfinite(length_scale) and 0 < length_scale <= 1):
        raise ValueError(f"length_scale={length_scale!r} is invalid: expected a number in (0, 1]")
    limit = max_model_len - 1
    parts = [spec.build(vocab_size, max_prompt_len=limit).shifted(shift) if shift else
             spec.build(vocab_size, max_prompt_len=limit) for spec, shift in specs]
    if length_scale != 1.0:
        name = f"{name} (lengths x{length_scale:.3g})"
    return combine(name, *parts)


#: ``kvbench simulate --workload``: name -> (builder, knobs it needs)
WORKLOADS = {"evening_surge": (evening_surge_at_scale, Knobs()),
             "mixed_victims": (mixed_victims_at_scale, Knobs(enable_prefix_caching=True))}
#: the same workloads' specs (their lengths decide whether a model's context holds them)
WORKLOAD_SPECS = {"evening_surge": evening_surge_specs, "mixed_victims": mixed_victims_specs}


def longest_request(workload: str) -> int:
    """Tokens of the longest request ``workload`` can hold at full scale: prompt (prefix included)
    plus output."""
    return max(spec.max_prompt_len() + spec.output_len.bounds()[1] for spec, _ in WORKLOAD_SPECS[workload]())


def fit_length_scale(workload: str, max_model_len: int) -> float:
    """1.0 when ``workload``'s longest request fits ``max_model_len`` positions; otherwise the factor
    that shrinks every length (prompts, outputs, shared prefixes; rounded down) until it does. A
    model with a short context (the built-in checkpoints: 1,024 positions) then serves the
    workload's shape, not its sizes: fewer tokens per request at the same arrival rates."""
    longest = longest_request(workload)
    return 1.0 if longest <= max_model_len else max_model_len / longest


@dataclass
class SimRun:
    """One simulated run: its knobs, its :data:`HEADLINE` figures (simulated time) plus
    ``preemptions_per_request``, and what simulating it cost on this machine (wall seconds)."""

    knobs: dict[str, Any]
    figures: dict[str, float | None]
    requests: int
    wall_seconds: float  # how long simulating took on this machine
    simulate_seconds: float = 0.0  # of which the engine loop (the rest: metrics)


def simulate(adapter: Any, workload: Workload, knobs: Knobs = DEFAULT_KNOBS) -> SimRun:
    """Serve ``workload`` on a ``sim`` adapter under ``knobs``; its headline figures (simulated time)."""
    t0 = time.perf_counter()
    recorder = TraceRecorder(adapter.name, workload.name)
    adapter.serve(workload, recorder, knobs)
    trace = recorder.finish()
    t1 = time.perf_counter()
    summary = metrics.summarize(trace)
    figures = {k: summary.get(k) for k in HEADLINE}
    figures["preemptions_per_request"] = ((summary.get("preemptions") or 0) / len(workload.requests)
                                          if workload.requests else None)
    return SimRun(knobs.as_dict(), figures, len(workload.requests), time.perf_counter() - t0, t1 - t0)


def parse_sweep(texts: Sequence[str]) -> dict[str, list[Any]]:
    """``max_num_seqs=64,128,num_gpu_blocks=4000,8000,preemption_mode=swap,recompute`` (repeatable) ->
    ``{knob: [values]}``: a word with ``=`` starts a knob, words without one add values to it. Values
    are typed as the :class:`Knobs` field. Raises ValueError naming a key that is not a knob or a bad value."""
    sweep: dict[str, list[Any]] = {}
    allowed = set(Knobs.__dataclass_fields__)
    for text in texts:
        key = None
        for word in filter(None, (w.strip() for w in text.split(","))):
            if "=" in word:
                key, _, word = word.partition("=")
                key = key.strip()
                if key not in allowed:
                    raise ValueError(f"--sweep: {key!r} is not a knob (knobs: {', '.join(sorted(allowed))})")
                if key in sweep:
                    raise ValueError(f"--sweep: {key!r} given twice")
                sweep[key] = []
            if key is None:
                raise ValueError(f"--sweep {text!r}: expected KNOB=VALUE[,VALUE...] first, got {word!r}")
            sweep[key].append(_knob_value(key, word.strip()))
    return sweep


def _knob_value(key: str, text: str) -> Any:
    annotation = str(Knobs.__dataclass_fields__[key].type)
    if annotation.startswith("int"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--sweep: {key}={text!r} is not an integer") from None
    if annotation.startswith("float"):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"--sweep: {key}={text!r} is not a number") from None
    if annotation.startswith("bool"):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--sweep: {key}={text!r} is not true/false")
        return text.lower() == "true"
    return text


def sweep_points(sweep: Mapping[str, Sequence[Any]], base: Knobs = DEFAULT_KNOBS) -> list[Knobs]:
    """The grid's product: one :class:`Knobs` per combination of the swept values, over ``base``."""
    keys = list(sweep)
    return [base.merged(Knobs(**dict(zip(keys, values, strict=True))))
            for values in itertools.product(*(sweep[k] for k in keys))]


def check_sweep(adapter: Any, sweep: Mapping[str, Sequence[Any]], base: Knobs = DEFAULT_KNOBS) -> list[str]:
    """Check every point of the sweep before minutes of simulating: raises ValueError with the engine's
    own message (naming the field) for a point the engine refuses; returns warnings for knobs that
    would not change anything (the watermark's headroom without the watermark)."""
    configs = []
    for knobs in sweep_points(sweep, base):
        try:
            configs.append(adapter.engine_config(knobs))
        except ValueError as e:  # reference_engine's ConfigError (bench does not import the engine)
            raise ValueError(f"--sweep {', '.join(f'{k}={v}' for k, v in knobs.as_dict().items() if k in sweep)}: "
                             f"{e}") from None
    warnings = []
    if "admission_headroom" in sweep and all(c.admission_policy != "watermark" for c in configs):
        warnings.append("admission_headroom is swept but no point uses admission_policy=watermark: every run "
                        "admits the same (add admission_policy=watermark to the engine or the sweep)")
    return warnings


def run_sweep(adapter: Any, workload: Workload, sweep: Mapping[str, Sequence[Any]], base: Knobs = DEFAULT_KNOBS,
              progress: Any = None) -> list[SimRun]:
    """One :func:`simulate` per combination of the swept values (the grid's product)."""
    runs = []
    for knobs in sweep_points(sweep, base):
        runs.append(simulate(adapter, workload, knobs))
        if progress is not None:
            progress(runs[-1])
    return runs


def format_runs(runs: Sequence[SimRun]) -> str:
    """The runs as a plain-text table, one row per run in order, columns aligned."""
    header = ["knobs", "requests", "tok/s", "TTFT p50", "TTFT p99", "TBT p99", "preempt rec", "preempt swap",
              "recomputed", "swapped GB", "sim wall s"]
    rows = [[", ".join(f"{k}={v}" for k, v in r.knobs.items()) or "defaults", str(r.requests),
             fmt_number(r.figures["output_throughput"]), fmt_ms(r.figures["ttft_p50"]), fmt_ms(r.figures["ttft_p99"]),
             fmt_ms(r.figures["tbt_p99"]), fmt_number(r.figures["preemptions_recompute"], 0),
             fmt_number(r.figures["preemptions_swap"], 0), fmt_number(r.figures["recomputed_tokens"], 0),
             fmt_number(None if r.figures.get("swapped_out_bytes") is None else r.figures["swapped_out_bytes"] / 1e9),
             f"{r.wall_seconds:.1f}"]
            for r in runs]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
                     for row in [header, *rows])


def fmt_number(value: float | None, digits: int = 1) -> str:
    """``value`` with thousands separators and ``digits`` decimals; "-" for None."""
    return "-" if value is None else f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    """Seconds as milliseconds, one decimal: ``0.0056`` -> "5.6 ms"; "-" for None."""
    return "-" if value is None else f"{value * 1e3:,.1f} ms"
