"""What kvbench's own ``/metrics`` sampler cost an engine's streams, measured on every run.

Over HTTP a poller scrapes the server's ``/metrics`` during a run (:mod:`kvbench.drivers.http_driver`, every
``metrics_interval`` seconds). On a server whose front end runs one loop (vLLM's API server) each scrape is work
every open stream waits for, so a scrape can land in that engine's inter-token gaps and move its p99, charging one
engine for kvbench's observation and not another. The trace keeps each scrape's ``(asked, answered)`` times on the
clock of the token times (:attr:`~kvbench.core.trace.Trace.scrapes`); this module measures from them.

Definitions (the contract of a result's ``sampler_cost``, :func:`measure`):

* a **gap** is one inter-token gap ``(t0, t1)`` of one stream, as in :mod:`kvbench.bench.metrics`; it lies
  **across a scrape** when the open intervals ``(t0, t1)`` and ``(asked, answered)`` meet (a gap of zero length:
  when its instant lies inside the scrape), else it is **clear** of scrapes. The split is exact on the recorded times.
* ``tbt_p50``/``tbt_p99`` over every gap (the figures :func:`kvbench.bench.metrics.summarize` reports) and
  ``tbt_p50_clear``/``tbt_p99_clear`` over the clear gaps only.
* **Length bias**, and its control: a long gap meets a scrape more often than a short one whatever the scrapes
  do (at 10 Hz every gap over 0.1 s meets one), so "clear" gaps are short ones and their p99 is lower even on a
  server that scrapes cost nothing. The **control windows** are spans of the scrapes' own lengths placed midway
  between consecutive scrapes, where no scrape was: gaps across them carry the same bias. A gap long enough to
  meet both a scrape and a control window belongs to neither side of the comparison (a gap a scrape stretched
  would otherwise count against the control too): ``tbt_p99_scrapes_only`` is the p99 of the gaps across a scrape
  and no control window, ``tbt_p99_control_only`` of those across a control window and no scrape
  (``gaps_across_control`` counts these). The sampler is said to have **moved** an engine's p99 (``moved``) only
  when ``tbt_p99`` exceeds ``tbt_p99_clear`` and ``tbt_p99_scrapes_only`` exceeds ``tbt_p99_control_only``, each
  by more than :data:`MOVED_SHARE` and :data:`MOVED_MIN_S`, and the stall is no accident of a few gaps: each
  scrape is paired with the control window after it, each window charged its gaps' stall (below), and the
  scrape must be charged more in so many of the ``window_pairs`` that differ (``pairs_scrape_longer``) that
  chance does so at most :data:`MOVED_P` of the time (``sign_p``, a one-sided sign test). ``None`` (undecided)
  when either side of the comparison has no gap or there are too few pairs for the test to reach
  :data:`MOVED_P`.
* **Stall**: a gap across scrapes is charged the part of it beyond the clear gaps' median, at most the time it
  overlapped scrapes (a scrape cannot hold a stream longer than it lasts). ``stall_s`` sums that over the gaps
  across scrapes, ``control_stall_s`` the same over the control windows (scaled to as many windows as scrapes):
  what chance alone charges. ``stall_share`` = (``stall_s`` - ``control_stall_s``) / ``stream_s``, the streams'
  total time between tokens: the estimated share of streaming time the scrapes held the streams, the most
  throughput they can have cost (a server whose engine goes on computing while its front end answers a scrape
  sends the held tokens together afterwards and loses less). Noise can make it slightly negative; it is
  reported as measured.

A result's ``sampler_cost`` has ``status`` :data:`MEASURED`, :data:`NO_SAMPLER` (no scrape ran during the run:
an in-process engine, or ``metrics_interval=0``; nothing to charge) or :data:`NOT_MEASURED` (with ``why``: a
trace with /metrics samples but no scrape times, or no gap to measure). It never reads as a zero cost where the
data is missing, and a result without it (a file from before it existed) is read as not measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.bench import metrics
from kvbench.bench.formatting import fmt_time
from kvbench.core.trace import Trace

MEASURED = "measured"
NO_SAMPLER = "no sampler"
NOT_MEASURED = "not measured"
#: a p99 moved by the sampler: more than this share of the figure without it...
MOVED_SHARE = 0.10
#: ...and more than this many seconds (a 0.3 ms difference between two sub-millisecond p99s moves nothing a
#: reader would act on)
MOVED_MIN_S = 0.001
#: ...and the scrapes' windows charged more than their control windows in so many pairs that chance would do it
#: at most this often (a one-sided sign test): a p99 over a few hundred gaps of a storm is noisy on its own
MOVED_P = 0.01

#: the figures of a measured ``sampler_cost`` (each None where it is undefined: no clear gap, no control window)
FIGURES: tuple[str, ...] = (
    "scrapes", "scrape_median_s", "gaps", "gaps_clear", "gaps_across_scrapes", "gaps_across_control",
    "tbt_p50", "tbt_p99", "tbt_p50_clear", "tbt_p99_clear", "tbt_p99_across_scrapes", "tbt_p99_scrapes_only",
    "tbt_p99_control_only",
    "stall_s", "control_stall_s", "stream_s", "stall_share", "window_pairs", "pairs_scrape_longer", "sign_p",
)


@dataclass(frozen=True)
class Windows:
    """Disjoint spans sorted by start (the union of the given spans)."""

    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def union(cls, spans: Iterable[tuple[float, float]]) -> Windows:
        merged: list[list[float]] = []
        for a, b in sorted((float(a), float(b)) for a, b in spans if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        arr = np.asarray(merged, dtype=float).reshape(-1, 2)
        return cls(arr[:, 0], arr[:, 1])

    def __len__(self) -> int:
        return int(self.starts.size)

    def meets(self, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        """Per gap ``(t0, t1)``: whether it meets a window (open intervals; a zero gap: inside one)."""
        if not len(self):
            return np.zeros(t0.shape, dtype=bool)
        j = np.searchsorted(self.starts, t1, side="left")  # windows that start before t1
        last_end = np.where(j > 0, self.ends[np.maximum(j - 1, 0)], -np.inf)  # ends are sorted too (disjoint)
        return (j > 0) & (last_end > t0)

    def covered(self, t: np.ndarray) -> np.ndarray:
        """Total window length at or before each ``t``."""
        if not len(self):
            return np.zeros(t.shape)
        cum = np.cumsum(self.ends - self.starts)
        i = np.searchsorted(self.starts, t, side="right")  # windows started by t
        prev = np.maximum(i - 1, 0)
        past = np.maximum(0.0, self.ends[prev] - t)  # the part of the last started window after t
        return np.where(i > 0, cum[prev] - past, 0.0)

    def overlap(self, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        """Per gap, how long it overlapped the windows."""
        return self.covered(t1) - self.covered(t0)

    def between(self) -> tuple[Windows, np.ndarray]:
        """Control windows: one per pair of consecutive windows, as long as the first, midway between the two
        (where the free span between them holds it); and, for each, the index of the window it follows."""
        d = (self.ends - self.starts)[:-1]
        free_from, free_to = self.ends[:-1], self.starts[1:]
        fits = free_to - free_from >= d
        mid = (free_from + free_to) / 2
        return Windows((mid - d / 2)[fits], (mid + d / 2)[fits]), np.nonzero(fits)[0]

    def charges(self, t0: np.ndarray, t1: np.ndarray, excess: np.ndarray) -> np.ndarray:
        """Per window: the sum, over the gaps ``(t0, t1)`` that meet it, of the gap's ``excess`` up to the time the
        gap overlapped that window."""
        out = np.zeros(len(self))
        if not len(self) or not t0.size:
            return out
        first = np.searchsorted(self.ends, t0, side="right")  # the first window ending after t0
        last = np.searchsorted(self.starts, t1, side="left") - 1  # the last starting before t1
        one = np.nonzero(first == last)[0]  # most gaps meet one window at most
        k = first[one]
        over = np.minimum(t1[one], self.ends[k]) - np.maximum(t0[one], self.starts[k])
        np.add.at(out, k, np.minimum(excess[one], np.maximum(over, 0.0)))
        for i in np.nonzero(first < last)[0]:  # a long gap across several
            for k in range(first[i], last[i] + 1):
                over = min(t1[i], self.ends[k]) - max(t0[i], self.starts[k])
                out[k] += min(excess[i], max(over, 0.0))
        return out


def gaps_of(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Every inter-token gap of ``trace``, pooled: ``(t0, t1)`` arrays, the very gaps the metrics' tbt figures
    use (:mod:`kvbench.bench.metrics`)."""
    gaps = metrics._gaps(trace)
    return gaps.t0, gaps.t1


