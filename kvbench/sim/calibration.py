"""``kvbench calibrate``: fit a hardware profile to the reference engine as the driver serves it.

Every cell of a :class:`~reference_engine.sim.calibrate.Design` (context x decode batch, with
prefills joining the decodes) is served on the reference engine through kvbench's own driver
(:func:`kvbench.drivers.step_loop.drive`, as every benchmark serves it) on the step clock, so the same
requests meet the same steps on every run. Each step's shape is recorded (what the scheduler handed
the runner) beside the trace, and each step becomes an
:class:`~reference_engine.sim.calibrate.IntervalSample`: the interval from the previous step's end
to this one's, which is what a served run's throughput, TTFT and TBT are made of.
:func:`~reference_engine.sim.calibrate.fit_intervals` fits the cost model's coefficients plus
``per_request_s`` to the cells outside ``heldout_contexts`` (least squares in seconds); the
printed error (median and p90 relative error per interval, R², and the error of their sum) is
given on the fitted cells and on the held-out ones, and saved in the profile's ``fit``. What a step
costs more after the engine sat idle is timed apart (:func:`~reference_engine.sim.calibrate.fit_wake`) and
saved as ``wake_s`` and ``wake_tau_s``, with the medians behind them in ``fit["wake"]``; each cell's first
interval, which follows the cell's set-up, is left out of the interval fit for that reason.
``kvbench validate-sim`` (:mod:`kvbench.sim.validation`) uses the same recording and samples
(:func:`recording`, :func:`interval_samples`) on the quick scenarios.
"""

from __future__ import annotations

import bisect
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.core.knobs import Knobs
from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.engines.inprocess.reference import ReferenceAdapter
from reference_engine.costs import Coefficients, CostModel, HardwareProfile, StepShape, load_model_shape
from reference_engine.sim.calibrate import (
    Design,
    IntervalSample,
    WakeFit,
    copy_bandwidth,
    fit_error,
    fit_intervals,
    fit_swap,
    fit_wake,
    peak_flops,
)

__all__ = ["MIN_R2", "Calibration", "Design", "base_profile", "calibrate", "calibrate_profile", "cell_requests",
           "fit_problems", "interval_samples", "recording"]

#: virtual seconds per step on the step clock (only orders releases; every time kept is wall clock)
STEP_SECONDS = 0.01
#: the engine the design is served on: a pool large enough that no cell preempts
KNOBS = Knobs(num_gpu_blocks=1024, block_size=16, max_num_seqs=256)


# ------------------------------------------------------------------------------ recording served steps
def recording(adapter: Any) -> Any:
    """Make a reference ``adapter`` record each engine's step shapes: ``adapter.shape_runs`` gets one
    list per engine it builds (one per served job, in order). Returns the adapter."""
    adapter.shape_runs = []
    build = adapter.build_engine

    def build_engine(*args: Any, **kwargs: Any) -> Any:
        engine = build(*args, **kwargs)
        shapes: list[StepShape] = []
        adapter.shape_runs.append(shapes)
        execute = engine.runner.execute

        def capture(out: Any, *args: Any) -> Any:
            shapes.append(StepShape.of_chunks((c.start, c.num_tokens, c.completes) for c in out.chunks))
            return execute(out, *args)

        engine.runner.execute = capture
        return engine

    adapter.build_engine = build_engine
    return adapter


def interval_samples(trace: Any, shapes: list[StepShape], group: str) -> list[IntervalSample]:
    """One sample per step of a served trace: its shape, the arrivals released since the previous
    step ended, and the interval from that end to this step's end (the first step: its duration).
    RuntimeError when the shapes do not line up with the trace's steps."""
    if len(shapes) != len(trace.steps):
        raise RuntimeError(f"{group}: {len(shapes)} shapes for {len(trace.steps)} steps")
    arrivals = sorted(r.arrival for r in trace.requests.values())
    out, prev = [], None
    for shape, step in zip(shapes, trace.steps, strict=True):
        start = step.t - step.duration if prev is None else prev
        released = bisect.bisect_right(arrivals, step.t) - bisect.bisect_right(arrivals, start)
        out.append(IntervalSample(shape, released, step.t - start, group))
        prev = step.t
    return out


def base_profile(model_dir: str, design: Design, name: str) -> HardwareProfile:
    """This machine's peak rates (micro benchmarks) and fitted swap terms, ``combine="sum"``,
    float32 (the reference engine on CPU); step coefficients at their defaults, to be fitted."""
    flops, bandwidth = peak_flops(), copy_bandwidth()
    per_copy, link = fit_swap(model_dir, design, bandwidth)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    base = HardwareProfile(name, compute_flops=flops, memory_bandwidth=bandwidth, link_bandwidth=bandwidth,
                           memory_bytes=memory, combine="sum", dtype="float32")
    return base.with_coefficients(Coefficients(link=link, per_copy_s=per_copy))


