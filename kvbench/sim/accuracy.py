"""How accurate a prediction is: one row per figure, judged against the median of interleaved rounds
(the comparison ``kvbench predict`` prints, :mod:`kvbench.sim.predict_engines`).

A simulator's error means something only beside the noise of what it is compared with, so every
row carries the measured rounds themselves: their median (what the prediction is judged against),
and their spread, ``(max - min) / median`` (:func:`kvbench.bench.repeats.relative_range`: how far one
measured round is from another). An error
well inside the spread cannot be told from noise; one far outside it is the model's.

Bars (docs/simulator.md#predicting-a-real-engine-vllm-the-reference-engine): counts within
:data:`COUNT_BAR` (20%), timings within :data:`TIME_BAR` (10%) median error, the knee at the same sweep point.

The knee (:func:`kvbench.bench.scenarios.storms.knee_within`: the first concurrency whose next point
gains less than 5%) is a threshold on a curve that flattens: where a step gains ~5%, a few per cent of
noise moves it a whole sweep point, and single rounds' knees disagree with each other. Beside the
strict verdict (the predicted knee equals the knee of the rounds' medians) :func:`knee_range` says
which knees the rounds allow: a step is *rising* when every round gained at least 5% across it,
*flat* when none did, and *undecided* otherwise (gains taken within a round, so a round's load,
common to both points, cancels); the knee lies between the first step not rising and the first flat
one. A predicted knee inside that range is "consistent with the rounds"; one outside is a miss that
no round supports.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.bench.formatting import fmt_figure, fmt_median_range, fmt_share
from kvbench.bench.repeats import relative_range

COUNT_BAR = 0.20
TIME_BAR = 0.10


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``|predicted - measured| / measured``; 0 when both are 0; None when undefined."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return abs(predicted - measured) / abs(measured)


@dataclass(frozen=True)
class Row:
    """One figure of one engine: ``kind`` is "count" or "time" (which bar applies)."""

    engine: str
    scenario: str
    metric: str
    kind: str
    predicted: float | None
    rounds: tuple[float | None, ...]

    @property
    def measured(self) -> float | None:
        values = [v for v in self.rounds if v is not None]
        return statistics.median(values) if values else None

    @property
    def error(self) -> float | None:
        return relative_error(self.predicted, self.measured)

    @property
    def rounds_range(self) -> float | None:
        """The rounds' ``(max - min) / median`` (:func:`~kvbench.bench.repeats.relative_range`)."""
        return relative_range(self.rounds)

    @property
    def bar(self) -> float:
        return COUNT_BAR if self.kind == "count" else TIME_BAR

    @property
    def within(self) -> bool | None:
        e = self.error
        return None if e is None else e <= self.bar

    @property
    def noise_dominated(self) -> bool | None:
        """The error is no larger than the rounds' own spread: noise cannot be ruled out."""
        e, s = self.error, self.rounds_range
        return None if e is None or s is None else e <= s


def knee_row(engine: str, predicted: float | None, measured_rounds: Sequence[float | None],
             measured_of_medians: float | None,
             allowed: tuple[float | None, float | None] | None = None) -> list[str]:
    """Cells for the knee: predicted, the knee of the rounds' median throughputs, each round's knee,
    whether the first two agree, and (with ``allowed``, :func:`knee_range`) the knees the rounds allow
    and whether the prediction is among them."""
    cells = [engine, _knee(predicted), _knee(measured_of_medians), " ".join(_knee(k) for k in measured_rounds),
             "same" if predicted == measured_of_medians else "DIFFERENT"]
    if allowed is not None:
        cells += [f"{_knee(allowed[0])} to {_knee(allowed[1])}",
                  "consistent" if knee_consistent(predicted, allowed) else "INCONSISTENT"]
    return cells


def knee_range(xs: Sequence[float], rounds: Sequence[Sequence[float | None]],
               min_gain: float = 0.05) -> tuple[float | None, float | None]:
    """(earliest, latest) knee the measured ``rounds`` (each a throughput per ``xs``) allow, None for "no
    knee within the sweep" (see the module docstring). A step with a missing value in some round is
    judged on the rounds that have both points; one without any is undecided."""
    lo = hi = None
    for i in range(len(xs) - 1):
        gains = [r[i + 1] / r[i] - 1 for r in rounds if r[i] and r[i + 1] is not None]
        rising = bool(gains) and min(gains) >= min_gain
        flat = bool(gains) and max(gains) < min_gain
        if lo is None and not rising:
            lo = xs[i]
        if flat:
            hi = xs[i]
            break
    return lo, hi


def knee_consistent(predicted: float | None, allowed: tuple[float | None, float | None]) -> bool:
    """Whether ``predicted`` (None: no knee within the sweep) lies within :func:`knee_range`'s ``allowed``."""
    lo, hi = allowed
    inf = float("inf")
    p = inf if predicted is None else predicted
    return (inf if lo is None else lo) <= p <= (inf if hi is None else hi)


def _knee(k: float | None) -> str:
    return "none" if k is None else f"{k:g}"


#: how a figure of each kind is written: counts whole, times to four significant digits
_FORMATS = {"count": "{:,.0f}", "time": "{:.4g}"}


def table(rows: Sequence[Row]) -> str:
    """A markdown table: predicted, median of rounds [min-max], error, the rounds' spread, verdict."""
    out = ["| engine | scenario | metric | predicted | measured median [min-max] | error | rounds' spread | "
           "bar | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vals = [v for v in r.rounds if v is not None]
        measured = fmt_median_range(vals, _FORMATS[r.kind]) if vals else "-"
        verdict = {True: "within", False: "MISS", None: "-"}[r.within]
        if r.within is False and r.noise_dominated:
            verdict += " (within noise)"
        predicted = fmt_figure(r.predicted, _FORMATS[r.kind], "-")
        error, rounds_range = fmt_share(r.error, "-"), fmt_share(r.rounds_range, "-")
        out.append(f"| {r.engine} | {r.scenario} | {r.metric} | {predicted} | {measured} | {error} | "
                   f"{rounds_range} | {r.bar:.0%} | {verdict} |")
    return "\n".join(out)


def median_error(rows: Sequence[Row], kind: str) -> tuple[float | None, float | None]:
    """(median error, median spread) over the rows of ``kind`` that have both."""
    pairs = [(r.error, r.rounds_range) for r in rows if r.kind == kind and r.error is not None]
    if not pairs:
        return None, None
    spreads = [s for _, s in pairs if s is not None]
    return statistics.median(e for e, _ in pairs), (statistics.median(spreads) if spreads else None)