def _pct(values: np.ndarray, p: float) -> float | None:
    return float(np.percentile(values, p)) if values.size else None


def _beyond(high: float | None, low: float | None) -> bool:
    return high is not None and low is not None and high - low > max(MOVED_SHARE * low, MOVED_MIN_S)


def sign_p(wins: int, pairs: int) -> float:
    """One-sided sign test: the chance of ``wins`` or more of ``pairs`` fair coin flips."""
    return sum(math.comb(pairs, j) for j in range(wins, pairs + 1)) / 2 ** pairs if pairs else 1.0


def moved(figures: Mapping[str, Any]) -> bool | None:
    """Whether the sampler moved the p99 gap (see the module docstring); None when it cannot be told."""
    if not figures.get("gaps_across_scrapes"):
        return False  # no gap met a scrape: it moved nothing
    if not _beyond(figures.get("tbt_p99"), figures.get("tbt_p99_clear")) and figures.get("tbt_p99_clear") is not None:
        return False
    if figures.get("tbt_p99_control_only") is None or figures.get("tbt_p99_scrapes_only") is None \
            or figures.get("tbt_p99_clear") is None or sign_p(*[int(figures.get("window_pairs") or 0)] * 2) > MOVED_P:
        return None  # too few gaps or pairs of windows to tell
    return _beyond(figures.get("tbt_p99_scrapes_only"), figures.get("tbt_p99_control_only")) \
        and float(figures.get("sign_p", 1.0)) <= MOVED_P


