"""The regression gate: compare a run against a baseline with thresholds written as expressions.

What is compared, and how (:func:`gate`):

* **Counts exactly.** A count the schedule alone fixes (:data:`kvbench.bench.repeats.COUNT_METRICS`:
  preemptions, recomputed tokens, swaps, prefix hits...) measured on the step clock in both runs
  (``clock.exact_counts``) is identical run to run on a deterministic engine, so its threshold is
  applied to the values as they are: ``preemptions:+0`` fails on one preemption more.
* **Times with statistics.** Every other figure, and the counts of engines that cannot be stepped
  from outside (servers, engines with their own loop thread), is compared median to median; a
  change is a regression only if it crosses the threshold **and** exceeds the noise floor
  (:func:`noise_floor`)::

      max(noise_k x sqrt((spread_baseline**2 + spread_current**2) / 2),  min_noise x |baseline|)

  with the spreads of the repeats (:mod:`kvbench.bench.repeats`), ``noise_k`` 3, and
  ``min_noise`` :data:`MIN_NOISE` (10%), or :data:`MIN_NOISE_TAIL` (20%) for a tail
  (``*_p90``, ``*_p99``, ``*_max``, spikes: :func:`kvbench.bench.repeats.is_tail`).
* **Ratios by default, per repeat.** A time is gated as a same-run ratio to the reference engine
  (the one named ``reference``, else the first of kind ``reference``) in the same scenario and
  mode of the same run. The benchmarks serve repeat i of every engine in the same round, the
  reference engine's steps and the other engines' in turn
  (:func:`kvbench.bench.scenarios.run_interleaved`), so the gate divides repeat by repeat
  (:func:`paired_ratios`: ``ratio_i = engine_i / reference_i``) and compares the **median of
  the ratios**, with **their** spread. A machine whose load drifts over the minutes of a run moves
  both sides of each ratio and cancels out; a ratio of medians would pair measurements taken
  minutes apart. Results whose repeats do not pair up (older files) fall back to the ratio of the
  medians with the spread propagated from both. The reference engine's own times are not gated,
  nor times in a run without a reference engine. Absolute times are gated only when asked:
  ``absolute=True`` (``--gate-absolute``), or per threshold with the prefix ``abs:``
  (``abs:throughput:-10%``), or a threshold in the metric's unit (no ``%``: ``abs`` is implied).
* **Nothing missing.** Every result of the baseline (scenario, engine, mode) must be in the current
  run, and every thresholded metric the baseline has must have a value; anything missing fails the
  gate and is named. Results only in the current run are listed, not failed.
* **One clock per comparison.** A result measured on one clock in the baseline and on another in the
  current run (:mod:`kvbench.bench.clock_rule`: a session with any engine that cannot be stepped runs
  all of them on the wall clock) is **set aside**: not compared, neither a pass nor a fail, and named
  in the verdict (:class:`SetAside`, one note per reason). Two step clocks of different
  ``step_seconds`` count as different clocks (the same workload becomes another schedule of
  arrivals by step). A same-run ratio whose engine and reference engine ran on different clocks
  inside one run (a file from before the one-clock rule, or merged from two runs) is set aside the
  same way: it would divide a figure of one clock by a figure of the other. No figure is treated as
  clock-free, counts included: preemptions, recomputed tokens, swaps and prefix hits follow from which
  requests share the engine at each step, which the release of arrivals decides (by engine step on one
  clock, by elapsed seconds on the other: at 1 ms a step the wall clock releases a surge ten times
  sooner, in steps, than the step clock at 0.01 s a step); only a workload released all at once would
  be immune, and a results file does not say that a workload was.
* **Never a silent pass.** A gate that compared nothing at all (every result set aside, or no
  thresholded metric with a value on both sides) fails, and says why (:attr:`Verdict.nothing_compared`).

Why these numbers (measured on a 2-core machine at load average ~12, flash crowd at quick scale,
reference engine in both preemption modes, 3 repeats): served one engine after the other, the
per-repeat throughput ratio spread +-20% within a run; served in lockstep, +-3%, and p99 TTFT
and p99 TBT ratios +-5%. Other scenarios' tails moved more (evening surge p99 TBT +-24%; the
preemption storm's p99 TTFT, a maximum of 16 values, by 3x), while its throughput stayed within
+-3%. Hence:

* a **minimum floor** (10%, tails 20%): the spread of 3 repeats is itself a rough estimate (three
  values that happen to agree claim a noise near 0), and a run's load still shifts between
  baseline and current in ways a within-run spread never sees;
* ``noise_k`` 3: with half the range of 3 repeats as the spread, 3 spreads is about the full
  range of the two runs' repeats; a change inside that cannot be told from noise;
* **p99 kept, with a wider default threshold** (+25%, not +20%) rather than p90: on these
  workloads TBT is bimodal (decode-only steps ~2 ms, steps with a prefill ~12 ms), and p90 sits on
  the cliff between the modes (its ratio moved 0.72 -> 1.49 between repeats), while p99 lies inside
  the upper mode. Where a scenario's tail is noisier, its spread raises its own floor.

Syntax: ``[abs:]NAME:[+|-]NUMBER[%]``

* ``throughput:-10%``  fail if the metric *drops* by more than 10% of the baseline
* ``p99_tbt:+20%``     fail if it *rises* by more than 20%
* ``preemptions:+0``   fail on any absolute increase (no ``%``: the number is in the metric's unit)
* no sign: the bad direction of the metric is used (``throughput:10%`` == ``throughput:-10%``)

Relative changes are ``(current - baseline) / |baseline|``. A baseline of 0 with a different
current value is an infinite relative change (so ``preemptions:+50%`` fails when 0 becomes 3).
A metric None in the baseline is not compared; None in the current run while the baseline has it
is a missing result (:class:`Missing`).

NAME is a short name from :data:`SHORT_NAMES` or any key of :func:`kvbench.bench.metrics.summarize`
(``pNN_name`` is also read as ``name_pNN``). Short names:

==================  ===========================  ============
short name          metric key                   bad when
==================  ===========================  ============
throughput          output_throughput            lower
total_throughput    total_throughput             lower
request_throughput  request_throughput           lower
goodput             goodput                      lower
ttft, p99_ttft      ttft_p99                     higher
p50_ttft, p90_ttft  ttft_p50, ttft_p90           higher
tbt, p99_tbt        tbt_p99                      higher
p50_tbt, p90_tbt    tbt_p50, tbt_p90             higher
tpot, p99_tpot      tpot_p99                     higher
e2e, p99_e2e        e2e_p99                      higher
preemptions         preemptions                  higher
recompute           recomputed_tokens            higher
recompute_share     recomputed_share             higher
spikes              tbt_spikes                   higher
starvation          starvation_max_s             higher
swap_bandwidth      swap_bandwidth               lower
hit_rate            prefix_hit_rate              lower
kv_usage            kv_usage_mean                higher
==================  ===========================  ============
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.bench.metrics import GOODPUT_KEYS, METRIC_KEYS
from kvbench.bench.repeats import is_count, is_tail, result_spread
from kvbench.bench.repeats import median as repeat_median
from kvbench.bench.repeats import spread as repeat_spread
from kvbench.bench.results import Results

SHORT_NAMES: dict[str, str] = {
    "throughput": "output_throughput",
    "ttft": "ttft_p99",
    "tbt": "tbt_p99",
    "tpot": "tpot_p99",
    "e2e": "e2e_p99",
    "recompute": "recomputed_tokens",
    "recompute_share": "recomputed_share",
    "spikes": "tbt_spikes",
    "starvation": "starvation_max_s",
    "hit_rate": "prefix_hit_rate",
    "kv_usage": "kv_usage_mean",
}

#: metrics where a higher value is better; every other metric is better lower
HIGHER_IS_BETTER = frozenset({
    "output_throughput", "total_throughput", "request_throughput", "goodput", "goodput_rps",
    "swap_bandwidth", "prefix_hit_rate", "prefix_cache_hits",
})

#: used when no ``--threshold`` is given: times as same-run ratios with a noise floor, counts
#: exactly (on the step clock) - one preemption, recomputed token or swap more, one prefix hit fewer
DEFAULT_THRESHOLDS: tuple[str, ...] = ("throughput:-10%", "p99_ttft:+25%", "p99_tbt:+25%", "preemptions:+0",
                                       "recompute:+0", "swap_outs:+0", "prefix_cache_hits:-0")
#: how many pooled spreads a change of a time must exceed to count (see the module docstring)
NOISE_K = 3.0
#: the smallest noise floor of a statistically gated value, as a fraction of its baseline (see the module docstring)
MIN_NOISE = 0.10
#: the same for a tail (p90, p99, max, spikes: :func:`kvbench.bench.repeats.is_tail`), which a few samples decide
MIN_NOISE_TAIL = 0.20

_KNOWN = frozenset(METRIC_KEYS) | frozenset(GOODPUT_KEYS)
_EXPR_RE = re.compile(r"^\s*(?P<abs>abs\s*:\s*)?(?P<name>[A-Za-z0-9_]+)\s*:\s*"
                      r"(?P<sign>[+-])?(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<pct>%)?\s*$")
_PCT_NAME_RE = re.compile(r"^p(?P<pct>\d{2})_(?P<base>[a-z0-9]+)$")


class ThresholdError(ValueError):
    """A threshold expression could not be parsed."""


def resolve_metric(name: str) -> str:
    """Short name or metric key -> metric key. Raises ThresholdError for unknown names."""
    key = name.strip().lower()
    if key in SHORT_NAMES:
        return SHORT_NAMES[key]
    if key in _KNOWN:
        return key
    m = _PCT_NAME_RE.match(key)
    if m and f"{m['base']}_p{m['pct']}" in _KNOWN:
        return f"{m['base']}_p{m['pct']}"
    raise ThresholdError(f"unknown metric {name!r}; use a short name ({', '.join(sorted(SHORT_NAMES))}), "
                         "pNN_<ttft|tbt|tpot|e2e>, or a metric key from kvbench.bench.metrics.METRIC_KEYS")


@dataclass(frozen=True)
class Threshold:
    """``direction`` is +1 (fail when the metric rises past ``limit``) or -1 (fail when it drops).
    ``absolute``: a time gated on its own value rather than as a ratio to the reference engine."""

    expression: str
    metric: str
    direction: int
    limit: float
    relative: bool
    absolute: bool = False

    def change(self, baseline: float, current: float) -> float:
        """Relative (fraction) or absolute change from baseline to current."""
        diff = current - baseline
        if not self.relative:
            return diff
        if baseline == 0:
            return 0.0 if diff == 0 else math.copysign(math.inf, diff)
        return diff / abs(baseline)

    def violated(self, baseline: float, current: float) -> bool:
        limit = self.limit / 100.0 if self.relative else self.limit
        return self.direction * self.change(baseline, current) > limit

    def __str__(self) -> str:
        return self.expression


def parse_threshold(expression: str) -> Threshold:
    """Parse ``NAME:[+|-]NUMBER[%]`` (see the module docstring). Raises ThresholdError."""
    m = _EXPR_RE.match(expression)
    if m is None:
        raise ThresholdError(f"bad threshold {expression!r}: expected [abs:]NAME:[+|-]NUMBER[%], "
                             "e.g. 'throughput:-10%', 'p99_tbt:+20%', 'preemptions:+0'")
    metric = resolve_metric(m["name"])
    # no sign: the metric's bad direction
    bad_direction = -1 if metric in HIGHER_IS_BETTER else 1
    direction = {"+": 1, "-": -1}.get(m["sign"] or "", bad_direction)
    relative = bool(m["pct"])
    return Threshold(expression.strip(), metric, direction, float(m["number"]), relative,
                     absolute=bool(m["abs"]) or not relative)


def parse_thresholds(expressions: Iterable[str | Threshold]) -> list[Threshold]:
    return [e if isinstance(e, Threshold) else parse_threshold(e) for e in expressions]


@dataclass(frozen=True)
class Delta:
    """One metric of one (scenario, engine, mode) compared with the baseline.

    ``basis`` says how: ``"exact"`` (a step-clock count), ``"absolute"`` (medians with a noise
    floor) or ``"ratio to <engine>"`` (same-run ratios with a noise floor; ``baseline`` and
    ``current`` are then the ratios). ``noise`` is the noise floor in the compared values' unit
    (0 for exact counts and results without repeats).
    """

    scenario: str
    engine: str
    mode: str | None
    metric: str
    baseline: float
    current: float
    change: float  # relative (fraction) when the threshold is relative, else absolute
    threshold: Threshold
    regressed: bool
    basis: str = "absolute"
    noise: float = 0.0

    @property
    def within_noise(self) -> bool:
        """The threshold was crossed but the change is inside the noise floor (not a regression)."""
        return not self.regressed and self.threshold.violated(self.baseline, self.current)

    def describe(self) -> str:
        where = f"{self.scenario} / {self.engine}" + (f" [{self.mode}]" if self.mode else "")
        what = self.metric if self.basis in ("absolute", "exact") else f"{self.metric} ({self.basis})"
        noise = f", noise floor {format_value(self.noise)}" if self.noise else ""
        return (f"{where}: {what} {format_value(self.baseline)} -> {format_value(self.current)} "
                f"({format_change(self)}; threshold {self.threshold}{noise})")


#: A regression is a :class:`Delta` that crossed its threshold (and the noise floor).
Regression = Delta


@dataclass(frozen=True)
class Missing:
    """A baseline result (``metric`` None) or one of its thresholded metrics absent from the current run."""

    scenario: str
    engine: str
    mode: str | None
    metric: str | None = None

    def describe(self) -> str:
        where = f"{self.scenario} / {self.engine}" + (f" [{self.mode}]" if self.mode else "")
        if self.metric is None:
            return f"missing from the current run: {where} (in the baseline)"
        return f"missing from the current run: {where}: {self.metric} (has a value in the baseline)"


@dataclass(frozen=True)
class SetAside:
    """A baseline result (``metric`` None: all its figures) or one of its figures the gate did not compare,
    because the two figures were measured on different clocks (``why`` says which). Neither a pass nor a fail."""

    scenario: str
    engine: str
    mode: str | None
    metric: str | None
    why: str

    @property
    def where(self) -> str:
        where = f"{self.scenario} / {self.engine}" + (f" [{self.mode}]" if self.mode else "")
        return where + (f": {self.metric}" if self.metric else "")

    def describe(self) -> str:
        return f"not compared: {self.where}: {self.why}"


@dataclass
class Verdict:
    """What the gate found: every comparison, the regressions among them, what was missing, what was set
    aside (different clocks), notes."""

    deltas: list[Delta] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    set_aside: list[SetAside] = field(default_factory=list)

    @property
    def regressions(self) -> list[Delta]:
        return [d for d in self.deltas if d.regressed]

    @property
    def nothing_compared(self) -> bool:
        """No figure was compared at all: a gate that passed so would be a hidden pass, so it fails."""
        return not self.deltas

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.missing or self.nothing_compared)

    def failure_lines(self) -> list[str]:
        """One line per regression and per missing result, naming it; one more when nothing was compared."""
        lines = ([f"REGRESSION {d.describe()}" for d in self.regressions]
                 + [f"MISSING {m.describe()}" for m in self.missing])
        if self.nothing_compared:
            lines.append(f"NOTHING COMPARED {self._nothing_why()}")
        return lines

    def _nothing_why(self) -> str:
        if self.set_aside:
            n = len({(s.scenario, s.engine, s.mode) for s in self.set_aside})
            return (f"no figure of the baseline could be compared with this run: {n} result{'s' if n != 1 else ''} "
                    "set aside because the two were measured on different clocks, and a gate that compares nothing "
                    "would be a hidden pass. Gate against a baseline measured on the same clock: a session runs "
                    "every engine on the step clock only when all of them can be stepped from outside, so a "
                    "baseline made with the same --engine options is on the same clock (kvbench.bench.clock_rule)")
        return ("no thresholded figure has a value in both runs, so the gate compared nothing, and a gate that "
                "compares nothing would be a hidden pass (check the thresholds' metrics against the results, "
                "or gate times with --gate-absolute where a run has only the reference engine)")

    def summary(self) -> str:
        """One line: what failed, or what passed (and how much was set aside)."""
        if not self.failed:
            exact = sum(d.basis == "exact" for d in self.deltas)
            aside = len({(s.scenario, s.engine, s.mode, s.metric) for s in self.set_aside})
            tail = f"; {aside} set aside, measured on different clocks" if aside else ""
            return f"no regression ({len(self.deltas)} comparisons, {exact} exact counts{tail})"
        if self.nothing_compared and not (self.regressions or self.missing):
            return "regression gate failed: nothing compared"
        parts = []
        if self.regressions:
            n = len(self.regressions)
            parts.append(f"{n} regression{'s' if n != 1 else ''}")
        if self.missing:
            parts.append(f"{len(self.missing)} missing result{'s' if len(self.missing) != 1 else ''}")
        if self.nothing_compared:
            parts.append("nothing compared")
        return "regression gate failed: " + ", ".join(parts)


def format_value(value: float) -> str:
    return f"{value:.4g}"


def format_change(delta: Delta) -> str:
    if delta.threshold.relative:
        return "new" if math.isinf(delta.change) else f"{delta.change * 100:+.1f}%"
    return f"{delta.change:+.4g}"


Key = tuple[str, str, "str | None"]


def _results(results: Results) -> dict[Key, dict[str, Any]]:
    return {(sc["name"], res["engine"], res.get("mode")): res for sc, res in results.iter_results()}


def _keyed(results: Results) -> dict[Key, dict]:
    return {k: res.get("metrics", {}) for k, res in _results(results).items()}


def reference_engine_name(results: Results) -> str | None:
    """The engine same-run ratios divide by: the one named ``reference``, else the first of kind
    ``reference``, else None."""
    names = results.engine_names()
    if "reference" in names:
        return "reference"
    return next((e["name"] for e in results.engines if e.get("kind") == "reference"), None)


Clock = tuple[str, "float | None"]


def clock_of(res: Mapping[str, Any]) -> Clock:
    """("step", seconds a step) or ("wall", None): how a result's arrivals were released. A result without a
    ``clock`` (older files) is on the wall clock, as the report reads it (:func:`kvbench.report.figures.clock_of`)."""
    clock = res.get("clock")
    if not isinstance(clock, Mapping) or clock.get("clock", "wall") != "step":
        return ("wall", None)
    seconds = clock.get("step_seconds")
    return ("step", None if seconds is None else float(seconds))


def clock_words(clock: Clock) -> str:
    """"the wall clock", "the step clock (0.01 s a step)"."""
    name, seconds = clock
    if name == "step" and seconds is not None:
        return f"the step clock ({seconds:g} s a step)"
    return f"the {name} clock"


def _exact(res: Mapping[str, Any]) -> bool:
    clock = res.get("clock") or {}
    return clock.get("clock") == "step" and bool(clock.get("exact_counts"))


def _value(res: Mapping[str, Any] | None, metric: str) -> float | None:
    if res is None:
        return None
    v = res.get("metrics", {}).get(metric)
    return None if v is None else float(v)


def _pooled(a: float, b: float) -> float:
    return math.sqrt((a * a + b * b) / 2.0)


def paired_ratios(res: Mapping[str, Any], ref: Mapping[str, Any], metric: str) -> list[float] | None:
    """``metric`` of each repeat of ``res`` over the same repeat of ``ref`` (repeat i with repeat i),
    or None unless both have the same number (>= 2) of repeats: repeat i of every engine of a
    scenario is served in the same round (:func:`kvbench.bench.scenarios.run_interleaved`), so each
    ratio compares two measurements taken seconds apart. Repeats where either value is missing or
    the reference's is 0 are left out."""
    mine, theirs = res.get("repeats") or [], ref.get("repeats") or []
    if len(mine) < 2 or len(mine) != len(theirs):
        return None
    pairs = [(a.get(metric), b.get(metric)) for a, b in zip(mine, theirs, strict=True)]
    ratios = [float(a) / float(b) for a, b in pairs
              if a is not None and b is not None and float(b) != 0 and math.isfinite(float(a) / float(b))]
    return ratios or None


