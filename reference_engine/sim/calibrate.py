"""Calibration: fit the step cost model's coefficients to the reference engine on this machine.

``calibrate(model_dir)`` runs the real engine over a designed set of batch shapes: for every
(context length C, decode batch D) cell, D requests with C-token prompts are prefilled, then decode
a few steps, then a prefill of P tokens joins the decodes for one step, for every P. Every step is one
sample: its shape (what the scheduler handed the runner) and its measured seconds
(``LLMEngine.last_step["seconds"]``: schedule, run and update). Peak rates come from two micro
benchmarks (a float32 matmul for FLOP/s, a large copy for bytes/s), so the fitted coefficients are
"times the ideal" as for the GPU profiles.

The fit is least squares on relative error (each row divided by its measured time), with the
coefficients held non-negative (:func:`nnls`). Cells of the middle context length are held out of
the fit; the report gives the median and p90 relative error on them (``fit`` in the profile).
Swap copies are timed separately (1 to 64 blocks) and fitted to ``per_copy_s + link x bytes / B``.
"""

from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reference_engine.sim.cost_model import FEATURES, CostModel, StepShape
from reference_engine.sim.models import load_model_shape
from reference_engine.sim.profiles import Coefficients, HardwareProfile


@dataclass(frozen=True)
class Grid:
    """The designed shapes. The default keeps a calibration under a minute on two busy cores."""

    contexts: tuple[int, ...] = (32, 192, 512)
    decode_batches: tuple[int, ...] = (1, 8, 24)
    prefills: tuple[int, ...] = (16, 96, 384)
    decode_steps: int = 5
    repeats: int = 3  # of each prefill-beside-decodes point
    heldout_contexts: tuple[int, ...] = (192,)  # cells held out of the fit, to measure its error
    swap_blocks: tuple[int, ...] = (1, 4, 16, 64)
    swap_repeats: int = 5


@dataclass
class Sample:
    shape: StepShape
    seconds: float
    context: int  # the design cell's context length (decides held out or not)
    key: tuple = ()  # the design point: repeats of one point share it