def measure(trace: Trace) -> dict[str, Any]:
    """The sampler's cost in ``trace``: ``{"status": ..., "why": words, **FIGURES, "moved": bool | None}``
    (figures only when measured)."""
    if trace.scrapes is None:
        if any(s.sampled for s in trace.steps):
            return {"status": NOT_MEASURED, "why": "/metrics was sampled during the run, but the scrapes' times "
                                                   "were not recorded"}
        return {"status": NO_SAMPLER, "why": "no /metrics sampler ran during the run"}
    t0, t1 = gaps_of(trace)
    if not t0.size:
        return {"status": NOT_MEASURED, "why": "no stream had two tokens: no inter-token gap to measure"}
    gap = t1 - t0
    scrapes = Windows.union(trace.scrapes)
    control, follows = scrapes.between()
    across, across_control = scrapes.meets(t0, t1), control.meets(t0, t1)
    clear = gap[~across]
    median_clear = float(np.median(clear)) if clear.size else None

    def stall(windows: Windows) -> float | None:
        if median_clear is None:
            return None
        return float(np.clip(gap - median_clear, 0.0, windows.overlap(t0, t1)).sum())

    real, chance = stall(scrapes), stall(control)
    if chance is not None and len(control):
        chance *= len(scrapes) / len(control)
    elif chance is not None:
        chance = None  # no room between scrapes for a control window: chance not measured
    stream_s = float(gap.sum())
    pairs = wins = 0
    if median_clear is not None and len(control):
        excess = np.maximum(gap - median_clear, 0.0)
        diff = scrapes.charges(t0, t1, excess)[follows] - control.charges(t0, t1, excess)
        pairs, wins = int((diff != 0).sum()), int((diff > 0).sum())
    lengths = [b - a for a, b in trace.scrapes]
    out: dict[str, Any] = {
        "status": MEASURED,
        "scrapes": len(trace.scrapes),
        "scrape_median_s": float(statistics.median(lengths)) if lengths else None,
        "gaps": int(gap.size), "gaps_clear": int(clear.size), "gaps_across_scrapes": int(across.sum()),
        "gaps_across_control": int((across_control & ~across).sum()),
        "tbt_p50": _pct(gap, 50), "tbt_p99": _pct(gap, 99),
        "tbt_p50_clear": _pct(clear, 50), "tbt_p99_clear": _pct(clear, 99),
        "tbt_p99_across_scrapes": _pct(gap[across], 99),
        "tbt_p99_scrapes_only": _pct(gap[across & ~across_control], 99),
        "tbt_p99_control_only": _pct(gap[across_control & ~across], 99),
        "stall_s": real, "control_stall_s": chance, "stream_s": stream_s,
        "stall_share": (real - chance) / stream_s if real is not None and chance is not None and stream_s > 0
        else None,
        "window_pairs": pairs, "pairs_scrape_longer": wins, "sign_p": sign_p(wins, pairs),
    }
    out["moved"] = moved(out)
    out["why"] = _why(out)
    return out


def _why(m: Mapping[str, Any]) -> str:
    if not m["scrapes"]:
        return "the sampler ran but made no scrape: nothing to charge"
    said = (f"{m['gaps_across_scrapes']} of {m['gaps']} gaps lay across one of {m['scrapes']} scrapes "
            f"({fmt_time(m['scrape_median_s'])} median)")
    if m["moved"]:
        return (f"{said}; gaps across scrapes reached {fmt_time(m['tbt_p99_scrapes_only'])} at p99 against "
                f"{fmt_time(m['tbt_p99_control_only'])} across equal spans between scrapes: the sampler moved "
                "this engine's gap figures")
    if m["moved"] is None:
        return (f"{said}; too few scrapes or gaps to compare with equal spans between scrapes: whether it moved "
                "them is undecided")
    return f"{said}; the p99 gap is not longer for them, beyond noise"