def _ratio_and_spread(res: Mapping[str, Any], ref: Mapping[str, Any], metric: str) -> tuple[float, float] | None:
    """(same-run ratio, its spread): the median and spread of the per-repeat ratios
    (:func:`paired_ratios`) when the repeats pair up, else engine median / reference median with a
    spread by relative error propagation (results without matching repeats, e.g. older files)."""
    ratios = paired_ratios(res, ref, metric)
    if ratios is not None:
        return float(repeat_median(ratios)), repeat_spread(ratios)
    v, r = _value(res, metric), _value(ref, metric)
    if v is None or r is None or r == 0:
        return None
    ratio = v / r
    rel_v = result_spread(res, metric) / abs(v) if v else 0.0
    rel_r = result_spread(ref, metric) / abs(r)
    return ratio, abs(ratio) * math.hypot(rel_v, rel_r)


def noise_floor(baseline: float, spread_baseline: float, spread_current: float, *, noise_k: float = NOISE_K,
                min_noise: float = MIN_NOISE) -> float:
    """How far a statistically gated value may move before the move can count: the larger of
    ``noise_k`` pooled spreads of the two runs' repeats and ``min_noise`` x ``|baseline|`` (see the
    module docstring for why both)."""
    return max(noise_k * _pooled(spread_baseline, spread_current), min_noise * abs(baseline))