# ------------------------------------------------------------------------------ the designed cells
def cell_requests(design: Design, context: int, batch: int, token_budget: int, vocab_size: int,
                  rng: np.random.Generator) -> list[WorkloadRequest]:
    """The cell's requests (:meth:`Design.cell_plan`) released by step on a clock of ``STEP_SECONDS``;
    random prompt tokens (no prefix is shared, so no step is shortened by a cache hit)."""
    requests = []
    for i, (step, prompt, max_tokens) in enumerate(design.cell_plan(context, batch, token_budget)):
        tokens = rng.integers(3, vocab_size, size=prompt).tolist()
        # half a step in, so float rounding cannot move a release to the step before
        requests.append(WorkloadRequest(f"r{i:04d}", tokens, max_tokens, (step + 0.5) * STEP_SECONDS))
    return requests


@dataclass
class Calibration:
    """A fitted profile (its ``fit`` holds the error figures) and the samples behind it."""

    profile: HardwareProfile
    train: list[IntervalSample] = field(repr=False)
    heldout: list[IntervalSample] = field(repr=False)

    def summary(self) -> str:
        """What was fitted and how well, in a few lines (the ``kvbench calibrate`` report)."""
        p, c, fit = self.profile, self.profile.coefficients, self.profile.fit or {}

        def err(part: str) -> str:
            e = fit.get(part) or {}
            if not e.get("intervals"):
                return f"{part}: no intervals"
            r2 = "-" if e.get("r2") is None else f"{e['r2']:.2f}"
            return (f"{part} ({e['intervals']} intervals): median relative error {e['median_rel_error']:.1%}, "
                    f"p90 {e['p90_rel_error']:.1%}, R² {r2}; their sum {e['total_rel_error']:.1%} off")

        return "\n".join([
            f"calibrated profile {p.name!r} ({fit.get('model')}, {p.dtype}, {fit.get('torch_threads')} torch "
            f"thread(s), combine={p.combine}), fitted to served step intervals",
            f"  peak rates: {p.compute_flops / 1e9:.1f} GFLOP/s, memory {p.memory_bandwidth / 1e9:.1f} GB/s, "
            f"copies {p.link_bandwidth / 1e9:.1f} GB/s",
            f"  coefficients: fixed {c.fixed_s * 1e3:.3f} ms, per sequence {c.per_seq_s * 1e6:.1f} us, "
            f"per request {c.per_request_s * 1e6:.1f} us, dense x{c.dense:.2f}, attention x{c.attention:.2f}, "
            f"memory x{c.memory:.2f}, link x{c.link:.2f}, per copy {c.per_copy_s * 1e6:.1f} us",
            *([f"  waking up after idle: {WakeFit.from_fit(c, fit['wake']).describe()}"] if fit.get("wake") else []),
            f"  fit on contexts {fit.get('fit_contexts')}: " + err("train"),
            f"  held out, contexts {fit.get('heldout_contexts')}: " + err("heldout"),
        ])


