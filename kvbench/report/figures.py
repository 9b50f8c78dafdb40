"""Figures the report shows, each computed once and read everywhere it appears.

Two kinds of helpers live here:

* **Noise-aware comparisons.** :func:`compare` turns two results' medians of one metric into a
  :class:`Comparison`: the ratio, its noise (twice both repeats' relative spreads,
  :func:`~kvbench.bench.scenarios.declare.ratio_noise`, as every headline's ±), whether it lies beyond
  that noise, better or worse *in words* (colour alone does not carry it), and its text with as many
  digits as the noise allows ("21× ±18%", not "20.95×": :func:`~kvbench.bench.formatting.fmt_noisy_ratio`).
  A zero denominator has no ratio ("–"); two results on different clocks have no comparison at all,
  and say why.
* **Facts of a run.** :class:`Facts` computes the knee of every concurrency sweep and the swap-vs-
  recompute crossover of every engine from the medians of the repeats, once; the tables, charts,
  headlines and diagnosis read these values (a test renders a page and checks no fact shows two values).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench import gate, metrics, repeats
from kvbench.bench.formatting import fmt_metric, fmt_noisy_ratio
from kvbench.bench.results import COST_METRICS, Results
from kvbench.bench.scenarios.declare import MIN_RATIO_NOISE, NOISE_FLOOR_S, is_time, num, ratio_noise, within_noise
from kvbench.core import delivery

#: the sweep whose throughput curve has a knee
KNEE_SWEEP = "concurrency"
#: run-time copies of facts the report computes itself from the medians (a parameter or extra
#: figure recorded from the first repeat would otherwise show a second value beside the fact)
DERIVED_KEYS = frozenset({"crossover_seq_len", "knee_concurrency"})


# --------------------------------------------------------------------------------------------
# numbers with their noise


def count_range(result: Mapping[str, Any] | None, metric: str) -> tuple[float, float] | None:
    """(lowest, highest) of a count that differed between repeats, else None (one value: the median)."""
    if not result or not repeats.is_count(metric):
        return None
    vals = [v for rep in (result.get("repeats") or []) if isinstance(rep, Mapping)
            if (v := num(rep.get("metrics", rep).get(metric) if isinstance(rep.get("metrics", rep), Mapping)
                         else None)) is not None]
    if len(vals) < 2 or min(vals) == max(vals):
        return None
    return min(vals), max(vals)


def fmt_value(metric: str, result: Mapping[str, Any] | None, compact: bool = False) -> str:
    """A result's figure as the page shows it: the median, or "2–4" for a count that varied across repeats; a gap
    figure of an engine that delivered its tokens in bursts is marked not comparable (:mod:`kvbench.core.delivery`;
    ``compact``: with :data:`~kvbench.core.delivery.CELL_MARK`, for a table cell whose table says why)."""
    if result is None:
        return fmt_metric(metric, None)
    span = count_range(result, metric)
    if span is not None:
        text = f"{fmt_metric(metric, span[0])}–{fmt_metric(metric, span[1])}"
    else:
        text = fmt_metric(metric, result.get("metrics", {}).get(metric))
    bursts = delivery.not_comparable(metric, result)
    if not bursts or result.get("metrics", {}).get(metric) is None:
        return text
    return f"{text} {delivery.CELL_MARK}" if compact else f"{text}, {bursts}"


def clock_of(result: Mapping[str, Any]) -> str:
    """"step" or "wall": how the result's arrivals were released (older results: wall)."""
    clock = result.get("clock")
    return str(clock.get("clock", "wall")) if isinstance(clock, Mapping) else "wall"


def clocks_differ(sc: Mapping[str, Any] | None, *results: Mapping[str, Any]) -> str:
    """Why ``results`` (of scenario ``sc``) are not like for like ("" when they are): they ran on two
    clocks. Never compared, closed loop or not: on the step clock idle gaps are jumped and arrivals come
    by engine step, while one of the engines stepped in lockstep with another, so even a closed loop's
    times answer another question than the wall clock's (a run decides one clock for all its engines,
    :mod:`kvbench.bench.clock_rule`; two clocks meet only in files merged from several runs)."""
    clocks = sorted({clock_of(r) for r in results})
    if len(clocks) < 2:
        return ""
    return f"different clocks ({' vs '.join(clocks)}): measured under different rules, not compared"


