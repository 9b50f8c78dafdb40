"""The regression gate: compare a run against a baseline with thresholds written as expressions.

Syntax: ``NAME:[+|-]NUMBER[%]``

* ``throughput:-10%``  fail if the metric *drops* by more than 10% of the baseline
* ``p99_tbt:+20%``     fail if it *rises* by more than 20%
* ``preemptions:+0``   fail on any absolute increase (no ``%``: the number is in the metric's unit)
* no sign: the bad direction of the metric is used (``throughput:10%`` == ``throughput:-10%``)

Relative changes are ``(current - baseline) / |baseline|``. A baseline of 0 with a different
current value is an infinite relative change (so ``preemptions:+50%`` fails when 0 becomes 3).
A metric that is missing or None on either side is not compared.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbench.bench.metrics import GOODPUT_KEYS, METRIC_KEYS
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

#: used by ``kvbench compare`` when no ``--threshold`` is given (timing noise on shared CI
#: machines makes tighter defaults flaky; preemption counts vary with timing too)
DEFAULT_THRESHOLDS: tuple[str, ...] = ("throughput:-10%", "p99_ttft:+20%", "p99_tbt:+20%")

_KNOWN = frozenset(METRIC_KEYS) | frozenset(GOODPUT_KEYS)
_EXPR_RE = re.compile(r"^\s*(?P<name>[A-Za-z0-9_]+)\s*:\s*(?P<sign>[+-])?(?P<number>\d+(?:\.\d+)?|\.\d+)"
                      r"\s*(?P<pct>%)?\s*$")
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
    """``direction`` is +1 (fail when the metric rises past ``limit``) or -1 (fail when it drops)."""

    expression: str
    metric: str
    direction: int
    limit: float
    relative: bool

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
        raise ThresholdError(f"bad threshold {expression!r}: expected NAME:[+|-]NUMBER[%], "
                             "e.g. 'throughput:-10%', 'p99_tbt:+20%', 'preemptions:+0'")
    metric = resolve_metric(m["name"])
    # no sign: the metric's bad direction
    bad_direction = -1 if metric in HIGHER_IS_BETTER else 1
    direction = {"+": 1, "-": -1}.get(m["sign"] or "", bad_direction)
    return Threshold(expression.strip(), metric, direction, float(m["number"]), bool(m["pct"]))


def parse_thresholds(expressions: Iterable[str | Threshold]) -> list[Threshold]:
    return [e if isinstance(e, Threshold) else parse_threshold(e) for e in expressions]


@dataclass(frozen=True)
class Delta:
    """One metric of one (scenario, engine, mode) compared with the baseline."""

    scenario: str
    engine: str
    mode: str | None
    metric: str
    baseline: float
    current: float
    change: float  # relative (fraction) when the threshold is relative, else absolute
    threshold: Threshold
    regressed: bool

    def describe(self) -> str:
        where = f"{self.scenario} / {self.engine}" + (f" [{self.mode}]" if self.mode else "")
        return (f"{where}: {self.metric} {format_value(self.baseline)} -> {format_value(self.current)} "
                f"({format_change(self)}; threshold {self.threshold})")


#: A regression is a :class:`Delta` that crossed its threshold.
Regression = Delta


def format_value(value: float) -> str:
    return f"{value:.4g}"


def format_change(delta: Delta) -> str:
    if delta.threshold.relative:
        return "new" if math.isinf(delta.change) else f"{delta.change * 100:+.1f}%"
    return f"{delta.change:+.4g}"


def _keyed(results: Results) -> dict[tuple[str, str, str | None], dict]:
    return {(sc["name"], res["engine"], res.get("mode")): res.get("metrics", {}) for sc, res in results.iter_results()}


def deltas(current: Results, baseline: Results, thresholds: Sequence[str | Threshold]) -> list[Delta]:
    """Every thresholded metric of every (scenario, engine, mode) present in both runs."""
    parsed = parse_thresholds(thresholds)
    base = _keyed(baseline)
    out = []
    for key, metrics in _keyed(current).items():
        if key not in base:
            continue
        for th in parsed:
            b, c = base[key].get(th.metric), metrics.get(th.metric)
            if b is None or c is None:
                continue
            b, c = float(b), float(c)
            out.append(Delta(*key, th.metric, b, c, th.change(b, c), th, th.violated(b, c)))
    return out


def compare(current: Results, baseline: Results, thresholds: Sequence[str | Threshold]) -> list[Regression]:
    """The regressions of ``current`` against ``baseline``, matched per (scenario, engine, mode)."""
    return [d for d in deltas(current, baseline, thresholds) if d.regressed]


def common_keys(current: Results, baseline: Results) -> list[tuple[str, str, str | None]]:
    """The (scenario, engine, mode) keys present in both runs: what the gate compares."""
    base = _keyed(baseline)
    return [k for k in _keyed(current) if k in base]


def unmatched(current: Results, baseline: Results) -> tuple[list[tuple], list[tuple]]:
    """(keys only in current, keys only in baseline): what the gate could not compare."""
    cur, base = _keyed(current), _keyed(baseline)
    return sorted(set(cur) - set(base), key=str), sorted(set(base) - set(cur), key=str)