def median_samples(samples: list[Sample]) -> list[Sample]:
    """One sample per design point: the median time of its repeats, with its middle repeat's shape.

    A shared machine slows a step now and then by several times (another process takes the core);
    the median of a few repeats keeps those out of the fit."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.key or (id(s),), []).append(s)
    out = []
    for group in groups.values():
        middle = group[len(group) // 2]
        out.append(Sample(middle.shape, float(np.median([g.seconds for g in group])), middle.context, middle.key))
    return out


@dataclass
class Calibration:
    profile: HardwareProfile
    samples: list[Sample] = field(repr=False)
    train_errors: list[float] = field(repr=False)
    heldout_errors: list[float] = field(repr=False)

    def summary(self) -> str:
        p, c = self.profile, self.profile.coefficients
        fit = p.fit or {}

        def pct(key: str) -> str:
            return "-" if fit.get(key) is None else f"{fit[key]:.1%}"

        return "\n".join([
            f"calibrated profile {p.name!r} ({fit.get('model')}, {p.dtype}, {fit.get('torch_threads')} torch "
            f"thread(s), combine={p.combine})",
            f"  peak rates: {p.compute_flops / 1e9:.1f} GFLOP/s, memory {p.memory_bandwidth / 1e9:.1f} GB/s, "
            f"copies {p.link_bandwidth / 1e9:.1f} GB/s",
            f"  coefficients: fixed {c.fixed_s * 1e3:.3f} ms, per sequence {c.per_seq_s * 1e6:.1f} us, "
            f"dense x{c.dense:.2f}, attention x{c.attention:.2f}, memory x{c.memory:.2f}, link x{c.link:.2f}, "
            f"per copy {c.per_copy_s * 1e6:.1f} us",
            f"  fit on {fit.get('train_points')} design points ({fit.get('steps')} steps in all): median relative "
            f"error {pct('train_median_rel_error')}, p90 {pct('train_p90_rel_error')}",
            f"  held out ({fit.get('heldout_points')} points, contexts {fit.get('heldout_contexts')}): median "
            f"relative error {pct('heldout_median_rel_error')}, p90 {pct('heldout_p90_rel_error')}",
        ])


# ------------------------------------------------------------------------------------ fitting
def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares ``a x ~ b`` with ``x >= 0`` (Lawson-Hanson active set; small problems only)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
        w = a.T @ (b - a @ x)
    return x


def fit_coefficients(cost: CostModel, samples: list[Sample]) -> tuple[float, ...]:
    """Non-negative coefficients of :data:`FEATURES` minimising the relative error of ``sum`` combine."""
    a = np.array([cost.features(s.shape) for s in samples])
    y = np.array([s.seconds for s in samples])
    return tuple(float(v) for v in nnls(a / y[:, None], np.ones_like(y)))


def relative_errors(cost: CostModel, samples: list[Sample]) -> list[float]:
    return [abs(cost.step_seconds(s.shape) - s.seconds) / s.seconds for s in samples]


# ------------------------------------------------------------------------------------ measuring
def peak_flops(n: int = 384, repeats: int = 5) -> float:
    """float32 matmul FLOP/s on this machine's current torch threads (best of ``repeats``)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read side), best of ``repeats``."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _measure_steps(model_dir: str, grid: Grid, seed: int) -> list[Sample]:
    from reference_engine import EngineConfig, LLMEngine, SamplingParams

    rng = random.Random(seed)
    engine = LLMEngine(EngineConfig(model=model_dir, num_gpu_blocks_override=1024, max_num_seqs=256))
    vocab = engine.model.config.vocab_size
    shapes: list[StepShape] = []
    execute = engine.runner.execute

    def capture(out):
        shapes.append(StepShape.of_chunks((c.start, c.num_tokens, c.completes) for c in out.chunks))
        return execute(out)

    engine.runner.execute = capture
    samples: list[Sample] = []
    ids = iter(range(1 << 30))

    def step(context: int, key: tuple = ()) -> None:
        shapes.clear()
        engine.step()
        if shapes and shapes[-1].num_seqs:
            samples.append(Sample(shapes[-1], float(engine.last_step["seconds"]), context, key))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for context in grid.contexts:
        for batch in grid.decode_batches:
            # long enough to outlive the cell however many steps its prefills take
            long_run = SamplingParams(max_tokens=engine.config.max_model_len - context - 1, ignore_eos=True)
            running = [f"d{next(ids)}" for _ in range(batch)]
            for rid in running:
                engine.add_request(rid, prompt(context), long_run)
            while any(len(engine.scheduler.requests[r].output_token_ids) == 0 for r in running):
                step(context)  # the cell's prefills: samples too, one each
            for _ in range(grid.decode_steps):
                step(context, (context, batch, "decode"))
            for p in grid.prefills:
                for _ in range(grid.repeats):
                    engine.add_request(f"p{next(ids)}", prompt(p), SamplingParams(max_tokens=1, ignore_eos=True))
                    step(context, (context, batch, p))  # the prefill joins the decodes
            for rid in running:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
    return samples


def fit_swap(model_dir: str, grid: Grid, link_bandwidth: float) -> tuple[float, float]:
    """(per_copy_s, link coefficient) from timed batched copies of 1..64 blocks."""
    import torch

    from reference_engine.kv_cache import KVCache
    from reference_engine.model import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    n = max(grid.swap_blocks)
    kv = KVCache(2 * n, 2 * n, mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32, torch.device("cpu"))
    rows, times = [], []
    for blocks in grid.swap_blocks:
        mapping = [(2 * i, 2 * i + 1) for i in range(blocks)]  # scattered ids: the general (gather) path
        for _ in range(grid.swap_repeats):
            t0 = time.perf_counter()
            nbytes = kv.swap_out(mapping)
            times.append(time.perf_counter() - t0)
            rows.append([1.0, nbytes / link_bandwidth])
    a, y = np.array(rows), np.array(times)
    per_copy, link = nnls(a / y[:, None], np.ones_like(y))
    return float(per_copy), float(link)


