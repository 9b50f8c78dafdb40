"""Every figure kvbench reports, computed from a :class:`~kvbench.core.trace.Trace`.

Contracts
---------
* :func:`summarize` returns a flat ``dict[str, float | None]``: JSON-friendly, one number per key,
  ``None`` where the engine did not expose what the figure needs (never a misleading zero).
  The keys are listed in :data:`METRIC_KEYS` (``goodput*`` only when SLOs are given).
* :func:`series` returns ``dict[str, list]`` of downsampled timelines and CDFs for charts.
* Times are seconds, rates per second, sizes bytes, shares in ``0..1``.

Definitions (the ones a reader could argue about)
-------------------------------------------------
* **TTFT** = first token time - arrival. **TBT** = every gap between consecutive output tokens of
  one request, pooled over requests. **TPOT** (per request) = (last token - first token) /
  (tokens - 1). **E2E** = finished - arrival, finished requests only.
* **Throughput**: output tokens / run duration; *total* adds the prompt tokens of every request
  that produced at least one token.
* **Counters win**: an engine's own cumulative counter (``trace.counters``, the contract of
  :mod:`kvbench.core.counters`) is preferred; where it is ``None`` (not exposed) the figure is
  rebuilt from per-request / per-step records, unless the adapter declared it ``not_exposed``
  (then ``None``). A missing counter never reads as 0.
* **TBT spike**: a gap > ``spike_factor`` x the median of the positive gaps (zero gaps come from
  tokens delivered together and say nothing about stalls). A spike is attributed to a
  **preemption** when that request was preempted or resumed within the gap (inclusive), else to a
  **prefill** when some step that ended within ``(t0, t1]`` scheduled prefill tokens, else "other".
* **Starvation**: for each preemption, the wait until the request's next resume (or, when the
  adapter records no resumes, its next token; if neither comes, its finish or the end of the run).
* **Step statistics** (KV usage, queue lengths) are weighted by step duration, so a long step
  counts for the time it took; unweighted when all durations are zero.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvbench.core.counters import Counters, spec
from kvbench.core.trace import Trace
from kvbench.drivers.step_loop import workload_clock

PERCENTILES: tuple[int, ...] = (50, 90, 99)
DEFAULT_SPIKE_FACTOR = 5.0
KV_PINNED_LEVEL = 0.95
#: relative gain below which the throughput curve is considered flat (see :func:`knee`)
KNEE_MIN_GAIN = 0.05
#: finish reasons of requests the workload aborted on purpose: not counted against goodput
ABORT_REASONS = frozenset({"abort", "aborted", "cancelled"})

_LATENCIES = ("ttft", "tbt", "tpot", "e2e")
_STATS = (*(f"p{p}" for p in PERCENTILES), "max", "mean")

#: every key :func:`summarize` returns (plus ``goodput``/``goodput_rps`` when SLOs are given)
METRIC_KEYS: tuple[str, ...] = (
    "requests", "requests_finished", "duration_s", "prompt_tokens", "output_tokens",
    "prompt_len_mean", "prompt_len_max", "output_len_mean",
    "output_throughput", "total_throughput", "request_throughput",
    *(f"{lat}_{stat}" for lat in _LATENCIES for stat in _STATS),
    "preemptions", "preemptions_recompute", "preemptions_swap", "preemptions_per_s",
    "preempted_request_share", "max_preemptions_per_request", "preemption_active_share",
    "swap_outs", "swap_ins", "swap_fallbacks",
    "recomputed_tokens", "computed_tokens", "recomputed_share",
    "swapped_out_bytes", "swapped_in_bytes", "swap_seconds", "swap_bandwidth",
    "prefix_cache_queries", "prefix_cache_hits", "prefix_hit_rate", "prefill_chunks",
    "tbt_spike_threshold_s", "tbt_spikes", "tbt_spike_share",
    "tbt_spikes_preemption_share", "tbt_spikes_prefill_share", "tbt_spikes_other_share",
    "starvation_max_s", "starvation_mean_s",
    "kv_usage_mean", "kv_usage_max", "kv_usage_time_over_95", "cpu_kv_usage_mean", "cpu_kv_usage_max",
    "running_mean", "running_max", "waiting_mean", "waiting_max", "swapped_mean", "swapped_max",
    "steps", "step_duration_mean",
)
GOODPUT_KEYS: tuple[str, ...] = ("goodput", "goodput_rps")

# not_exposed keys that silence a family of figures (adapters name either the family or a counter)
_PREEMPTION_ALIASES = ("preemptions", "preemptions_recompute", "preemptions_swap", "events")
_RECOMPUTE_ALIASES = ("recomputed_tokens", "recompute")
_PREFIX_ALIASES = ("prefix_cache_hits", "prefix_cache_queries", "prefix_cache", "prefix_caching")


# --------------------------------------------------------------------------------------------
# SLOs and goodput


class SLOError(ValueError):
    """An SLO expression could not be parsed."""


_SLO_RE = re.compile(r"^\s*(?P<name>[a-z0-9_]+)\s*<=\s*(?P<value>[0-9]*\.?[0-9]+)\s*(?P<unit>ms|s)?\s*$")


def parse_slos(slos: str | Mapping[str, float] | None) -> dict[str, float]:
    """``"ttft<=0.5,tbt<=100ms"`` -> ``{"ttft": 0.5, "tbt": 0.1}`` (seconds).

    Names: ``ttft``, ``tbt`` (the request's largest inter-token gap), ``tpot``, ``e2e``.
    A mapping is validated and returned as a dict; ``None`` or ``""`` gives ``{}``.
    """
    if not slos:
        return {}
    if isinstance(slos, Mapping):
        items = {str(k): float(v) for k, v in slos.items()}
    else:
        items = {}
        for part in str(slos).split(","):
            if not part.strip():
                continue
            m = _SLO_RE.match(part)
            if m is None:
                raise SLOError(f"bad SLO {part.strip()!r}: expected NAME<=SECONDS[ms|s], "
                               "e.g. 'ttft<=0.5,tbt<=100ms'")
            scale = 1e-3 if m["unit"] == "ms" else 1.0
            items[m["name"]] = float(m["value"]) * scale
    for name, value in items.items():
        if name not in _LATENCIES:
            raise SLOError(f"unknown SLO {name!r}: allowed names are {', '.join(_LATENCIES)}")
        if not math.isfinite(value) or value <= 0:
            raise SLOError(f"SLO {name} must be a positive number of seconds, got {value}")
    return items


# --------------------------------------------------------------------------------------------
# per-request table


@dataclass(frozen=True)
class _Gaps:
    """All inter-token gaps, pooled: gap i lies between ``t0[i]`` and ``t1[i]`` of request ``rid[i]``."""

    t0: np.ndarray
    t1: np.ndarray
    rid: np.ndarray  # object array of request ids

    @property
    def gap(self) -> np.ndarray:
        return self.t1 - self.t0


def _gaps(trace: Trace) -> _Gaps:
    t0s, t1s, rids = [], [], []
    for rid, r in trace.requests.items():
        if len(r.token_times) < 2:
            continue
        times = np.asarray(r.token_times, dtype=float)
        t0s.append(times[:-1])
        t1s.append(times[1:])
        rids.append(np.full(len(times) - 1, rid, dtype=object))
    if not t0s:
        empty = np.empty(0)
        return _Gaps(empty, empty, np.empty(0, dtype=object))
    return _Gaps(np.concatenate(t0s), np.concatenate(t1s), np.concatenate(rids))


def request_frame(trace: Trace) -> pd.DataFrame:
    """One row per request: ttft, max_gap, tpot, e2e, tokens, preemptions, aborted (NaN where undefined)."""
    rows = []
    for rid, r in trace.requests.items():
        n = len(r.token_times)
        times = r.token_times
        rows.append({
            "request_id": rid,
            "arrival": r.arrival,
            "prompt_len": r.prompt_len,
            "tokens": n,
            "ttft": times[0] - r.arrival if n else math.nan,
            "max_gap": max(b - a for a, b in itertools.pairwise(times)) if n >= 2 else math.nan,
            "tpot": (times[-1] - times[0]) / (n - 1) if n >= 2 else math.nan,
            "e2e": r.finished - r.arrival if r.finished is not None else math.nan,
            "finished": r.finished is not None,
            "aborted": r.finish_reason in ABORT_REASONS,
            "preemptions": len(r.preemptions),
        })
    columns = ["request_id", "arrival", "prompt_len", "tokens", "ttft", "max_gap", "tpot", "e2e",
               "finished", "aborted", "preemptions"]
    return pd.DataFrame(rows, columns=columns)


def goodput(trace: Trace, slos: str | Mapping[str, float]) -> tuple[float | None, float | None]:
    """(share of requests meeting every SLO, such requests per second).

    A request counts only if it finished with at least one token; requests the workload aborted
    on purpose are left out of the denominator. ``tbt`` is checked against the request's largest
    gap (a request with one token has no gap and meets it). ``(None, None)`` without requests.
    """
    limits = parse_slos(slos)
    df = request_frame(trace)
    df = df[~df["aborted"]]
    if df.empty:
        return None, None
    good = df["finished"] & (df["tokens"] > 0)
    column = {"ttft": "ttft", "tbt": "max_gap", "tpot": "tpot", "e2e": "e2e"}
    for name, limit in limits.items():
        values = df[column[name]]
        ok = values <= limit
        if name in ("tbt", "tpot"):
            ok = ok | values.isna()  # no gap to violate
        good &= ok
    share = float(good.mean())
    duration = _duration(trace)
    return share, (float(good.sum()) / duration if duration > 0 else None)


# --------------------------------------------------------------------------------------------
# helpers


def _duration(trace: Trace) -> float:
    if trace.duration > 0:
        return float(trace.duration)
    times = [t for r in trace.requests.values() for t in (*r.token_times, r.finished or 0.0)]
    times += [s.t for s in trace.steps]
    return float(max(times, default=0.0))


def _stats(values: Iterable[float] | np.ndarray, prefix: str) -> dict[str, float | None]:
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {f"{prefix}_{s}": None for s in _STATS}
    out: dict[str, float | None] = {
        f"{prefix}_p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True)
    }
    out[f"{prefix}_max"] = float(arr.max())
    out[f"{prefix}_mean"] = float(arr.mean())
    return out


def _hidden(trace: Trace, aliases: Sequence[str]) -> bool:
    return any(a in trace.not_exposed for a in aliases)


def _counter(trace: Trace, name: str) -> float | None:
    """The engine's own counter ``name`` through the contract: None = not exposed, never 0.

    ``name`` must be a counter of :mod:`kvbench.core.counters` (KeyError otherwise), so a figure
    can only read what the contract defines. A trace whose ``counters`` were replaced by a plain
    mapping after construction is read through ``Counters.from_dict`` (unknown names refused)."""
    spec(name)
    counters = trace.counters if isinstance(trace.counters, Counters) else Counters.from_dict(trace.counters)
    value = getattr(counters, name)
    return None if value is None else float(value)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return float(num) / float(den)


def _preemption_times(trace: Trace) -> list[tuple[float, str, str]]:
    """(time, mode, request id) of every recorded preemption, by time."""
    return sorted((t, mode, rid) for rid, r in trace.requests.items() for t, mode in r.preemptions)


def per_request_preemptions_known(trace: Trace) -> bool:
    """Whether per-request preemption records can be trusted as complete: the adapter saw every preemption
    (none declared ``not_exposed``) and recorded some wherever the engine counted some."""
    if _hidden(trace, _PREEMPTION_ALIASES):
        return False
    counted = sum(_counter(trace, k) or 0.0 for k in ("preemptions_recompute", "preemptions_swap"))
    recorded = sum(len(r.preemptions) for r in trace.requests.values())
    # The engine counted preemptions but the adapter recorded none: events were not observed.
    return not (counted > 0 and recorded == 0)


# --------------------------------------------------------------------------------------------
# families of figures


def _throughput(trace: Trace, df: pd.DataFrame) -> dict[str, float | None]:
    duration = _duration(trace)
    output = int(df["tokens"].sum()) if not df.empty else 0
    prompt_served = int(df.loc[df["tokens"] > 0, "prompt_len"].sum()) if not df.empty else 0
    finished = int(df["finished"].sum()) if not df.empty else 0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "requests": float(len(df)),
        "requests_finished": float(finished),
        "duration_s": duration,
        "prompt_tokens": float(df["prompt_len"].sum()) if not df.empty else 0.0,
        "output_tokens": float(output),
        "prompt_len_mean": float(df["prompt_len"].mean()) if not df.empty else None,
        "prompt_len_max": float(df["prompt_len"].max()) if not df.empty else None,
        "output_len_mean": float(df["tokens"].mean()) if not df.empty else None,
        "output_throughput": per_s(output),
        "total_throughput": per_s(output + prompt_served),
        "request_throughput": per_s(finished),
    }


def _preemptions(trace: Trace, df: pd.DataFrame) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    known = per_request_preemptions_known(trace)
    recorded = _preemption_times(trace)
    for mode in ("recompute", "swap"):
        key = f"preemptions_{mode}"
        counter = _counter(trace, key)
        if counter is not None:
            out[key] = counter
        elif known:
            out[key] = float(sum(1 for _, m, _ in recorded if m == mode))
        else:
            out[key] = None
    modes = [out["preemptions_recompute"], out["preemptions_swap"]]
    total = None if all(m is None for m in modes) else float(sum(m or 0.0 for m in modes))
    duration = _duration(trace)
    out["preemptions"] = total
    out["preemptions_per_s"] = _ratio(total, duration)
    if known and not df.empty:
        out["preempted_request_share"] = float((df["preemptions"] > 0).mean())
        out["max_preemptions_per_request"] = float(df["preemptions"].max())
    else:
        out["preempted_request_share"] = out["max_preemptions_per_request"] = None
    out["preemption_active_share"] = _active_share([t for t, _, _ in recorded], duration) if known else None
    for name in ("swap_outs", "swap_ins", "swap_fallbacks"):
        out[name] = _counter(trace, name)
    return out


def _active_share(times: Sequence[float], duration: float, windows: int = 10) -> float | None:
    """Share of ``windows`` equal slices of the run with at least one event.

    The test of a structural capacity gap (docs/benchmarks.md#diagnosis): preemptions only at the
    peak are the safety net working; preemptions throughout the run mean the engine is over capacity.
    """
    if duration <= 0:
        return None
    if not times:
        return 0.0
    idx = np.clip((np.asarray(times) / duration * windows).astype(int), 0, windows - 1)
    return len(set(idx.tolist())) / windows


def step_tokens_known(trace: Trace) -> bool:
    """True when the trace's steps are engine steps with their token counts; False when there are none
    or any is a ``/metrics`` sample (``StepRecord.sampled``), whose zeros mean "not exposed"."""
    return bool(trace.steps) and not any(s.sampled for s in trace.steps)


def _recompute(trace: Trace) -> dict[str, float | None]:
    recomputed = _counter(trace, "recomputed_tokens")
    if recomputed is None and not _hidden(trace, _RECOMPUTE_ALIASES):
        recomputed = float(sum(r.recomputed_tokens for r in trace.requests.values()))
    computed = _counter(trace, "computed_tokens")
    if computed is None and "computed_tokens" not in trace.not_exposed and step_tokens_known(trace):
        scheduled = sum(s.num_prefill_tokens + s.num_decode_tokens for s in trace.steps)
        computed = float(scheduled) if scheduled > 0 else None  # steps carry no token counts
    return {"recomputed_tokens": recomputed, "computed_tokens": computed,
            "recomputed_share": _ratio(recomputed, computed)}


def _swap(trace: Trace) -> dict[str, float | None]:
    out_b, in_b = _counter(trace, "swapped_out_bytes"), _counter(trace, "swapped_in_bytes")
    seconds = _counter(trace, "swap_seconds")
    moved = None if out_b is None and in_b is None else (out_b or 0.0) + (in_b or 0.0)
    return {"swapped_out_bytes": out_b, "swapped_in_bytes": in_b, "swap_seconds": seconds,
            "swap_bandwidth": _ratio(moved, seconds)}


def _prefix(trace: Trace) -> dict[str, float | None]:
    hits, queries = _counter(trace, "prefix_cache_hits"), _counter(trace, "prefix_cache_queries")
    if hits is None and queries is None and not _hidden(trace, _PREFIX_ALIASES):
        # rebuilt from requests: every prompt token is looked up once at admission
        hits = float(sum(r.prefix_hit_tokens for r in trace.requests.values()))
        queries = float(sum(r.prompt_len for r in trace.requests.values()))
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_hit_rate": _ratio(hits, queries), "prefill_chunks": _counter(trace, "prefill_chunks")}


def spike_threshold(gaps: np.ndarray, factor: float = DEFAULT_SPIKE_FACTOR) -> float | None:
    """``factor`` x median of the positive gaps, or None when there are none."""
    positive = gaps[gaps > 0]
    return float(factor * np.median(positive)) if positive.size else None


def _spikes(trace: Trace, gaps: _Gaps, factor: float) -> dict[str, float | None]:
    threshold = spike_threshold(gaps.gap, factor)
    out: dict[str, float | None] = dict.fromkeys(
        ("tbt_spike_threshold_s", "tbt_spikes", "tbt_spike_share", "tbt_spikes_preemption_share",
         "tbt_spikes_prefill_share", "tbt_spikes_other_share"))
    if threshold is None:
        return out
    is_spike = gaps.gap > threshold
    n = int(is_spike.sum())
    out.update(tbt_spike_threshold_s=threshold, tbt_spikes=float(n), tbt_spike_share=n / gaps.gap.size)
    if n == 0:
        return out
    steps = sorted(trace.steps, key=lambda s: s.t)
    step_t = np.asarray([s.t for s in steps], dtype=float)
    prefill_cum = np.concatenate([[0], np.cumsum([s.num_prefill_tokens > 0 for s in steps])])
    by_pre = by_prefill = 0
    for t0, t1, rid in zip(gaps.t0[is_spike], gaps.t1[is_spike], gaps.rid[is_spike], strict=True):
        r = trace.requests[rid]
        if any(t0 <= p <= t1 for p, _ in r.preemptions) or any(t0 <= x <= t1 for x in r.resumes):
            by_pre += 1
        else:
            # prefill steps that ended in (t0, t1]: a difference of the running count
            lo, hi = np.searchsorted(step_t, [t0, t1], "right")
            by_prefill += int(prefill_cum[hi] > prefill_cum[lo])
    known = per_request_preemptions_known(trace)
    steps_known = step_tokens_known(trace)  # sampled steps carry no prefill counts: not "no prefill"
    out["tbt_spikes_preemption_share"] = by_pre / n if known else None
    out["tbt_spikes_prefill_share"] = by_prefill / n if steps_known else None
    if known and steps_known:
        out["tbt_spikes_other_share"] = (n - by_pre - by_prefill) / n
    return out


def preemption_waits(trace: Trace) -> list[float]:
    """How long each recorded preemption kept its request off the engine (see module docstring)."""
    duration = _duration(trace)
    waits = []
    for r in trace.requests.values():
        resumes = sorted(r.resumes) if r.resumes else sorted(r.token_times)
        i = 0
        for p, _ in sorted(r.preemptions):
            while i < len(resumes) and resumes[i] < p:
                i += 1
            if i < len(resumes):
                end = resumes[i]
                i += 1 if r.resumes else 0  # a token can end one wait only; resumes are one per wait
            else:
                end = r.finished if r.finished is not None else duration
            waits.append(max(0.0, end - p))
    return waits


def _starvation(trace: Trace) -> dict[str, float | None]:
    if not per_request_preemptions_known(trace):
        return {"starvation_max_s": None, "starvation_mean_s": None}
    waits = preemption_waits(trace)
    if not waits:
        return {"starvation_max_s": 0.0, "starvation_mean_s": 0.0}
    return {"starvation_max_s": float(max(waits)), "starvation_mean_s": float(np.mean(waits))}


def step_frame(trace: Trace) -> pd.DataFrame:
    """One row per step, sorted by time (columns are :class:`~kvbench.core.trace.StepRecord` fields)."""
    columns = ["t", "duration", "num_running", "num_waiting", "num_swapped", "kv_usage", "cpu_kv_usage",
               "num_prefill_tokens", "num_decode_tokens", "num_preempted"]
    df = pd.DataFrame([vars(s) for s in trace.steps], columns=columns)
    for col in ("kv_usage", "cpu_kv_usage"):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    return df.sort_values("t", kind="stable").reset_index(drop=True)


def _weighted(values: pd.Series, weights: pd.Series) -> float | None:
    mask = values.notna()
    if not mask.any():
        return None
    v, w = values[mask].astype(float), weights[mask].astype(float)
    if w.sum() <= 0:
        return float(v.mean())
    return float(np.average(v, weights=w))


def _step_stats(trace: Trace) -> dict[str, float | None]:
    df = step_frame(trace)
    out: dict[str, float | None] = {"steps": float(len(df)),
                                    "step_duration_mean": float(df["duration"].mean()) if len(df) else None}
    w = df["duration"]
    for col, name in (("kv_usage", "kv_usage"), ("cpu_kv_usage", "cpu_kv_usage"), ("num_running", "running"),
                      ("num_waiting", "waiting"), ("num_swapped", "swapped")):
        out[f"{name}_mean"] = _weighted(df[col], w)
        out[f"{name}_max"] = float(df[col].max()) if df[col].notna().any() else None
    out["kv_usage_time_over_95"] = _weighted((df["kv_usage"] > KV_PINNED_LEVEL).astype(float).where(
        df["kv_usage"].notna()), w)
    return out


# --------------------------------------------------------------------------------------------
# public entry points


def summarize(trace: Trace, slos: str | Mapping[str, float] | None = None,
              spike_factor: float = DEFAULT_SPIKE_FACTOR) -> dict[str, float | None]:
    """Every figure of one run, flat (see the module docstring and :data:`METRIC_KEYS`)."""
    df = request_frame(trace)
    gaps = _gaps(trace)
    out: dict[str, float | None] = {}
    out.update(_throughput(trace, df))
    out.update(_stats(df["ttft"].to_numpy(float), "ttft"))
    out.update(_stats(gaps.gap, "tbt"))
    out.update(_stats(df["tpot"].to_numpy(float), "tpot"))
    out.update(_stats(df["e2e"].to_numpy(float), "e2e"))
    out.update(_preemptions(trace, df))
    out.update(_recompute(trace))
    out.update(_swap(trace))
    out.update(_prefix(trace))
    out.update(_spikes(trace, gaps, spike_factor))
    out.update(_starvation(trace))
    out.update(_step_stats(trace))
    if slos:
        out["goodput"], out["goodput_rps"] = goodput(trace, slos)
    return {k: _clean(out[k]) for k in (*METRIC_KEYS, *(GOODPUT_KEYS if slos else ()))}


def _clean(value: float | None) -> float | None:
    """JSON has no NaN: undefined figures become None."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _bin_edges(t_end: float, max_points: int) -> np.ndarray:
    return np.linspace(0.0, max(t_end, 1e-9), max_points + 1)


def _cdf(values: np.ndarray, points: int = 101) -> tuple[list[float], list[float]]:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return [], []
    if values.size > points:
        probs = np.linspace(0.0, 1.0, points)
        xs = np.quantile(values, probs)
    else:  # the exact step function: P(X <= x_i) = i / n
        probs = (np.arange(values.size) + 1) / values.size
        xs = np.sort(values)
    return [float(x) for x in xs], [float(p) for p in probs]


def series(trace: Trace, max_points: int = 300, max_markers: int = 500) -> dict[str, list]:
    """Timelines and distributions for charts, downsampled to at most ``max_points`` per timeline.

    Keys (all lists, aligned by prefix):

    * ``t``, ``kv_usage``, ``cpu_kv_usage``, ``num_running``, ``num_waiting``, ``num_swapped``:
      per step, or per time bin (bin end time, duration-weighted mean) when there are more steps.
      Missing KV usage is ``None``.
    * ``throughput_t``, ``throughput``: output tokens per second in equal time bins (bin centres;
      bins of about four mean step durations, 10..``max_points`` of them).
    * ``gap_t``, ``gap_max``, ``gap_p50``: token gaps by time bin of the later token; the max
      keeps every spike visible after downsampling.
    * ``workload_t`` (step clock only): each ``t`` on the workload's clock.
    * ``preempt_t``, ``preempt_mode``: preemption markers (evenly thinned to ``max_markers``).
    * ``server_t``, ``server_running``, ``server_preemptions``, ``server_prefix_hit_rate`` (engines reached over
      HTTP only): what the server's ``/metrics`` said at each sample, evenly thinned to ``max_points``: requests
      running, preemptions counted since the first sample, and the prefix-cache hit rate of the interval
      before each sample (hits / tokens looked up; None where nothing was looked up or it is not exposed).
    * ``ttft_cdf_x``/``ttft_cdf_p``, ``tbt_cdf_x``/``tbt_cdf_p``: empirical CDFs (<= 101 points).
    """
    duration = _duration(trace)
    out: dict[str, list] = {}
    out.update(_step_series(trace, max_points))
    out.update(_server_series(trace, max_points))
    if trace.step_seconds is not None:
        # on the step clock a trace second is not a workload second: each ``t`` on the workload's clock,
        # so a report can mark a workload event (a surge's start) on the trace's time axis
        clock = workload_clock(trace)
        out["workload_t"] = [float(clock(t)) for t in out["t"]]
    # Throughput bins span several steps: narrower bins alias with the step cadence (0, 2x, 0...).
    step_mean = float(np.mean([s.duration for s in trace.steps])) if trace.steps else 0.0
    n_bins = int(np.clip(duration / (4 * step_mean), 10, max_points)) if step_mean > 0 else min(50, max_points)
    tp_edges = _bin_edges(duration, n_bins)
    token_times = np.asarray([t for r in trace.requests.values() for t in r.token_times], dtype=float)
    counts, _ = np.histogram(token_times, bins=tp_edges)
    out["throughput_t"] = [float(x) for x in (tp_edges[:-1] + tp_edges[1:]) / 2]
    out["throughput"] = [float(c / (tp_edges[1] - tp_edges[0])) for c in counts]
    edges = _bin_edges(duration, max_points)
    gaps = _gaps(trace)
    out.update(_gap_series(gaps, edges))
    marks = _preemption_times(trace)
    if len(marks) > max_markers:
        keep = np.linspace(0, len(marks) - 1, max_markers).round().astype(int)
        marks = [marks[i] for i in keep]
    out["preempt_t"] = [float(t) for t, _, _ in marks]
    out["preempt_mode"] = [m for _, m, _ in marks]
    df = request_frame(trace)
    out["ttft_cdf_x"], out["ttft_cdf_p"] = _cdf(df["ttft"].to_numpy(float))
    out["tbt_cdf_x"], out["tbt_cdf_p"] = _cdf(gaps.gap)
    return out


def _none_if_nan(values: Iterable[float]) -> list[float | None]:
    return [None if (v is None or (isinstance(v, float) and math.isnan(v))) else float(v) for v in values]


def _step_series(trace: Trace, max_points: int) -> dict[str, list]:
    df = step_frame(trace)
    cols = ["kv_usage", "cpu_kv_usage", "num_running", "num_waiting", "num_swapped"]
    if len(df) <= max_points:
        return {"t": _none_if_nan(df["t"]), **{c: _none_if_nan(df[c]) for c in cols}}
    # Duration-weighted mean per time bin, vectorised with bincount (a groupby per bin and column
    # costs seconds on long runs). Zero-duration steps get a tiny weight so they still count.
    edges = _bin_edges(float(df["t"].max()), max_points)
    bins = np.clip(np.searchsorted(edges, df["t"].to_numpy(), "left") - 1, 0, max_points - 1)
    weights = np.where(df["duration"].to_numpy(float) > 0, df["duration"].to_numpy(float), 1e-12)
    occupied = np.bincount(bins, minlength=max_points) > 0
    out: dict[str, list] = {"t": [float(x) for x in edges[1:][occupied]]}
    for c in cols:
        v = df[c].to_numpy(float)
        valid = ~np.isnan(v)
        w = np.where(valid, weights, 0.0)
        sum_w = np.bincount(bins, weights=w, minlength=max_points)
        sum_vw = np.bincount(bins, weights=np.where(valid, v, 0.0) * w, minlength=max_points)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(sum_w > 0, sum_vw / np.where(sum_w > 0, sum_w, 1.0), np.nan)
        out[c] = _none_if_nan(mean[occupied])
    return out


def _server_series(trace: Trace, max_points: int) -> dict[str, list]:
    """The server's own view over the run, from its ``/metrics`` samples (see :func:`series`); empty when the
    trace has no sample carrying the server's counts."""
    samples = sorted((s for s in trace.steps if s.sampled), key=lambda s: s.t)
    if not any(s.server_preemptions is not None or s.server_prefix_queries is not None for s in samples):
        return {}
    if len(samples) > max_points:
        keep = np.linspace(0, len(samples) - 1, max_points).round().astype(int)
        samples = [samples[i] for i in keep]
    rates: list[float | None] = []
    for before, now in zip([None, *samples[:-1]], samples, strict=True):
        looked = None if before is None or None in (now.server_prefix_queries, before.server_prefix_queries) \
            else now.server_prefix_queries - before.server_prefix_queries
        hits = None if before is None or None in (now.server_prefix_hits, before.server_prefix_hits) \
            else now.server_prefix_hits - before.server_prefix_hits
        rates.append(hits / looked if looked and hits is not None else None)
    return {"server_t": [float(s.t) for s in samples], "server_running": [s.num_running for s in samples],
            "server_preemptions": [s.server_preemptions for s in samples], "server_prefix_hit_rate": rates}


def _gap_series(gaps: _Gaps, edges: np.ndarray) -> dict[str, list]:
    if gaps.gap.size == 0:
        return {"gap_t": [], "gap_max": [], "gap_p50": []}
    g = pd.DataFrame({"bin": np.clip(np.searchsorted(edges, gaps.t1, "left") - 1, 0, len(edges) - 2),
                      "gap": gaps.gap})
    agg = g.groupby("bin", sort=True)["gap"].agg(["max", "median"])
    return {"gap_t": [float(edges[int(b) + 1]) for b in agg.index],
            "gap_max": [float(x) for x in agg["max"]], "gap_p50": [float(x) for x in agg["median"]]}


# --------------------------------------------------------------------------------------------
# curves across runs


def _clean_points(xs: Sequence[float], *ys: Sequence[float | None]) -> list[tuple[float, ...]]:
    rows = []
    for row in zip(xs, *ys, strict=True):
        if any(v is None or not math.isfinite(float(v)) for v in row):
            continue
        rows.append(tuple(float(v) for v in row))
    return sorted(rows)


def knee(xs: Sequence[float], ys: Sequence[float | None], min_gain: float = KNEE_MIN_GAIN) -> float | None:
    """The concurrency where throughput stops rising.

    Rule: with points sorted by x, the knee is the first x_i whose next point gains less than
    ``min_gain`` (5%) relative to y_i, i.e. ``y[i+1] < y[i] * (1 + min_gain)``: going further buys
    (almost) nothing or loses throughput. If every step gains at least ``min_gain``, the curve has
    not flattened within the sweep and the knee is the last x. Points with a missing y are
    ignored; ``None`` when no point is left.
    """
    pts = _clean_points(xs, ys)
    if not pts:
        return None
    for (x0, y0), (_, y1) in itertools.pairwise(pts):
        if y1 < y0 + abs(y0) * min_gain:
            return x0
    return pts[-1][0]


def crossover(xs: Sequence[float], a: Sequence[float | None], b: Sequence[float | None]) -> float | None:
    """The x where curves ``a`` and ``b`` cross, linearly interpolated; None if they never do.

    Used for swap-vs-recompute cost by sequence length: below the crossover one mode is cheaper,
    above it the other. Returns the first crossing in x order (an x where they are equal counts);
    points where either curve is missing are ignored.
    """
    pts = _clean_points(xs, a, b)
    for (x0, a0, b0), (x1, a1, b1) in itertools.pairwise(pts):
        d0, d1 = a0 - b0, a1 - b1
        if d0 == 0:
            return x0
        if d0 * d1 < 0:
            return x0 + (x1 - x0) * d0 / (d0 - d1)
    if pts and pts[-1][1] == pts[-1][2]:
        return pts[-1][0]
    return None

