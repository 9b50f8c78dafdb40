"""Calibration maths: the designed batch shapes, and least-squares fits of the step cost model.

``kvbench calibrate`` (:mod:`kvbench.sim.calibration`, which owns the serving loop: this package
never imports kvbench) serves the reference engine over :class:`Design`'s batch shapes on the step
clock, records every step's shape and the *interval* from one step's end to the next (the engine
step plus the driver's per-step work and the releases before it: what a served run's times are made
of), and fits them here with :func:`fit_intervals` (non-negative least squares, in seconds), plus a
per-request term. Timing ``LLMEngine.step()`` alone, the earlier method, missed most of what a served
run spends per step. :func:`fit_error` is the fit's own error report (median and p90
relative error per interval, and R² in seconds). Swap copies are timed on their own
(:func:`fit_swap`, ``Design.swap_blocks``) and fitted to ``per_copy_s + link x bytes / B``. Peak
rates come from two micro benchmarks (:func:`peak_flops`, :func:`copy_bandwidth`), so the fitted
coefficients are "times the ideal" as for the GPU profiles. What a step costs more after the engine sat
idle (``wake_s``, ``wake_tau_s``) is timed on its own too (:func:`fit_wake`: a lone prefill after idle
spells of ``Design.wake_gaps``, against the same prefill right after another step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from reference_engine.costs.cost_model import FEATURES, CostModel, StepShape
from reference_engine.costs.profiles import Coefficients


@dataclass(frozen=True)
class Design:
    """The designed batch shapes. For every (context ``C``, decode batch ``D``) cell: ``D`` requests
    with ``C``-token prompts are prefilled, decode ``decode_steps`` steps alone, then a prefill of
    ``P`` tokens joins the decodes for one step, for every ``P`` in ``prefills``, ``repeats`` times
    each (a decode-only step between joins). Every cell is served ``rounds`` times, rounds
    interleaved (every cell once, then again), so a spell of load on the machine spreads over the
    cells instead of landing on one. Cells whose context is in ``heldout_contexts`` are kept out of
    the fit and report its error. Swaps: batched copies of each of ``swap_blocks`` blocks,
    ``swap_repeats`` times. Waking up: a lone prefill of ``wake_prompt`` tokens after an idle spell of
    each of ``wake_gaps`` seconds, against the same prefill right after another step, ``wake_repeats``
    times (:func:`fit_wake`)."""

    contexts: tuple[int, ...] = (32, 192, 512)
    decode_batches: tuple[int, ...] = (1, 8, 24)
    prefills: tuple[int, ...] = (16, 96, 384)
    decode_steps: int = 5
    repeats: int = 3
    rounds: int = 5
    heldout_contexts: tuple[int, ...] = (192,)
    swap_blocks: tuple[int, ...] = (1, 4, 16, 64)
    swap_repeats: int = 5
    wake_gaps: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
    wake_repeats: int = 5
    wake_prompt: int = 64

    def __post_init__(self) -> None:
        for name in ("contexts", "decode_batches", "prefills", "swap_blocks"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"Design.{name}={values!r} is invalid: expected one or more integers >= 1")
        if not self.wake_gaps or any(isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g)
                                     or g <= 0 for g in self.wake_gaps):
            raise ValueError(f"Design.wake_gaps={self.wake_gaps!r} is invalid: expected one or more idle spells in "
                             "seconds > 0")
        for name in ("decode_steps", "repeats", "rounds", "swap_repeats", "wake_repeats", "wake_prompt"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Design.{name}={value!r} is invalid: expected an integer >= 1")
        if any(c not in self.contexts for c in self.heldout_contexts):
            raise ValueError(f"Design.heldout_contexts={self.heldout_contexts!r} is invalid: each must be one of "
                             f"contexts {self.contexts!r}")
        if not set(self.contexts) - set(self.heldout_contexts):
            raise ValueError(f"Design.heldout_contexts={self.heldout_contexts!r} is invalid: it holds out every "
                             "context, leaving nothing to fit on")

    def cells(self) -> list[tuple[int, int]]:
        """``(context, decode batch)`` per cell, in serving order within a round."""
        return [(c, d) for c in self.contexts for d in self.decode_batches]

    def check_fits(self, max_model_len: int, num_blocks: int, block_size: int) -> None:
        """ValueError naming the field when a cell cannot be served whole on this engine: a request
        longer than ``max_model_len``, or a cell's decodes needing more KV blocks than the pool has
        (a preemption would change the shapes the design asks for)."""
        max_tokens = self.cell_plan(1, 1, max_model_len)[0][2]  # the decodes' output, the same in every cell
        longest = max(self.contexts) + max_tokens
        if longest > max_model_len or max(self.prefills) > max_model_len:
            raise ValueError(f"Design.contexts={self.contexts!r} / prefills={self.prefills!r}: a request of "
                             f"{max(longest, max(self.prefills))} tokens exceeds max_model_len {max_model_len}")
        for context, batch in self.cells():
            blocks = batch * math.ceil((context + max_tokens) / block_size) + math.ceil(max(self.prefills) / block_size)
            if blocks > num_blocks:
                raise ValueError(f"Design.decode_batches={self.decode_batches!r}: the cell (context {context}, "
                                 f"batch {batch}) needs {blocks} KV blocks, the pool has {num_blocks}")

    def cell_plan(self, context: int, batch: int, token_budget: int) -> list[tuple[int, int, int]]:
        """The cell's requests as ``(release step, prompt tokens, max_tokens)``, in release order.

        The decodes are released at step 0 and take ``ceil(batch x context / token_budget)`` steps to
        prefill; each prefill that joins them is released before its step and samples one token. The
        decodes outlive the last join by a step, so every join meets all ``batch`` of them."""
        first = math.ceil(batch * context / token_budget) + self.decode_steps
        joins = [p for p in self.prefills for _ in range(self.repeats)]
        max_tokens = self.decode_steps + 2 * len(joins) + 1
        return [(0, context, max_tokens)] * batch + [(first + 2 * i, p, 1) for i, p in enumerate(joins)]


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


def fit_swap(model_dir: str, design: Design, link_bandwidth: float) -> tuple[float, float]:
    """(per_copy_s, link coefficient) fitted to timed batched swap-outs of ``design.swap_blocks`` blocks."""
    import torch

    from reference_engine.kv_cache import KVCache
    from reference_engine.model import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    n = max(design.swap_blocks)
    kv = KVCache(2 * n, 2 * n, mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32, torch.device("cpu"))
    rows, times = [], []
    for blocks in design.swap_blocks:
        mapping = [(2 * i, 2 * i + 1) for i in range(blocks)]  # scattered ids: the general (gather) path
        for _ in range(design.swap_repeats):
            t0 = time.perf_counter()
            nbytes = kv.swap_out(mapping)
            times.append(time.perf_counter() - t0)
            rows.append([1.0, nbytes / link_bandwidth])
    a, y = np.array(rows), np.array(times)
    per_copy, link = nnls(a / y[:, None], np.ones_like(y))
    return float(per_copy), float(link)


#: time constants :func:`fit_wake_curve` tries (seconds): 1 ms to 1 s, geometric
_WAKE_TAUS = tuple(float(t) for t in np.geomspace(1e-3, 1.0, 61))


@dataclass(frozen=True)
class WakeFit:
    """What :func:`fit_wake` measured and fitted: ``warm_s``, the probe step's median right after another
    step; ``extra_s``, per idle spell (seconds), the median of how much longer the probe took after it;
    ``wake_s`` and ``wake_tau_s``, the fitted curve (both 0: waking up costs nothing measurable here)."""

    wake_s: float
    wake_tau_s: float
    warm_s: float
    extra_s: dict[float, float]

    @classmethod
    def from_fit(cls, coefficients: Coefficients, saved: dict) -> WakeFit:
        """The fit as a profile saves it: its coefficients and ``fit["wake"]``."""
        return cls(coefficients.wake_s, coefficients.wake_tau_s, float(saved["warm_s"]),
                   {float(g): float(e) for g, e in saved["extra_s"].items()})

    def describe(self) -> str:
        spells = ", ".join(f"{g * 1e3:g} ms {e * 1e3:+.2f}" for g, e in sorted(self.extra_s.items()))
        if self.wake_s <= 0:
            return f"none measurable (probe step {self.warm_s * 1e3:.2f} ms warm; after idle spells: {spells} ms)"
        return (f"+{self.wake_s * 1e3:.2f} ms after a long idle spell, 63% of it after {self.wake_tau_s * 1e3:.0f} ms "
                f"(probe step {self.warm_s * 1e3:.2f} ms warm; after idle spells: {spells} ms)")


def fit_wake_curve(extra_s: dict[float, float], warm_s: float,
                   noise: float = 0.05) -> tuple[float, float]:
    """``(wake_s, wake_tau_s)`` of ``wake_s * (1 - exp(-gap / wake_tau_s))`` fitted (least squares; the
    time constant from a grid of 1 ms to 1 s) to ``extra_s`` (idle spell -> extra seconds of the step
    after it), the time constant no longer than the longest spell. ``(0, 0)`` when the longest spells cost no
    more than ``noise`` of the warm step ``warm_s``:
    nothing to model, rather than a curve fitted to noise."""
    gaps = np.array(sorted(extra_s), dtype=float)
    if gaps.size == 0:
        return 0.0, 0.0
    extra = np.array([extra_s[g] for g in sorted(extra_s)], dtype=float)
    if np.median(extra[-2:]) <= noise * warm_s:
        return 0.0, 0.0
    best = (np.inf, 0.0, 0.0)
    # no time constant beyond the longest spell timed: past it the data say nothing about the curve (under
    # load, fits ran to the grid's end and priced a long lull at several times what the longest timed one cost)
    for tau in (t for t in _WAKE_TAUS if t <= gaps[-1]):
        f = -np.expm1(-gaps / tau)
        wake = max(0.0, float(f @ extra) / float(f @ f))
        sse = float(np.sum((wake * f - extra) ** 2))
        if sse < best[0]:
            best = (sse, wake, tau)
    return (best[1], best[2]) if best[1] > 0 else (0.0, 0.0)


def fit_wake(model_dir: str, design: Design, dtype: str = "float32") -> WakeFit:
    """Time a lone prefill of ``design.wake_prompt`` tokens on the reference engine right after another
    step and after each idle spell of ``design.wake_gaps`` (slept), ``design.wake_repeats`` times, and
    fit :func:`fit_wake_curve` to the medians. The engine is built here with a pool of one request."""
    from reference_engine.config import EngineConfig
    from reference_engine.engine import LLMEngine
    from reference_engine.model import ModelConfig
    from reference_engine.sampling_params import SamplingParams

    mc = ModelConfig.from_dir(model_dir)
    prompt = list(range(3, 3 + min(design.wake_prompt, mc.max_position_embeddings - 1)))
    block_size = 16
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, block_size=block_size,
                                    num_gpu_blocks_override=-(-(len(prompt) + 1) // block_size) + 1))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = 0

    def probe() -> float:
        nonlocal count
        count += 1
        engine.add_request(f"wake-{count}", prompt, params)
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return seconds

    for _ in range(3):
        probe()
    warm: list[float] = []
    extra: dict[float, list[float]] = {g: [] for g in design.wake_gaps}
    for _ in range(design.wake_repeats):
        for gap in design.wake_gaps:
            before = probe()
            time.sleep(gap)
            extra[gap].append(probe() - before)
            warm.append(before)
    warm_s = float(np.median(warm))
    medians = {float(g): float(np.median(v)) for g, v in extra.items()}
    wake_s, tau = fit_wake_curve(medians, warm_s)
    return WakeFit(wake_s, tau, warm_s, medians)


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
    served step intervals; swap and wake terms are left at ``cost``'s profile.

    ``relative=False`` (the default) minimises the squared error in seconds, so the predicted
    intervals add up to the measured ones: on a loaded machine an interval is the step's work *plus
    the time the process waited for a core*, a heavy tail (a few intervals many times the median on an
    overloaded 2-core machine) that throughput and TTFT sum over. ``relative=True`` fits the typical step
    instead (relative error, one trimming round dropping intervals more than ``trim`` x off the first fit):
    what the step costs on an idle core, well below the mean there."""
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
    return replace(cost.profile.coefficients, **dict(zip(FEATURES, (float(v) for v in x[:-1]), strict=True)),
                   per_request_s=float(x[-1]))