def calibrate(model_dir: str | Path, name: str = "this-machine", grid: Grid | None = None, seed: int = 0,
              torch_threads: int = 1) -> Calibration:
    """Measure, fit and return a calibrated profile (``combine="sum"``, the engine's float32) with its
    own fit error. ``torch_threads``: the threads torch uses meanwhile (restored afterwards)."""
    import torch

    grid = grid or Grid()
    model_dir = str(model_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        flops, bandwidth = peak_flops(), copy_bandwidth()
        samples = _measure_steps(model_dir, grid, seed)
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        base = HardwareProfile(name, compute_flops=flops, memory_bandwidth=bandwidth, link_bandwidth=bandwidth,
                               memory_bytes=memory, combine="sum", dtype="float32")
        shape = load_model_shape(model_dir)
        points = median_samples(samples)
        train = [s for s in points if s.context not in grid.heldout_contexts]
        heldout = [s for s in points if s.context in grid.heldout_contexts]
        fitted = fit_coefficients(CostModel(shape, base), train)
        per_copy, link = fit_swap(model_dir, grid, bandwidth)
    finally:
        torch.set_num_threads(before)
    coefficients = Coefficients(**dict(zip(FEATURES, fitted, strict=True)), link=link, per_copy_s=per_copy)
    profile = base.with_coefficients(coefficients)
    cost = CostModel(shape, profile)
    train_err, held_err = relative_errors(cost, train), relative_errors(cost, heldout)
    fit: dict[str, Any] = {
        "model": shape.name, "torch_threads": torch_threads, "machine": f"{platform.machine()} {platform.node()}",
        "cpus": os.cpu_count(), "steps": len(samples), "train_points": len(train), "heldout_points": len(heldout),
        "heldout_contexts": list(grid.heldout_contexts),
        "train_median_rel_error": float(np.median(train_err)),
        "train_p90_rel_error": float(np.percentile(train_err, 90)),
        "heldout_median_rel_error": float(np.median(held_err)) if held_err else None,
        "heldout_p90_rel_error": float(np.percentile(held_err, 90)) if held_err else None,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    source = f"kvbench calibrate on {fit['machine']} ({shape.name}, {torch_threads} torch thread(s))"
    return Calibration(profile.with_coefficients(coefficients, fit=fit, source=source), samples, train_err, held_err)


# ------------------------------------------------------------------------------ served runs
@dataclass(frozen=True)
class IntervalSample:
    """One step of a *served* run as the driver saw it: the step's shape, the requests released
    right before it, and ``seconds`` from the previous step's end to this one's (the engine step plus
    everything the driver did in between: recording, events, the watchdog, releases)."""

    shape: StepShape
    arrivals: int
    seconds: float
    group: str = ""  # e.g. the scenario, for leave-one-group-out fits


def fit_intervals(cost: CostModel, samples: list[IntervalSample], relative: bool = False,
                  trim: float = 3.0) -> Coefficients:
    """Coefficients of :data:`FEATURES` plus ``per_request_s`` fitted (non-negative least squares) to
    served step intervals; swap terms are left at ``cost``'s profile.

    ``relative=False`` (the default) minimises the squared error in seconds, so the predicted
    intervals add up to the measured ones: on a loaded machine an interval is the step's work *plus
    the time the process waited for a core*, a heavy tail (median ~1 ms, some 5-10 ms at load 11 on
    2 cores) that throughput and TTFT sum over. ``relative=True`` fits the typical step instead
    (relative error, one trimming round dropping intervals more than ``trim`` x off the first fit):
    what the step costs on an idle core, ~3x less than the mean there."""
    rows = [s for s in samples if s.shape.num_seqs and s.seconds > 0]
    if len(rows) < len(FEATURES) + 1:
        raise ValueError(f"fit_intervals: {len(rows)} non-empty steps are too few to fit {len(FEATURES) + 1} terms")

    def design(rows: list[IntervalSample]) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([[*cost.features(s.shape), float(s.arrivals)] for s in rows]),
                np.array([s.seconds for s in rows]))

    a, y = design(rows)
    if relative:
        x = nnls(a / y[:, None], np.ones_like(y))
        ratio = y / np.maximum(a @ x, 1e-12)
        keep = (ratio >= 1 / trim) & (ratio <= trim)
        if keep.sum() >= len(FEATURES) + 1:
            x = nnls(a[keep] / y[keep, None], np.ones(int(keep.sum())))
    else:
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of ~1: a well-conditioned active set
        x = nnls(a / scale, y) / scale
    c = cost.profile.coefficients
    return Coefficients(**dict(zip(FEATURES, (float(v) for v in x[:-1]), strict=True)), link=c.link,
                        per_copy_s=c.per_copy_s, per_request_s=float(x[-1]))


def interval_errors(cost: CostModel, samples: list[IntervalSample]) -> list[float]:
    """Relative error of each non-empty interval's prediction (step cost + arrivals x per_request_s)."""
    per_request = cost.profile.coefficients.per_request_s
    return [abs(cost.step_seconds(s.shape) + per_request * s.arrivals - s.seconds) / s.seconds
            for s in samples if s.shape.num_seqs and s.seconds > 0]
