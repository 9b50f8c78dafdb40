"""Capacity plans from the simulator: one run, or a sweep of knobs, summarised as a plan.

``kvbench simulate`` (:mod:`kvbench.cli`) is a thin face over this module. A sweep serves one workload
on a ``sim`` engine once per combination of knob values and the plan reads the grid:

* **knee concurrency**: per pool size and mode, the smallest ``max_num_seqs`` whose output throughput
  is within 5% of the best the sweep reached (more admits more preemption, not more tokens);
* **pool for a preemption budget**: the smallest ``num_gpu_blocks`` whose preemptions per request stay
  within the budget at the workload's arrival rate;
* **swap vs recompute**: both modes side by side, and the cost model's crossover length (which mode is
  cheaper for a victim of each length, :meth:`reference_engine.sim.CostModel.crossover`).

Every time here is simulated seconds on the sim engine's hardware profile.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench import metrics
from kvbench.bench.workloads import Poisson, SharedPrefix, Uniform, Workload, WorkloadSpec, combine
from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.core.trace import TraceRecorder

#: the figures a plan prints per run
HEADLINE = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99", "preemptions_recompute", "preemptions_swap",
            "recomputed_tokens", "swapped_out_bytes")
KNEE_SHARE = 0.95


def evening_surge_at_scale(num_requests: int = 10_000, vocab_size: int = 32_000, max_model_len: int = 8192,
                           seed: int = 0) -> Workload:
    """The evening surge (seed 000) at production scale: 84% steady short traffic (64-512 prompt,
    64-256 output tokens, Poisson 40/s), then from t=100 s a wave of 16% long-context requests
    (2048-3072 prompt, 512-1000 output, Poisson 16/s): the full-scale scenario's shape, 28x the requests."""
    wave_n = max(1, num_requests * 16 // 100)
    steady = WorkloadSpec("steady", num_requests - wave_n, Uniform(64, 512), Uniform(64, 256), Poisson(40.0),
                          seed=seed)
    wave = WorkloadSpec("wave", wave_n, Uniform(2048, 3072), Uniform(512, 1000), Poisson(16.0), seed=seed + 1)
    limit = max_model_len - 1
    return combine("evening_surge_at_scale", steady.build(vocab_size, max_prompt_len=limit),
                   wave.build(vocab_size, max_prompt_len=limit).shifted(100.0))


def mixed_victims_at_scale(num_requests: int = 1600, vocab_size: int = 32_000, max_model_len: int = 8192,
                           seed: int = 0) -> Workload:
    """Short and long victims mixed, at Llama-3-8B/H200 scale (issue 11, ``preemption_mode=auto``): 15 of
    16 requests short (a 256-token system prompt of 2, shared, then 16-128 tokens of their own; 512-1024
    output tokens; Poisson 32/s), 1 of 16 long and unique (3,072-6,144-token prompts, 256-512 output
    tokens; Poisson 2/s). Serve it with prefix caching on and a pool too small for it
    (``num_gpu_blocks_override=8000``): a short victim is cheap to recompute (its prompt is mostly
    shared) while a swap copies its shared blocks and brings them back unshared; a long victim is
    dear to recompute once its blocks are drawn, and cheap to swap."""
    long_n = max(1, num_requests // 16)
    limit = max_model_len - 1
    short = WorkloadSpec("short", num_requests - long_n, Uniform(16, 128), Uniform(512, 1024), Poisson(32.0),
                         shared_prefix=SharedPrefix(2, 256), seed=seed + 11)
    long = WorkloadSpec("long", long_n, Uniform(3072, 6144), Uniform(256, 512), Poisson(2.0), seed=seed + 12)
    return combine("mixed_victims_at_scale", short.build(vocab_size, max_prompt_len=limit),
                   long.build(vocab_size, max_prompt_len=limit))


#: ``kvbench simulate --workload``: name -> (builder, knobs it needs)
WORKLOADS = {"evening_surge": (evening_surge_at_scale, Knobs()),
             "mixed_victims": (mixed_victims_at_scale, Knobs(enable_prefix_caching=True))}


@dataclass
class SimRun:
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


def run_sweep(adapter: Any, workload: Workload, sweep: Mapping[str, Sequence[Any]], base: Knobs = DEFAULT_KNOBS,
              progress: Any = None) -> list[SimRun]:
    """One :func:`simulate` per combination of the swept values (the grid's product)."""
    keys = list(sweep)
    runs = []
    for values in itertools.product(*(sweep[k] for k in keys)):
        knobs = base.merged(Knobs(**dict(zip(keys, values, strict=True))))
        runs.append(simulate(adapter, workload, knobs))
        if progress is not None:
            progress(runs[-1])
    return runs


@dataclass
class CapacityPlan:
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.lines)


def _group(runs: Sequence[SimRun], by: str) -> dict[tuple, list[SimRun]]:
    groups: dict[tuple, list[SimRun]] = {}
    for r in runs:
        rest = tuple(sorted((k, v) for k, v in r.knobs.items() if k != by))
        groups.setdefault(rest, []).append(r)
    return groups


def _label(rest: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in rest) or "defaults"


def capacity_plan(runs: Sequence[SimRun], adapter: Any, preemption_budget: float = 0.01) -> CapacityPlan:
    """The plan in words: knee concurrency, the pool for ``preemption_budget`` preemptions per request,
    swap vs recompute (the runs' figures and the cost model's crossover length)."""
    plan = CapacityPlan()
    add = plan.lines.append
    swept = {k for r in runs for k in r.knobs}
    if any("max_num_seqs" in r.knobs for r in runs):
        add(f"Knee concurrency (smallest max_num_seqs within {1 - KNEE_SHARE:.0%} of the best throughput):")
        for rest, group in _group(runs, "max_num_seqs").items():
            group = sorted(group, key=lambda r: r.knobs.get("max_num_seqs", 0))
            best = max((r.figures["output_throughput"] or 0) for r in group)
            knee = next(r for r in group if (r.figures["output_throughput"] or 0) >= KNEE_SHARE * best)
            add(f"  {_label(rest)}: knee at max_num_seqs={knee.knobs['max_num_seqs']} "
                f"({_fmt(knee.figures['output_throughput'])} tok/s of best {_fmt(best)}; p99 TBT "
                f"{_ms(knee.figures['tbt_p99'])}, {_fmt(knee.figures['preemptions_per_request'], 3)} "
                "preemptions/request)")
    if "num_gpu_blocks" in swept:
        add(f"Pool size for <= {preemption_budget:g} preemptions per request at this workload's arrival rate:")
        for rest, group in _group(runs, "num_gpu_blocks").items():
            group = sorted(group, key=lambda r: r.knobs.get("num_gpu_blocks", 0))
            ok = [r for r in group if (r.figures["preemptions_per_request"] or 0) <= preemption_budget]
            if ok:
                add(f"  {_label(rest)}: num_gpu_blocks={ok[0].knobs['num_gpu_blocks']} "
                    f"({_fmt(ok[0].figures['preemptions_per_request'], 3)} preemptions/request)")
            else:
                add(f"  {_label(rest)}: none of {[r.knobs['num_gpu_blocks'] for r in group]} stays within the budget")
    if "preemption_mode" in swept:
        add("Swap vs recompute (simulated runs):")
        for rest, group in _group(runs, "preemption_mode").items():
            cells = [f"{r.knobs.get('preemption_mode')}: {_fmt(r.figures['output_throughput'])} tok/s, p99 TBT "
                     f"{_ms(r.figures['tbt_p99'])}" for r in group]
            add(f"  {_label(rest)}: " + "; ".join(cells))
            add_auto_claims(group, add)
    engine = adapter.build_engine(Knobs())
    crossover = engine.cost.crossover(engine.config.block_size, engine.config.max_model_len)
    add(f"Cost model ({adapter.model_shape.name} on {adapter.profile.name}): {crossover.describe()} "
        f"(a victim swapped out and back in vs its tokens prefilled again).")
    return plan


def add_auto_claims(group: Sequence[SimRun], add: Any) -> None:
    """The scenario's claims on auto (:func:`kvbench.bench.scenarios.policies.auto_vs_fixed_claims`) for
    one group of runs that differ only in ``preemption_mode``, when it has all three."""
    from kvbench.bench.scenarios.policies import auto_vs_fixed_claims

    by_mode = {r.knobs.get("preemption_mode"): r.figures for r in group}
    if not {"auto", "recompute", "swap"} <= set(by_mode):
        return
    auto = by_mode["auto"]
    mixed = bool(auto.get("preemptions_swap")) and bool(auto.get("preemptions_recompute"))
    claims = auto_vs_fixed_claims(*(by_mode[m]["output_throughput"] for m in ("auto", "recompute", "swap")), mixed)
    for claim, held in claims.items():
        add(f"    {'shown' if held else 'NOT shown' if held is False else 'undecided'}: {claim}")


def format_runs(runs: Sequence[SimRun]) -> str:
    header = ["knobs", "requests", "tok/s", "TTFT p50", "TTFT p99", "TBT p99", "preempt rec", "preempt swap",
              "recomputed", "swapped GB", "sim wall s"]
    rows = [[", ".join(f"{k}={v}" for k, v in r.knobs.items()) or "defaults", str(r.requests),
             _fmt(r.figures["output_throughput"]), _ms(r.figures["ttft_p50"]), _ms(r.figures["ttft_p99"]),
             _ms(r.figures["tbt_p99"]), _fmt(r.figures["preemptions_recompute"], 0),
             _fmt(r.figures["preemptions_swap"], 0), _fmt(r.figures["recomputed_tokens"], 0),
             _fmt(None if r.figures.get("swapped_out_bytes") is None else r.figures["swapped_out_bytes"] / 1e9),
             f"{r.wall_seconds:.1f}"]
            for r in runs]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
                     for row in [header, *rows])


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f} ms"