def interval_errors(cost: CostModel, samples: list[IntervalSample]) -> list[float]:
    """Relative error of each non-empty interval's prediction (step cost + arrivals x per_request_s)."""
    per_request = cost.profile.coefficients.per_request_s
    return [abs(cost.step_seconds(s.shape) + per_request * s.arrivals - s.seconds) / s.seconds
            for s in samples if s.shape.num_seqs and s.seconds > 0]


def fit_error(cost: CostModel, samples: list[IntervalSample]) -> dict[str, float | int | None]:
    """How well ``cost`` (its profile's coefficients) predicts ``samples``' non-empty intervals:
    ``median_rel_error`` and ``p90_rel_error`` (|predicted - measured| / measured per interval),
    ``r2`` (1 - residual / total sum of squares, in seconds; None when every interval is equal),
    ``total_rel_error`` (of the intervals' sum: what a run's throughput sees, and what the fit in
    seconds aims at; on a loaded machine a single interval may be several times its typical length
    while the process waits for a core, so the per-interval errors stay large where the sum is close)
    and ``intervals`` (how many). Every figure is None when there is no interval."""
    rows = [s for s in samples if s.shape.num_seqs and s.seconds > 0]
    if not rows:
        return {"intervals": 0, "median_rel_error": None, "p90_rel_error": None, "r2": None, "total_rel_error": None}
    per_request = cost.profile.coefficients.per_request_s
    measured = np.array([s.seconds for s in rows])
    predicted = np.array([cost.step_seconds(s.shape) + per_request * s.arrivals for s in rows])
    rel = np.abs(predicted - measured) / measured
    total = float(np.sum((measured - measured.mean()) ** 2))
    r2 = 1.0 - float(np.sum((measured - predicted) ** 2)) / total if total > 0 else None
    return {"intervals": len(rows), "median_rel_error": float(np.median(rel)),
            "p90_rel_error": float(np.percentile(rel, 90)), "r2": r2,
            "total_rel_error": float(abs(predicted.sum() - measured.sum()) / measured.sum())}


