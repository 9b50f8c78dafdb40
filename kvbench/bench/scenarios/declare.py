"""What a scenario declares about itself for the report: the pressure it creates on purpose, the
metric its scoreboard ranks engines by, and its headline.

The report knows no scenario by name: it reads these declarations (``Scenario.pressure``,
``Scenario.score``, ``Scenario.headline``), so a new scenario brings its workload, claims,
headline and expected pressure in its own module and nothing in :mod:`kvbench.report` changes.

Noise. Absolute times and ratios of them are compared with the noise they carry:

* when a result holds repeats (see :func:`relative_spread`), their spread relative to the median
  is the noise of that metric;
* otherwise the figure is a single run and says so;
* times below :data:`NOISE_FLOOR_S` are inside the noise of a shared 2-core machine whatever the
  repeats say: a swap-vs-recompute crossover where both costs sit below it moves from run to run by
  more than the repeats' spread suggests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.bench.repeats import repeat_values, result_spread

#: times below this are inside the noise of one step on a shared machine (seconds)
NOISE_FLOOR_S = 0.002
#: a ratio within this of 1 is "about the same" even without repeats (timer and scheduling jitter)
MIN_RATIO_NOISE = 0.02
#: ends a claim about times that is decided only on the simulator's cost clock (None elsewhere): the
#: schedule-only checks (tests/kvbench/test_scenarios.py) leave such claims out
COST_CLOCK_CLAIM = "(simulated cost clock)"


@dataclass(frozen=True)
class Pressure:
    """The pressure a scenario creates on purpose; the diagnosis judges deviations from it.

    ``preemptions``: the pool is driven past capacity, preemptions are the point.
    ``kv_pinned``: KV usage near 100% is expected. ``starvation``: some requests wait on purpose
    (offline work under a priority policy). ``forced_mode``: the scenario sets the preemption mode
    itself, whatever the engine's own setting (its swap figures say nothing about a recompute
    engine's configuration). ``swap_fallback``: running out of host swap space is the point.
    Surges record ``preemptions_before_surge``: preemptions there are not part of the declared
    pressure (a structural capacity gap rather than the safety net: docs/benchmarks.md#diagnosis).
    """

    preemptions: bool = False
    kv_pinned: bool = False
    starvation: bool = False
    forced_mode: str | None = None
    swap_fallback: bool = False

    def describe(self) -> list[str]:
        """The declaration in words, for the report ("preemptions expected", ...)."""
        out = []
        if self.preemptions:
            out.append("preemptions expected")
        else:
            out.append("no preemption expected")
        if self.kv_pinned:
            out.append("KV pinned near 100% expected")
        if self.starvation:
            out.append("waiting preempted requests expected")
        if self.forced_mode:
            out.append(f"preemption mode forced: {self.forced_mode}")
        if self.swap_fallback:
            out.append("swap fallback to recompute expected")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"preemptions": self.preemptions, "kv_pinned": self.kv_pinned, "starvation": self.starvation,
                "forced_mode": self.forced_mode, "swap_fallback": self.swap_fallback}


@dataclass(frozen=True)
class Score:
    """The metric the scoreboard ranks engines by in one scenario (in result ``mode``; None: the
    result without a mode)."""

    metric: str
    higher_is_better: bool
    mode: str | None = None
    label: str = ""
    #: why this metric decides the scenario (shown beside the verdict on the report's first screen)
    why: str = ""


@dataclass(frozen=True)
class Headline:
    """One card of the report's first screen. ``value`` None: not measured (``caption`` says why).
    ``within_noise``: the figure is inside the noise, and ``value`` says so instead of a number."""

    title: str
    value: str | None
    caption: str
    detail: str = ""
    within_noise: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "value": self.value if self.value is not None else "not measured",
                "measured": self.value is not None, "caption": self.caption, "detail": self.detail,
                "within_noise": self.within_noise}


# --------------------------------------------------------------------------------------------
# reading recorded results (plain dicts from results.json)


def num(value: Any) -> float | None:
    """A finite float, or None (missing, NaN, not a number)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def result_of(scenario: Mapping[str, Any], engine: str, mode: str | None = None) -> dict[str, Any] | None:
    """The recorded result of ``engine`` in ``mode`` in a results-file scenario dict."""
    return next((r for r in scenario.get("results", []) if r["engine"] == engine and r.get("mode") == mode), None)


def metric_of(scenario: Mapping[str, Any], engine: str, metric: str, mode: str | None = None) -> float | None:
    r = result_of(scenario, engine, mode)
    return num(r["metrics"].get(metric)) if r else None


def relative_spread(result: Mapping[str, Any] | None, metric: str) -> float | None:
    """One measurement's spread of ``metric`` relative to its median (:func:`kvbench.bench.repeats.result_spread`
    over the median), or None for a single run or a median of 0."""
    if not result or len(repeat_values(result, metric)) < 2:
        return None
    med = num(result.get("metrics", {}).get(metric))
    med = med if med is not None else statistics.median(repeat_values(result, metric))
    return abs(result_spread(result, metric) / med) if med else None


def ratio_noise(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, metric: str) -> float | None:
    """The relative noise of ``a / b`` of ``metric``: twice the two relative spreads added (about two
    standard deviations each way), None when both are single runs."""
    sa, sb = relative_spread(a, metric), relative_spread(b, metric)
    if sa is None and sb is None:
        return None
    return 2 * ((sa or 0.0) + (sb or 0.0))


def noise_words(noise: float | None) -> str:
    """"±12% (spread of repeats)" or "single run"."""
    return "single run" if noise is None else f"±{noise * 100:.0f}% (spread of repeats)"


def within_noise(ratio: float | None, noise: float | None) -> bool:
    """Whether a ratio is indistinguishable from 1 given ``noise`` (a single run still has jitter)."""
    if ratio is None:
        return False
    if ratio <= 0:
        return False
    # symmetric in the ratio's direction: 0.41× and its inverse 2.4× with the same ±95% get one verdict
    # (a plain |ratio - 1| test called the first within the noise and the second beyond it)
    return abs(math.log(ratio)) <= math.log1p(max(noise or 0.0, MIN_RATIO_NOISE))


def plural(n: float, word: str, many: str | None = None) -> str:
    """"1 time", "3 times", "1,024 tokens"."""
    value = f"{n:,.0f}" if float(n) == int(n) else f"{n:,.3g}"
    return f"{value} {word if float(n) == 1 else (many or word + 's')}"


# --------------------------------------------------------------------------------------------
# headline helpers shared by the scenarios


def is_time(metric: str) -> bool:
    return metric.split("_")[0] in ("ttft", "tbt", "tpot", "e2e", "starvation", "cost") or metric.endswith("_s")


def others_first(engines: Sequence[str], reference: str | None) -> list[str]:
    """Engines other than ``reference``, another kind (a name not ``reference:...``) first."""
    rest = [e for e in engines if e != reference]
    if reference is None:
        return rest
    return sorted(rest, key=lambda e: e.startswith(reference + ":"))


def engines_reference_first(recorded: Mapping[str, Any], reference: str | None) -> list[str]:
    """The engines a scenario recorded, each once: ``reference`` first (when it ran), then the others
    in the order they were recorded."""
    engines = list(dict.fromkeys(r["engine"] for r in recorded.get("results", [])))
    return ([reference] if reference in engines else []) + [e for e in engines if e != reference]


def ratio_headline(recorded: Mapping[str, Any], reference: str | None, *, title: str, metric: str, what: str,
                   mode: str | None = None) -> Headline:
    """"<other> ÷ <reference> <what>" as a same-run ratio with its noise, or "within noise"."""
    from kvbench.bench.formatting import fmt_metric, fmt_noisy_ratio

    engines = list(dict.fromkeys(r["engine"] for r in recorded.get("results", []) if r.get("mode") == mode))
    base = result_of(recorded, reference, mode) if reference else None
    b = num(base["metrics"].get(metric)) if base else None
    for other in others_first(engines, reference):
        o_res = result_of(recorded, other, mode)
        o = num(o_res["metrics"].get(metric)) if o_res else None
        if o is None or not b:
            continue
        ratio, noise = o / b, ratio_noise(o_res, base, metric)
        detail = f"{reference} {fmt_metric(metric, b)}; {other} {fmt_metric(metric, o)} · {noise_words(noise)}"
        small = is_time(metric) and max(o, b) < NOISE_FLOOR_S
        if small or within_noise(ratio, noise):
            return Headline(title, "within noise",
                            f"{other} ÷ {reference} {what}: {fmt_noisy_ratio(ratio, noise)}", detail,
                            within_noise=True)
        return Headline(title, fmt_noisy_ratio(ratio, noise), f"{other} ÷ {reference} {what}", detail)
    return Headline(title, None, f"needs {what} of the reference and another engine")