def gate(current: Results, baseline: Results, thresholds: Sequence[str | Threshold], *, absolute: bool = False,
         noise_k: float = NOISE_K, min_noise: float = MIN_NOISE, min_noise_tail: float = MIN_NOISE_TAIL) -> Verdict:
    """Compare ``current`` with ``baseline`` (see the module docstring): every baseline result must be
    present, counts from step-clock runs compared exactly, times as same-run ratios per repeat (or
    absolute when ``absolute`` or the threshold says so) beyond a noise floor of ``noise_k`` pooled
    spreads, and never less than ``min_noise`` (``min_noise_tail`` for a tail) of the baseline value
    (:func:`noise_floor`). Raises ValueError for a negative ``noise_k``, ``min_noise`` or ``min_noise_tail``."""
    for name, value in (("noise_k", noise_k), ("min_noise", min_noise), ("min_noise_tail", min_noise_tail)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    parsed = parse_thresholds(thresholds)
    base, cur = _results(baseline), _results(current)
    ref_name = reference_engine_name(baseline)
    verdict = Verdict()
    skipped_ratio: set[str] = set()
    for key, b_res in base.items():
        c_res = cur.get(key)
        if c_res is None:
            verdict.missing.append(Missing(*key))
            continue
        scenario, engine, mode = key
        if clock_of(b_res) != clock_of(c_res):
            why = (f"the baseline measured it on {clock_words(clock_of(b_res))}, "
                   f"this run on {clock_words(clock_of(c_res))}")
            verdict.set_aside.append(SetAside(*key, None, why))
            continue
        for th in parsed:
            b, c = _value(b_res, th.metric), _value(c_res, th.metric)
            if b is None:
                continue
            if c is None:
                verdict.missing.append(Missing(*key, th.metric))
                continue
            if is_count(th.metric) and _exact(b_res) and _exact(c_res):
                verdict.deltas.append(Delta(*key, th.metric, b, c, th.change(b, c), th, th.violated(b, c), "exact"))
                continue
            basis = "absolute"
            sb, sc = result_spread(b_res, th.metric), result_spread(c_res, th.metric)
            if not is_count(th.metric) and not (absolute or th.absolute):
                if engine == ref_name or ref_name is None:
                    skipped_ratio.add(engine if ref_name else "(no reference engine)")
                    continue
                b_ref, c_ref = base.get((scenario, ref_name, mode)) or {}, cur.get((scenario, ref_name, mode)) or {}
                mixed = _mixed_ratio(b_res, b_ref, "the baseline") or _mixed_ratio(c_res, c_ref, "this run")
                if mixed:
                    verdict.set_aside.append(SetAside(*key, th.metric, f"as a ratio to {ref_name}: {mixed}"))
                    continue
                b_pair = _ratio_and_spread(b_res, b_ref, th.metric)
                c_pair = _ratio_and_spread(c_res, c_ref, th.metric)
                if b_pair is None or c_pair is None:
                    continue  # the reference lacks this figure here (its own absence is reported as missing)
                (b, sb), (c, sc) = b_pair, c_pair
                basis = f"ratio to {ref_name}"
            floor = min_noise_tail if is_tail(th.metric) else min_noise
            noise = noise_floor(b, sb, sc, noise_k=noise_k, min_noise=floor)
            regressed = th.violated(b, c) and abs(c - b) > noise
            verdict.deltas.append(Delta(*key, th.metric, b, c, th.change(b, c), th, regressed, basis, noise))
    for name in sorted(skipped_ratio):
        verdict.notes.append(f"times of {name} are not gated: ratios divide by the reference engine "
                             "(--gate-absolute or abs:NAME:... gates absolute times)")
    verdict.notes += set_aside_notes(verdict.set_aside)
    only_current = sorted(set(cur) - set(base), key=str)
    verdict.notes += [f"only in the current run (not gated): {s} / {e}" + (f" [{m}]" if m else "")
                      for s, e, m in only_current]
    return verdict


def _mixed_ratio(res: Mapping[str, Any], ref: Mapping[str, Any], run: str) -> str:
    """Why a same-run ratio of ``res`` to ``ref`` in ``run`` would divide figures of two clocks ("" if it
    would not, or ``ref`` is absent: its absence is reported elsewhere)."""
    if not ref or clock_of(res) == clock_of(ref):
        return ""
    return (f"in {run} it ran on {clock_words(clock_of(res))} and the reference engine on "
            f"{clock_words(clock_of(ref))}, so the ratio would divide figures of two clocks")


def set_aside_notes(set_aside: Sequence[SetAside]) -> list[str]:
    """One note per reason, naming every result (or figure) set aside for it."""
    by_why: dict[str, list[str]] = {}
    for s in set_aside:
        where = s.where
        if where not in by_why.setdefault(s.why, []):
            by_why[s.why].append(where)
    return [f"not compared, neither a pass nor a fail ({why}): {', '.join(wheres)}" for why, wheres in by_why.items()]


def deltas(current: Results, baseline: Results, thresholds: Sequence[str | Threshold], *, absolute: bool = False,
           noise_k: float = NOISE_K, min_noise: float = MIN_NOISE, min_noise_tail: float = MIN_NOISE_TAIL
           ) -> list[Delta]:
    """Every thresholded metric of every (scenario, engine, mode) present in both runs (see :func:`gate`)."""
    return gate(current, baseline, thresholds, absolute=absolute, noise_k=noise_k, min_noise=min_noise,
                min_noise_tail=min_noise_tail).deltas


def compare(current: Results, baseline: Results, thresholds: Sequence[str | Threshold], *, absolute: bool = False,
            noise_k: float = NOISE_K, min_noise: float = MIN_NOISE, min_noise_tail: float = MIN_NOISE_TAIL
            ) -> list[Regression]:
    """The regressions of ``current`` against ``baseline``, matched per (scenario, engine, mode).
    Missing results are not regressions: use :func:`gate` for the whole verdict."""
    return gate(current, baseline, thresholds, absolute=absolute, noise_k=noise_k, min_noise=min_noise,
                min_noise_tail=min_noise_tail).regressions


def common_keys(current: Results, baseline: Results) -> list[Key]:
    """The (scenario, engine, mode) keys present in both runs: what the gate compares."""
    base = _keyed(baseline)
    return [k for k in _keyed(current) if k in base]


def unmatched(current: Results, baseline: Results) -> tuple[list[tuple], list[tuple]]:
    """(keys only in current, keys only in baseline): what the gate could not compare."""
    cur, base = _keyed(current), _keyed(baseline)
    return sorted(set(cur) - set(base), key=str), sorted(set(base) - set(cur), key=str)