# ------------------------------------------------------------------------ client-side spans
@dataclass(frozen=True)
class SpanSample:
    """A stretch of time a *client* measured on a server whose steps it cannot see, and the steps
    the server must have run in it: e.g. a lone prompt's TTFT (its prefill chunks, one request taken
    in) or a request's tokens in a steady decode batch (one decode step per token). ``seconds`` is
    predicted as ``sum(step_seconds(shape) for shape in shapes) + arrivals x per_request_s``."""

    shapes: tuple[StepShape, ...]
    arrivals: int
    seconds: float
    group: str = ""


def prefill_steps(prompt: int, budget: int, start: int = 0) -> tuple[StepShape, ...]:
    """The steps a lone prompt of ``prompt`` tokens takes with chunked prefill and a token budget of
    ``budget``: chunks of ``budget`` tokens, the last one sampling the first token."""
    if prompt < 1 or budget < 1:
        raise ValueError(f"prefill_steps: prompt={prompt} and budget={budget} must be >= 1")
    shapes, done = [], 0
    while done < prompt:
        n = min(budget, prompt - done)
        shapes.append(StepShape.of_chunks([(start + done, n, done + n == prompt)]))
        done += n
    return tuple(shapes)


def span_features(cost: CostModel, sample: SpanSample) -> list[float]:
    """The regressors of :data:`FEATURES` summed over the span's steps, then its arrivals (``combine
    == "sum"``: a step's time is linear in the coefficients, so a span's is too)."""
    total = np.zeros(len(FEATURES))
    for shape in sample.shapes:
        total += np.asarray(cost.features(shape))
    return [*total.tolist(), float(sample.arrivals)]