def of_traces(traces: Iterable[Trace]) -> dict[str, Any]:
    """:func:`measure` of a result's repeats, as one record: a figure is the median over the repeats (as the
    result's metrics are), ``moved`` is decided on those medians; not measured where any repeat was not, no
    sampler where none had one."""
    each = [measure(t) for t in traces]
    if not each:
        return {"status": NOT_MEASURED, "why": "no run"}
    if len(each) == 1:
        return each[0]
    statuses = {m["status"] for m in each}
    if statuses == {NO_SAMPLER}:
        return {**each[0], "repeats": len(each)}
    if NOT_MEASURED in statuses:
        return {**next(m for m in each if m["status"] == NOT_MEASURED), "repeats": len(each)}
    if NO_SAMPLER in statuses:
        return {"status": NOT_MEASURED, "why": "the sampler ran in some repeats and not in others",
                "repeats": len(each)}
    out: dict[str, Any] = {"status": MEASURED, "repeats": len(each)}
    for key in FIGURES:
        values = [m[key] for m in each if m.get(key) is not None]
        out[key] = statistics.median(values) if len(values) == len(each) else None
    out["moved"] = moved(out)
    out["why"] = _why(out) + f" (medians of {len(each)} repeats)"
    return out


# --------------------------------------------------------------------------------------------
# reading results files


def of_result(result: Mapping[str, Any] | None) -> dict[str, Any]:
    """A recorded result's ``sampler_cost``; not measured when it has none (a file from before it existed)."""
    m = result.get("sampler_cost") if isinstance(result, Mapping) else None
    if isinstance(m, Mapping) and m.get("status") in (MEASURED, NO_SAMPLER, NOT_MEASURED):
        return dict(m)
    return {"status": NOT_MEASURED, "why": "this result was recorded before kvbench measured its sampler's cost"}


def aside(result: Mapping[str, Any] | None) -> str:
    """What to write beside a result's p99 gap: "28 ms clear of /metrics scrapes; 142 scrapes", "no sampler",
    or "sampler cost not measured"."""
    m = of_result(result)
    if m["status"] == NO_SAMPLER:
        return "no sampler"
    if m["status"] == NOT_MEASURED:
        return "sampler cost not measured"
    scrapes = f"{m['scrapes']:,.0f} scrape{'s' if m['scrapes'] != 1 else ''}"
    if m.get("tbt_p99_clear") is None:
        return f"no gap clear of /metrics scrapes; {scrapes}"
    return f"{fmt_time(m['tbt_p99_clear'])} clear of /metrics scrapes; {scrapes}"


def note(result: Mapping[str, Any] | None) -> str:
    """A sentence for a result whose gap figures the sampler moved ("" otherwise): by how much, and its cost."""
    m = of_result(result)
    if m["status"] != MEASURED or not m.get("moved"):
        return ""
    cost = m.get("stall_share")
    stalled = f"; streams spent about {cost * 100:.1f}% of their time stalled by them" \
        if cost is not None and cost > 0 else ""
    return (f"kvbench's /metrics sampler moved this figure: p99 gap {fmt_time(m['tbt_p99'])} over every gap, "
            f"{fmt_time(m['tbt_p99_clear'])} clear of its {m['scrapes']:,.0f} scrapes; gaps across a scrape reached "
            f"{fmt_time(m['tbt_p99_scrapes_only'])} at p99 against {fmt_time(m['tbt_p99_control_only'])} "
            f"across equal spans between scrapes{stalled} (metrics_interval=0 turns the sampler off)")


def table_note(results: Iterable[Mapping[str, Any]]) -> str:
    """For a table's gap columns (read after "TBT columns "): the engines among ``results`` whose gap figures the
    sampler moved, each with its p99 over every gap and clear of scrapes ("" when it moved none)."""
    moved_in = {}
    for r in results:
        m = of_result(r)
        if m["status"] == MEASURED and m.get("moved"):
            moved_in.setdefault(str(r.get("engine")), f"p99 {fmt_time(m['tbt_p99'])}, "
                                                      f"{fmt_time(m['tbt_p99_clear'])} clear of scrapes")
    if not moved_in:
        return ""
    return "moved by kvbench's own /metrics sampler for " + ", ".join(f"{e} ({x})" for e, x in moved_in.items())