def calibrate(model_dir: str, name: str = "this-machine", design: Design | None = None, seed: int = 0,
              torch_threads: int = 1, progress: Callable[[str], None] | None = None) -> Calibration:
    """Serve ``design`` on the reference engine (``model_dir``), fit, and return the calibrated profile
    with its own fit error. ``torch_threads``: torch's threads meanwhile (restored afterwards).
    ``progress`` gets one line per step of the calibration (rates, then each cell as it is served).
    ValueError naming the ``Design`` field when a cell cannot be served whole on this model."""
    import torch

    design = design or Design()
    say = progress or (lambda line: None)
    shape = load_model_shape(model_dir)
    adapter = recording(ReferenceAdapter(model_dir))
    config = adapter.engine_config(KNOBS)
    max_model_len = config.max_model_len or shape.max_position_embeddings
    # without chunked prefill the token budget is max_model_len (the engine's default)
    budget = config.max_num_batched_tokens or max_model_len
    design.check_fits(max_model_len, KNOBS.num_gpu_blocks or 0, KNOBS.block_size or 16)
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    rng = np.random.default_rng(seed)
    train: list[IntervalSample] = []
    heldout: list[IntervalSample] = []
    try:
        t0 = time.perf_counter()
        base = base_profile(model_dir, design, name)
        say(f"peak rates and swap copies measured in {time.perf_counter() - t0:.1f} s")
        cells = [(r, c, d) for r in range(design.rounds) for c, d in design.cells()]
        for i, (r, context, batch) in enumerate(cells, 1):
            t0 = time.perf_counter()
            name = f"context {context}, batch {batch}"
            recorder = TraceRecorder(adapter.name, "calibrate")
            requests = cell_requests(design, context, batch, budget, shape.vocab_size, rng)
            adapter.serve(requests, recorder, KNOBS, step_seconds=STEP_SECONDS)
            # the cell's first step follows its set-up, an idle spell: what that costs is the wake term's,
            # timed apart (fit_wake); fitted here it raised the fixed cost of every step (predicted steps
            # 4-11% slow on the storm, 5 passes)
            got = interval_samples(recorder.finish(), adapter.shape_runs.pop(), name)[1:]
            (heldout if context in design.heldout_contexts else train).extend(got)
            say(f"cell {i}/{len(cells)} (round {r + 1}/{design.rounds}): context {context}, decode batch {batch}: "
                f"{len(got)} steps served in {time.perf_counter() - t0:.1f} s"
                f"{' (held out)' if context in design.heldout_contexts else ''}")
        t0 = time.perf_counter()
        wake = fit_wake(model_dir, design)
        say(f"waking up after idle, timed in {time.perf_counter() - t0:.1f} s: {wake.describe()}")
    finally:
        torch.set_num_threads(before)
    cost = CostModel(shape, base)
    profile = base.with_coefficients(replace(fit_intervals(cost, train), wake_s=wake.wake_s,
                                             wake_tau_s=wake.wake_tau_s))
    fitted = CostModel(shape, profile)
    machine = f"{platform.machine()} {platform.node()}"
    fit: dict[str, Any] = {
        "method": "served step intervals (kvbench.sim.calibration, least squares in seconds)",
        "model": shape.name, "torch_threads": torch_threads, "machine": machine, "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2), "rounds": design.rounds,
        "fit_contexts": [c for c in design.contexts if c not in design.heldout_contexts],
        "heldout_contexts": list(design.heldout_contexts),
        "train": fit_error(fitted, train), "heldout": fit_error(fitted, heldout),
        "wake": {"warm_s": wake.warm_s, "extra_s": {f"{g:g}": e for g, e in sorted(wake.extra_s.items())}},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    source = f"kvbench calibrate on {machine} ({shape.name}, {torch_threads} torch thread(s))"
    return Calibration(profile.with_coefficients(profile.coefficients, fit=fit, source=source), train, heldout)


#: below this R² (in seconds, on the fitted or the held-out intervals) a fit explains too little of how a
#: step's interval varies to plan on; ``kvbench calibrate`` refuses to save it without ``--force``. R² <= 0
#: predicts no better than one constant interval; loaded runs here fitted 0.55-0.65.
MIN_R2 = 0.3


def fit_problems(fit: dict[str, Any] | None) -> list[str]:
    """Why a calibrated profile's ``fit`` is not worth planning on, one sentence each (none: fine):
    an R² below :data:`MIN_R2`, or undefined, on the fitted or the held-out cells."""
    fit = fit or {}
    problems = []
    for part, label, contexts in (("train", "fitted", "fit_contexts"), ("heldout", "held-out", "heldout_contexts")):
        error = fit.get(part) or {}
        if not error.get("intervals"):
            continue
        r2 = error.get("r2")
        where = f"the {label} cells (contexts {fit.get(contexts)}, {error['intervals']} intervals)"
        if r2 is None:
            problems.append(f"R² is undefined on {where}: every interval measured the same")
        elif r2 < MIN_R2:
            problems.append(f"R² {r2:.2f} on {where} is below {MIN_R2}: the cost model explains "
                            f"{max(r2, 0.0):.0%} of how their intervals vary"
                            + (", worse than predicting their mean for all" if r2 < 0 else ""))
    return problems


def calibrate_profile(model_dir: str, output: str, name: str = "this-machine", design: Design | None = None,
                      torch_threads: int = 1, progress: Callable[[str], None] | None = None,
                      force: bool = False) -> tuple[Calibration, Path]:
    """Calibrate and save the profile to ``output``; the calibration (:meth:`Calibration.summary` is the
    report) and where it was written. Without ``force``, ValueError before any measuring when
    ``output`` exists, and after it (nothing written) when :func:`fit_problems` finds the fit explains
    too little, saying why; with ``force`` both are saved anyway (the caller warns)."""
    path = Path(output)
    if path.exists() and not force:
        raise ValueError(f"-o {output}: the file exists; --force overwrites it, or name another file with -o")
    result = calibrate(model_dir, name=name, design=design, torch_threads=torch_threads, progress=progress)
    problems = fit_problems(result.profile.fit)
    if problems and not force:
        fit = result.profile.fit or {}
        raise ValueError(
            f"the fit explains too little to plan on, so {output} was not written:\n"
            + "".join(f"  - {p}\n" for p in problems) + f"{result.summary()}\n"
            f"Step intervals this noisy usually mean a loaded machine (load average {fit.get('load_average')} on "
            f"{fit.get('cpus')} CPUs when calibrating ended): calibrate again when it is quieter or with more "
            "--rounds, or add --force to save this profile anyway")
    return result, result.profile.save(path)