def clock_groups(results: list[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Engines by the clock they ran on, e.g. {"step": ["reference"], "wall": ["hf-cb"]} (each engine once)."""
    groups: dict[str, list[str]] = {}
    for r in results:
        names = groups.setdefault(clock_of(r), [])
        if r.get("engine") not in names:
            names.append(str(r.get("engine")))
    return groups


def mixed_clocks_words(results: list[Mapping[str, Any]]) -> str:
    """"" when ``results`` share one clock, else a sentence naming which engine ran on which clock."""
    groups = clock_groups(results)
    if len(groups) < 2:
        return ""
    return ("this results file mixes clocks (" + "; ".join(f"{c} clock: {', '.join(n)}" for c, n in
                                                          sorted(groups.items()))
            + "), as a file from before the one-clock rule or one merged from separate runs can: figures from "
              "two clocks are not compared here")


@dataclass(frozen=True)
class Comparison:
    """``a ÷ b`` of one metric with its noise. ``ratio`` None: no ratio (a zero or missing side);
    ``not_comparable``: why no ratio may be drawn at all (different clocks)."""

    metric: str
    a: float | None
    b: float | None
    ratio: float | None
    noise: float | None
    not_comparable: str = ""

    @property
    def beyond_noise(self) -> bool:
        if self.ratio is None or self.not_comparable:
            return False
        if is_time(self.metric) and max(abs(self.a or 0.0), abs(self.b or 0.0)) < NOISE_FLOOR_S:
            return False  # both under one step's jitter on a shared machine
        return not within_noise(self.ratio, self.noise)

    @property
    def verdict(self) -> str:
        """"better", "worse" (for ``a``, beyond the noise), "within noise", "not comparable" or "n/a"."""
        if self.not_comparable:
            return "not comparable"
        if self.ratio is None:
            return "n/a"
        if not self.beyond_noise:
            return "within noise"
        return "better" if (self.ratio > 1) == (self.metric in gate.HIGHER_IS_BETTER) else "worse"

    @property
    def cls(self) -> str:
        """CSS class: good / bad beyond the noise, same within it, na otherwise."""
        return {"better": "good", "worse": "bad", "within noise": "same"}.get(self.verdict, "na")

    @property
    def symbol(self) -> str:
        return {"better": "▲ better", "worse": "▼ worse", "within noise": "≈", "not comparable": "≠ clock"}.get(
            self.verdict, "")

    @property
    def text(self) -> str:
        if self.not_comparable:
            return "not compared"
        return fmt_noisy_ratio(self.ratio, self.noise)


def compare(metric: str, a: Mapping[str, Any] | None, b: Mapping[str, Any] | None,
            sc: Mapping[str, Any] | None = None) -> Comparison:
    """``a ÷ b`` of ``metric`` from two recorded results (their medians), with the noise of their repeats;
    not comparable when ``sc`` is given and they ran on different clocks in an open-loop scenario."""
    va = num(a["metrics"].get(metric)) if a else None
    vb = num(b["metrics"].get(metric)) if b else None
    why = clocks_differ(sc, a, b) if (sc is not None and a and b) else ""
    # a gap figure of an engine that delivered in bursts measures its writer: no ratio with anyone's
    why = why or delivery.not_comparable_among(metric, [r for r in (a, b) if r])
    ratio = va / vb if (va is not None and vb) else None
    return Comparison(metric, va, vb, ratio, ratio_noise(a, b, metric), why)


# --------------------------------------------------------------------------------------------
# facts of a run


@dataclass(frozen=True)
class Knee:
    """Where throughput stops rising in one engine's concurrency sweep (``x`` None: still rising at
    the top, ``lo``..``hi``)."""

    scenario: str
    engine: str
    mode: str | None
    x: float | None
    lo: float
    hi: float
    x_label: str

    @property
    def label(self) -> str:
        return self.engine + (f" [{self.mode}]" if self.mode else "")

    @property
    def text(self) -> str:
        return f"{self.x:g}" if self.x is not None else f"none within {self.lo:g}–{self.hi:g}"


@dataclass(frozen=True)
class Crossover:
    """Where one engine's swap and recompute costs meet (``x`` None: they never do within the sweep)."""

    scenario: str
    engine: str
    metric: str
    x_label: str
    xs: tuple[float, ...]
    swap: tuple[float, ...]
    recompute: tuple[float, ...]
    x: float | None

    @property
    def text(self) -> str:
        return f"{self.x:,.0f}" if self.x is not None else "none"

    @property
    def within_noise(self) -> bool:
        """Both costs under the noise floor on both sides of the crossing: its place is jitter."""
        if self.x is None:
            return False
        i = next((i for i, v in enumerate(self.xs) if v >= self.x), len(self.xs) - 1)
        lo = max(0, i - 1)
        return max(self.swap[lo], self.recompute[lo], self.swap[i], self.recompute[i]) < NOISE_FLOOR_S

    def cheaper_at(self, x: float) -> str | None:
        """The cheaper mode at the measured length nearest ``x`` (None: within the noise floor there)."""
        i = min(range(len(self.xs)), key=lambda j: abs(self.xs[j] - x))
        s, r = self.swap[i], self.recompute[i]
        if max(s, r) < NOISE_FLOOR_S or abs(s - r) <= MIN_RATIO_NOISE * max(s, r):
            return None
        return "swap" if s < r else "recompute"

    @property
    def above(self) -> str:
        """The mode cheaper at the longest length measured."""
        return "swap" if self.swap[-1] < self.recompute[-1] else "recompute"


def cost_curves(sweep: Mapping[str, Any], engine: str) -> tuple[str | None, dict[str, list[tuple[float, float]]]]:
    """(cost metric, {mode: sorted (x, cost)}) of one engine's swap/recompute points in a sweep."""
    pts = [p for p in sweep["points"] if p["engine"] == engine and p.get("mode") in ("swap", "recompute")]
    metric = next((m for m in COST_METRICS if any(num(p["metrics"].get(m)) is not None for p in pts)), None)
    curves: dict[str, list[tuple[float, float]]] = {}
    if metric:
        for p in pts:
            v = num(p["metrics"].get(metric))
            if v is not None:
                curves.setdefault(p["mode"], []).append((float(p["x"]), v))
    return metric, {m: sorted(c) for m, c in curves.items()}


def is_cost_sweep(sweep: Mapping[str, Any]) -> bool:
    return {p.get("mode") for p in sweep["points"]} >= {"swap", "recompute"}


@dataclass
class Facts:
    """The run's knees and crossovers, from the medians of the repeats (see the module docstring)."""

    knees: dict[tuple[str, str, str | None], Knee] = field(default_factory=dict)
    crossovers: dict[str, Crossover] = field(default_factory=dict)  # by engine: the first sweep that has both

    @classmethod
    def of(cls, results: Results) -> Facts:
        facts = cls()
        for sc in results.scenarios:
            for sw in sc["sweeps"]:
                if is_cost_sweep(sw):
                    facts._add_crossovers(sc["name"], sw)
                elif sw["name"] == KNEE_SWEEP:
                    facts._add_knees(sc["name"], sw)
        return facts

    def _add_knees(self, scenario: str, sw: Mapping[str, Any]) -> None:
        groups: dict[tuple[str, str | None], list[dict]] = {}
        for p in sw["points"]:
            groups.setdefault((p["engine"], p.get("mode")), []).append(p)
        for (engine, mode), pts in groups.items():
            pts = sorted((p for p in pts if num(p["metrics"].get("output_throughput")) is not None),
                         key=lambda p: float(p["x"]))
            if len(pts) < 2:
                continue
            xs = [float(p["x"]) for p in pts]
            k = metrics.knee(xs, [p["metrics"]["output_throughput"] for p in pts])
            self.knees[(scenario, engine, mode)] = Knee(scenario, engine, mode, None if k == xs[-1] else k,
                                                        xs[0], xs[-1], sw.get("x_label") or sw["name"])

    def _add_crossovers(self, scenario: str, sw: Mapping[str, Any]) -> None:
        for engine in dict.fromkeys(p["engine"] for p in sw["points"]):
            if engine in self.crossovers:
                continue
            metric, curves = cost_curves(sw, engine)
            if not metric or "swap" not in curves or "recompute" not in curves:
                continue
            s, r = dict(curves["swap"]), dict(curves["recompute"])
            xs = sorted(set(s) & set(r))
            if not xs:
                continue
            sv, rv = [s[x] for x in xs], [r[x] for x in xs]
            self.crossovers[engine] = Crossover(scenario, engine, metric, sw.get("x_label") or sw["name"],
                                                tuple(xs), tuple(sv), tuple(rv), metrics.crossover(xs, sv, rv))

    def knee(self, scenario: str, engine: str, mode: str | None = None) -> Knee | None:
        return self.knees.get((scenario, engine, mode))

    def first_knee(self, engine: str) -> Knee | None:
        """The engine's knee in the first concurrency sweep that has one for it (any mode but swap)."""
        return next((k for (_, e, m), k in self.knees.items() if e == engine and m != "swap"), None)
