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
from dataclasses import dataclass
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


# --------------------------------------------------------------------------------------------
# honest noise: what the repeats, the rounds and identical schedules each say


#: the counts that identify a schedule on the step clock: two results of one engine equal in all of them
#: served the same requests before the same steps with the same preemptions
SCHEDULE_KEYS = ("requests", "prompt_tokens", "output_tokens", "steps", "preemptions", "recomputed_tokens",
                 "swap_outs", "prefix_cache_hits", "prefill_chunks")


#: figures recorded beside a repeat's metrics that describe the machine, not the engine
NOT_MEASURED_FIGURES = frozenset({"machine_load_1min"})


@dataclass(frozen=True)
class Drift:
    """How far apart two or more results of one identical schedule landed (medians of ``metric``): the
    noise a comparison must at least carry, since back-to-back repeats can agree more closely with each
    other than measurements of the same thing taken minutes apart."""

    metric: str
    share: float  # (max - min) / median of the identical schedules' medians
    where: str

    def words(self) -> str:
        return f"one workload measured twice differed by {self.share * 100:.0f}%: {self.where}"


def schedule_key(result: Mapping[str, Any]) -> tuple | None:
    """What makes two results one measurement taken twice, or None when it cannot be told:

    * the engine, its clock and the ``workload_key`` the runner records (the same requests under the same
      effective settings, :func:`kvbench.bench.scenarios.common.job_key`), and on the step clock with
      exact counts also :data:`SCHEDULE_KEYS` (the same steps, preemptions...: an identical schedule);
    * without a ``workload_key`` (older files), the step clock's exact counts alone.
    """
    clock = result.get("clock")
    name = clock.get("clock", "wall") if isinstance(clock, Mapping) else "wall"
    exact = isinstance(clock, Mapping) and name == "step" and bool(clock.get("exact_counts"))
    metrics = result.get("metrics") or {}
    counts = tuple(metrics.get(k) for k in SCHEDULE_KEYS) if exact else ()
    if exact and any(v is None for v in counts[:4]):
        return None
    workload = result.get("workload_key")
    if workload is None and not exact:
        return None
    return (result.get("engine"), name, workload, *counts)


def identical_schedule_drift(scenarios: Sequence[Mapping[str, Any]]) -> dict[str, Drift]:
    """Per timed metric, the widest gap between results of one identical schedule (:func:`schedule_key`)
    found anywhere in a results file's ``scenarios`` (e.g. a surge served in its own scenario and again as
    the policies scenario's static control); {} when no schedule was served twice."""
    groups: dict[tuple, list[tuple[str, Mapping[str, Any]]]] = {}
    for sc in scenarios:
        for r in sc.get("results", []):
            key = schedule_key(r)
            if key is not None:
                where = sc.get("name", "?") + (f" [{r['mode']}]" if r.get("mode") else "")
                groups.setdefault(key, []).append((where, r))
    out: dict[str, Drift] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        names = [k for _, r in members for k in (r.get("metrics") or {})]
        for metric in dict.fromkeys(names):
            if is_count(metric) or metric in NOT_MEASURED_FIGURES:
                continue
            share = relative_range([(r.get("metrics") or {}).get(metric) for _, r in members])
            if share is None or (metric in out and out[metric].share >= share):
                continue
            engine = members[0][1].get("engine")
            loads = [median(repeat_values(r, "machine_load_1min")) for _, r in members]
            load_words = (" (machine load " + " vs ".join(f"{v:.1f}" for v in loads if v is not None) + ")"
                          if all(v is not None for v in loads) else "")
            out[metric] = Drift(metric, share, " vs ".join(w for w, _ in members) + f" on {engine}" + load_words)
    return out


def _repeat_list(result: Mapping[str, Any], metric: str) -> list[float | None]:
    """Every repeat's value of ``metric``, in repeat order, None where missing (aligned, unlike
    :func:`repeat_values`)."""
    reps = result.get("repeats")
    if not isinstance(reps, list):
        return []
    out: list[float | None] = []
    for rep in reps:
        m = rep.get("metrics", rep) if isinstance(rep, Mapping) else None
        v = m.get(metric) if isinstance(m, Mapping) else None
        out.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None)
    return out


def paired_ratios(a: Mapping[str, Any], b: Mapping[str, Any], metric: str) -> list[float]:
    """Repeat i of ``a`` ÷ repeat i of ``b``, for results served in the same rounds (each names the other
    in ``clock.interleaved``) with as many repeats each; [] otherwise."""
    together = [set((r.get("clock") or {}).get("interleaved") or []) if isinstance(r.get("clock"), Mapping)
                else set() for r in (a, b)]
    if not ({a.get("engine"), b.get("engine")} <= together[0] and {a.get("engine"), b.get("engine")} <= together[1]):
        return []
    va, vb = _repeat_list(a, metric), _repeat_list(b, metric)
    if len(va) != len(vb):
        return []
    return [x / y for x, y in zip(va, vb, strict=True) if x is not None and y]


def _relative(result: Mapping[str, Any], metric: str) -> float | None:
    vals = repeat_values(result, metric)
    if len(vals) < 2:
        return None
    med = (result.get("metrics") or {}).get(metric)
    med = float(med) if isinstance(med, int | float) and not isinstance(med, bool) else statistics.median(vals)
    return abs(result_spread(result, metric) / med) if med else None


def honest_ratio_noise(a: Mapping[str, Any], b: Mapping[str, Any], metric: str,
                       drift: Drift | None = None) -> tuple[float | None, list[str]]:
    """The noise of ``a ÷ b`` of ``metric`` (a share: 0.1 is ±10%), as the widest of what was measured:

    * the repeats' spreads: twice both relative spreads added (about two standard deviations);
    * the ratio taken round by round (:func:`paired_ratios`): twice its relative spread;
    * ``drift``: how far two runs of one identical schedule in the same file landed apart.

    Returns (noise, the words of the one that decided it), or (None, []) when nothing was measured (a
    single run). Repeats served back to back share the machine's load of that minute, so on their own
    they can claim ±1% where the same schedule measured later differs by 17%."""
    found: list[tuple[float, str]] = []
    sa, sb = _relative(a, metric), _relative(b, metric)
    n = max(len(repeat_values(a, metric)), len(repeat_values(b, metric)))
    if sa is not None or sb is not None:
        found.append((2 * ((sa or 0.0) + (sb or 0.0)), f"spread of {n} repeats"))
    ratios = paired_ratios(a, b, metric)
    if len(ratios) >= 2:
        mid = statistics.median(ratios)
        if mid:
            found.append((2 * spread(ratios) / abs(mid), f"ratio round by round over {len(ratios)} rounds"))
    if drift is not None:
        found.append((drift.share, drift.words()))
    if not found:
        return None, []
    noise, words = max(found, key=lambda f: f[0])
    return noise, [words]


def drift_for(drift: Mapping[str, Drift], metric: str) -> Drift | None:
    """The drift measured for ``metric``, else for the figure it is a part of (``ttft_p99_after_surge``
    -> ``ttft_p99``: the same quantity over a subset of the requests), else None."""
    parts = metric.split("_")
    for n in range(len(parts), 1, -1):
        found = drift.get("_".join(parts[:n]))
        if found is not None:
            return found
    return None
