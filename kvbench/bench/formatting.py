"""How metric values read in the report, the CLI and the scenarios' headlines: units chosen from the key.

Contract: every formatter accepts None (and NaN) and returns "n/a" for it, so "not exposed by the
engine" never renders as a zero. A figure that is one of the engine's own counters (a name of
:mod:`kvbench.core.counters`) reads "not exposed" when None: the engine does not count it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from kvbench.core.counters import COUNTER_NAMES

NOT_AVAILABLE = "n/a"
#: how a counter of the contract that the engine does not expose reads
NOT_EXPOSED = "not exposed"

_LABELS = {
    "output_throughput": "output tok/s", "total_throughput": "total tok/s", "request_throughput": "req/s",
    "goodput": "goodput", "goodput_rps": "goodput req/s", "preemptions": "preemptions",
    "preemptions_per_s": "preemptions/s", "preempted_request_share": "requests preempted",
    "max_preemptions_per_request": "max preemptions of one request", "recomputed_tokens": "recomputed tokens",
    "recomputed_share": "recomputed share", "swap_bandwidth": "swap bandwidth", "prefix_hit_rate": "prefix hit rate",
    "tbt_spikes": "TBT spikes", "starvation_max_s": "longest preempted wait", "kv_usage_mean": "KV usage (mean)",
    "kv_usage_time_over_95": "time KV > 95%", "waiting_max": "max waiting", "running_max": "max running",
}


def metric_label(key: str) -> str:
    """A short human label: ``tbt_p99`` -> "p99 TBT"."""
    if key in _LABELS:
        return _LABELS[key]
    for lat in ("ttft", "tbt", "tpot", "e2e"):
        if key.startswith(lat + "_"):
            return f"{key[len(lat) + 1:]} {lat.upper()}"
    return key.replace("_", " ")


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def fmt_time(seconds: float | None) -> str:
    """0.0123 -> "12.3 ms"; 2.5 -> "2.50 s"; 4e-5 -> "40 µs"."""
    if _missing(seconds):
        return NOT_AVAILABLE
    s = float(seconds)  # type: ignore[arg-type]
    if s == 0:
        return "0"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if abs(s) < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s" if abs(s) < 100 else f"{s:,.0f} s"


def fmt_bytes(n: float | None) -> str:
    if _missing(n):
        return NOT_AVAILABLE
    value = float(n)  # type: ignore[arg-type]
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"  # pragma: no cover - loop always returns


def fmt_ratio(ratio: float | None) -> str:
    if _missing(ratio):
        return NOT_AVAILABLE
    return f"{float(ratio):.2f}×"  # type: ignore[arg-type]


#: the jitter a single run's ratio still carries (kvbench.bench.scenarios.declare.MIN_RATIO_NOISE)
SINGLE_RUN_NOISE = 0.02


def ratio_decimals(value: float, noise: float | None) -> int:
    """Decimals that keep a ratio's last digit at the order of its absolute noise (0 to 2): ±18% on
    20.95 is ±3.8, so "21×"; a single run (``noise`` None) still has :data:`SINGLE_RUN_NOISE` of jitter."""
    err = abs(value) * max(noise or 0.0, SINGLE_RUN_NOISE)
    if err <= 0 or not math.isfinite(err):
        return 2
    return max(0, min(2, -math.floor(math.log10(err))))


def fmt_noisy_ratio(ratio: float | None, noise: float | None) -> str:
    """"1.0× ±45%", "21× ±18%", "1.23×" (a single run: no ±); "–" when there is no ratio (a zero side)."""
    if _missing(ratio):
        return "–"
    r = float(ratio)  # type: ignore[arg-type]
    text = f"{r:,.{ratio_decimals(r, noise)}f}×"
    return text + (f" ±{noise * 100:.0f}%" if noise is not None else "")


def fmt_metric(key: str, value: float | None) -> str:
    """Format ``value`` of metric ``key`` with its unit ("not exposed" for a missing engine counter)."""
    if _missing(value):
        return NOT_EXPOSED if key in COUNTER_NAMES else NOT_AVAILABLE
    v = float(value)  # type: ignore[arg-type]
    if key.endswith(("_share", "_rate", "_time_over_95")) or key == "goodput" or key.startswith(
            ("kv_usage", "cpu_kv_usage")):
        return f"{v * 100:.1f}%"
    if key.endswith("_throughput") or key == "goodput_rps":
        unit = "req/s" if key in ("request_throughput", "goodput_rps") else "tok/s"
        return f"{v:,.1f} {unit}"
    if key == "swap_bandwidth":
        return fmt_bytes(v) + "/s"
    if key.endswith("_bytes"):
        return fmt_bytes(v)
    if key == "swap_seconds":
        return fmt_time(v)
    if key.endswith("_over_low"):  # a ratio of two latencies
        return fmt_ratio(v)
    if "_steps" in key:  # a latency counted in engine steps
        return f"{v:,.0f} steps" if v == int(v) else f"{v:,.1f} steps"
    if key.endswith(("_s", "_mean", "_max", "_p50", "_p90", "_p99")) and key.split("_")[0] in (
            "ttft", "tbt", "tpot", "e2e", "starvation", "swap", "step", "duration"):
        return fmt_time(v)
    # a latency of one class or phase: ttft_p99_wave, ttft_p50_high, ttft_p99_after_surge
    if key.split("_")[0] in ("ttft", "tbt", "tpot", "e2e") and "_p" in key:
        return fmt_time(v)
    if key.endswith("_per_s"):
        return f"{v:,.2f}/s"
    if v == int(v):
        return f"{int(v):,}"
    return f"{v:,.3g}"


def fmt_figure(value: float | None, fmt: str = "{:,.4g}", missing: str = NOT_AVAILABLE) -> str:
    """One figure through ``fmt`` (a ``str.format`` template, as :func:`fmt_median_range` takes); ``missing``
    for None or NaN. A table that marks its missing figures otherwise ("-") passes its mark, so that a table
    reads one mark throughout."""
    if _missing(value):
        return missing
    return fmt.format(float(value))  # type: ignore[arg-type]


def fmt_share(value: float | None, missing: str = NOT_AVAILABLE) -> str:
    """A share (``0..1``, or above 1) as a whole percentage: ``0.125`` -> "12%"; ``missing`` for None or NaN."""
    return fmt_figure(value, "{:.0%}", missing)


def fmt_median_range(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    """Repeated rounds as text: ``median [min-max]``, each figure through ``fmt`` (e.g. ``"{:.2f}x"`` for
    ratios). "n/a" for no values."""
    nums = sorted(v for v in values if not _missing(v))
    if not nums:
        return NOT_AVAILABLE
    return f"{fmt.format(statistics.median(nums))} [{fmt.format(nums[0])}-{fmt.format(nums[-1])}]"
