"""Repeated measurements of one timed point: the median and a robust spread of each metric.

A benchmark serves every timed point ``--benchmark-repeats`` times (3 by default at quick scale, 1 at
full). Results keep every repeat's values, their median (what the report shows and the gate
compares) and their spread (what the gate's noise floor is made of, see :mod:`kvbench.bench.gate`).

Spread is an estimate of one measurement's standard deviation that a single outlier cannot
shrink to nothing:

* 5 or more values: 1.4826 x the median absolute deviation (the MAD scaled to a normal's sigma);
* 2 to 4 values: half the range. The MAD of three values is the smaller of two gaps and often
  near zero by chance, which would make a noise floor that flaps;
* fewer than 2 values: 0 (no information: the gate then falls back to the threshold alone).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: scales the MAD of normally distributed values to their standard deviation
MAD_TO_SIGMA = 1.4826

#: metrics fixed by the schedule alone (what was admitted, preempted, swapped, hit, computed, per
#: step), not by how long anything took: identical on every step-clock run of a deterministic
#: engine, so the gate compares them exactly. Every other metric of
#: :data:`kvbench.bench.metrics.METRIC_KEYS` depends on the wall clock (latencies, rates, shares of
#: time, duration-weighted means, spikes found from gaps) and is compared with statistics.
COUNT_METRICS: frozenset[str] = frozenset({
    "requests", "requests_finished", "prompt_tokens", "output_tokens", "prompt_len_mean", "prompt_len_max",
    "output_len_mean", "preemptions", "preemptions_recompute", "preemptions_swap", "preempted_request_share",
    "max_preemptions_per_request", "swap_outs", "swap_ins", "swap_fallbacks", "recomputed_tokens",
    "computed_tokens", "recomputed_share", "swapped_out_bytes", "swapped_in_bytes", "prefix_cache_queries",
    "prefix_cache_hits", "prefix_hit_rate", "prefill_chunks", "kv_usage_max", "cpu_kv_usage_max", "running_max",
    "waiting_max", "swapped_max", "steps",
})


def is_count(metric: str) -> bool:
    """True for a metric the schedule alone fixes (see :data:`COUNT_METRICS`)."""
    return metric in COUNT_METRICS


_TAIL_RE = re.compile(r"_(p9\d|max)(_|$)")
#: tail figures whose names do not say so: counts and shares of the slowest token gaps
_TAIL_NAMES = frozenset({"tbt_spikes", "tbt_spike_share", "starvation_max_s"})


def is_tail(metric: str) -> bool:
    """True for a time's tail (``*_p90``, ``*_p99``, ``*_max``, TBT spikes, the longest starvation):
    a few of the slowest samples decide it, so it moves more between runs than a median or a rate
    (the gate gives it a wider noise floor, :data:`kvbench.bench.gate.MIN_NOISE_TAIL`). Counts are never tails."""
    return not is_count(metric) and (metric in _TAIL_NAMES or _TAIL_RE.search(metric) is not None)


def _numbers(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are numbers; None when there are none."""
    nums = _numbers(values)
    return float(statistics.median(nums)) if nums else None


def spread(values: Sequence[float | None]) -> float:
    """A robust estimate of one value's standard deviation (see the module docstring)."""
    nums = _numbers(values)
    if len(nums) < 2:
        return 0.0
    if len(nums) < 5:
        return (max(nums) - min(nums)) / 2.0
    mid = statistics.median(nums)
    return MAD_TO_SIGMA * float(statistics.median(abs(v - mid) for v in nums))


def relative_range(values: Sequence[float | None]) -> float | None:
    """``(max - min) / |median|`` of the values that are numbers: how far apart repeated rounds landed,
    as a share of their median, the figure printed beside a median as "its rounds' spread". None with
    fewer than two numbers, or a median of 0 with values that differ (no share of nothing); 0.0 when
    all are equal. Not :func:`spread`, which estimates one measurement's standard deviation for the
    gate's noise floor."""
    nums = _numbers(values)
    if len(nums) < 2:
        return None
    mid = statistics.median(nums)
    if mid == 0:
        return 0.0 if max(nums) == min(nums) else None
    return (max(nums) - min(nums)) / abs(mid)


def repeat_values(result: Mapping[str, Any], metric: str) -> list[float]:
    """Every repeat's value of ``metric`` in a recorded result, [] for a single run.

    Read tolerantly, because the repeats' layout is the runner's: ``result["repeats"]`` as a list of
    metric dicts (or of ``{"metrics": {...}}``), or as ``{metric: [values]}``.
    """
    reps = result.get("repeats")
    values: list[Any] = []
    if isinstance(reps, list):
        for rep in reps:
            if isinstance(rep, Mapping):
                m = rep.get("metrics", rep)
                values.append(m.get(metric) if isinstance(m, Mapping) else None)
    elif isinstance(reps, Mapping):
        v = reps.get(metric)
        if isinstance(v, Mapping):  # {"values": [...], "median": .., "spread": ..}
            v = v.get("values")
        if isinstance(v, Sequence) and not isinstance(v, str):
            values = list(v)
    return [float(v) for v in values
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def result_spread(result: Mapping[str, Any], metric: str) -> float:
    """A recorded result's spread of ``metric`` (one measurement's robust sigma, :func:`spread`): the one the
    runner stored, else :func:`spread` of its repeats' values, else 0.

    The stored one comes first because it is the figure the run itself reported (the runner computes it
    from the repeats when the result is made), so that the gate and the report read one value per fact."""
    given = result.get("spread")
    stored = given.get(metric) if isinstance(given, Mapping) else None
    if isinstance(stored, int | float) and not isinstance(stored, bool) and math.isfinite(stored):
        return float(stored)
    return spread(repeat_values(result, metric))


def aggregate(repeats: Sequence[Mapping[str, float | None]]) -> tuple[dict[str, float | None], dict[str, float]]:
    """Per-repeat metric dicts -> (median per metric, spread per metric), over the union of keys.

    A metric that is None in every repeat stays None (not exposed), with spread 0.
    """
    keys: list[str] = []
    for rep in repeats:
        keys += [k for k in rep if k not in keys]
    medians = {k: median([rep.get(k) for rep in repeats]) for k in keys}
    spreads = {k: spread([rep.get(k) for rep in repeats]) for k in keys}
    return medians, spreads


def differing(repeats: Sequence[Mapping[str, float | None]], keys: Sequence[str]) -> list[str]:
    """The ``keys`` whose values differ between repeats (an empty list: all identical)."""
    return [k for k in keys if len({rep.get(k) for rep in repeats}) > 1]