def span_seconds(cost: CostModel, sample: SpanSample) -> float:
    """What ``cost`` (its profile's coefficients) predicts for ``sample``."""
    return (sum(cost.step_seconds(s) for s in sample.shapes)
            + cost.profile.coefficients.per_request_s * sample.arrivals)


def fit_spans(cost: CostModel, samples: list[SpanSample], relative: bool = True) -> Coefficients:
    """Coefficients of :data:`FEATURES` plus ``per_request_s`` fitted (non-negative least squares) to
    client-measured spans; swap and wake terms are left at ``cost``'s profile (a server's swaps are not
    seen from outside). ``relative=True`` (the default) weighs every span alike (spans run from a few ms
    to a second: in seconds the longest would decide alone); ``False`` minimises seconds."""
    if cost.profile.combine != "sum":
        raise ValueError(f"fit_spans: profile {cost.profile.name!r} combines by {cost.profile.combine!r}; "
                         "a linear fit needs combine='sum'")
    rows = [s for s in samples if s.seconds > 0 and any(sh.num_seqs for sh in s.shapes)]
    if len(rows) < len(FEATURES) + 1:
        raise ValueError(f"fit_spans: {len(rows)} spans are too few to fit {len(FEATURES) + 1} terms")
    a = np.array([span_features(cost, s) for s in rows])
    y = np.array([s.seconds for s in rows])
    if relative:
        a, y = a / y[:, None], np.ones_like(y)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of ~1: a well-conditioned active set
    x = nnls(a / scale, y) / scale
    return replace(cost.profile.coefficients, **dict(zip(FEATURES, (float(v) for v in x[:-1]), strict=True)),
                   per_request_s=float(x[-1]))


def span_errors(cost: CostModel, samples: list[SpanSample]) -> list[float]:
    """Relative error of each span's prediction."""
    return [abs(span_seconds(cost, s) - s.seconds) / s.seconds for s in samples if s.seconds > 0]
