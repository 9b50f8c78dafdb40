"""How an engine's tokens reached kvbench: one at a time, as its engine computed them, or in bursts.

A stream's token arrival times are kvbench's only view of when an engine computed each token. That view
holds while the server writes each token as it is computed. A server whose front end writes several tokens
at once (vLLM's over HTTP on a small machine: a median inter-token gap of 0 and a longest of 0.5-1.5 s) makes
the spacing of tokens say when it *wrote*, not when its engine stopped or resumed a request: every figure
computed from that spacing (inter-token gap percentiles, spikes) is then an artifact of its writer, not of its
engine, and is not comparable with another engine's.

The measure, shared by the conformance side (:mod:`kvbench.conformance.victims_seen`, which leaves a reading
undecided on a bursty server) and the report (which marks such gap figures not comparable):

* **tokens per chunk**: the tokens of every stream over their distinct arrival times (a *chunk*: the tokens
  of one stream that arrived at the same instant), pooled over every stream of a run.
* **bursty**: more than :data:`MAX_TOKENS_PER_CHUNK` tokens per chunk.

The in-process engines record one token per request per step, each step at its own time: 1.0, never
bursty. Readers tolerate the absence of a result's ``delivery`` (files written before it existed): unknown,
never bursty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: more tokens per chunk than this, over every stream, is a server delivering in bursts. Two, because a
#: stream whose tokens come one per engine step stays near one (the reference server measured 1.1-1.35 per
#: scenario over HTTP: the client's reads sometimes take two writes at once), while above two most gaps are
#: zero, as vLLM's median gap of 0 shows (a zero share ``z`` of the gaps means about ``1 / (1 - z)`` tokens a
#: chunk): the gap percentiles then measure the writer. The conformance reading of victims uses the same
#: threshold, so the two sides never disagree about a server.
MAX_TOKENS_PER_CHUNK = 2.0

def is_gap_metric(metric: str) -> bool:
    """Whether ``metric`` is computed from the spacing of tokens inside a stream: every ``tbt_*`` figure of
    kvbench.bench.metrics (percentiles, spikes and their shares, a scenario's per-class ``tbt_p99_high``), artifacts
    of the writer on a bursty engine. TPOT and throughput are not: they span a whole stream (first to last token),
    which bursts move by at most one burst."""
    return metric.startswith("tbt_")


def tokens_per_chunk(streams: Iterable[Sequence[float]]) -> float | None:
    """Tokens over distinct arrival times, pooled over ``streams`` (each a stream's token arrival times);
    None without a token."""
    tokens = chunks = 0
    for times in streams:
        tokens += len(times)
        chunks += len(set(times))
    return tokens / chunks if chunks else None


def bursty(per_chunk: float | None) -> bool:
    """Whether ``per_chunk`` tokens per chunk is delivery in bursts (None, unknown: not bursty)."""
    return per_chunk is not None and per_chunk > MAX_TOKENS_PER_CHUNK


def describe(streams: Iterable[Sequence[float]]) -> dict[str, Any] | None:
    """``{"tokens_per_chunk": x, "bursty": bool, "why": words}`` of ``streams``; None without a token."""
    x = tokens_per_chunk(streams)
    if x is None:
        return None
    if bursty(x):
        why = (f"{x:.1f} tokens per chunk over every stream (more than {MAX_TOKENS_PER_CHUNK:g}): the server wrote "
               "tokens in bursts, so the gaps between tokens say when it wrote, not when its engine computed them")
    else:
        why = (f"{x:.2f} tokens per chunk over every stream (at most {MAX_TOKENS_PER_CHUNK:g}): tokens arrived about "
               "one at a time, as computed")
    return {"tokens_per_chunk": round(x, 3), "bursty": bursty(x), "why": why}


def of_traces(traces: Iterable[Any]) -> dict[str, Any] | None:
    """:func:`describe` of every request of ``traces`` (:class:`~kvbench.core.trace.Trace`, e.g. a result's
    repeats, pooled)."""
    return describe([r.token_times for t in traces for r in t.requests.values()])


# --------------------------------------------------------------------------------------------
# reading results files


def of_result(result: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A recorded result's ``delivery`` (None when it has none: a file from before it existed)."""
    d = result.get("delivery") if isinstance(result, Mapping) else None
    return d if isinstance(d, Mapping) and isinstance(d.get("tokens_per_chunk"), int | float) else None  # type: ignore[return-value]


def bursty_engines(results: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, tuple[float, str]]:
    """engine -> (its most tokens per chunk, the scenario it was measured in) for every engine that delivered
    in bursts in any of ``results`` (``(scenario name, result)`` pairs).

    A burst is the server's writer at work, and one server writes the same way in every scenario: an engine
    seen bursty in one scenario has its gap figures marked in all, also where a lighter load left its pooled
    measure under the threshold (vLLM measured 1.2-1.9 on some storms and 2.2-50 on others in one run)."""
    out: dict[str, tuple[float, str]] = {}
    for scenario, result in results:
        d = of_result(result)
        if d is None or not bursty(float(d["tokens_per_chunk"])):
            continue
        engine, x = str(result.get("engine")), float(d["tokens_per_chunk"])
        if engine not in out or x > out[engine][0]:
            out[engine] = (x, scenario)
    return out


def run_bursty(data: Mapping[str, Any]) -> dict[str, tuple[float, str]]:
    """:func:`bursty_engines` over every scenario result of a results file's ``data``."""
    return bursty_engines((str(sc.get("name", "")), r) for sc in data.get("scenarios") or []
                          for r in sc.get("results") or [])


def annotate(data: Mapping[str, Any]) -> dict[str, tuple[float, str]]:
    """Give every result of ``data`` (a results file's dict, in memory only) of an engine bursty anywhere in the
    run a ``delivery_in_run`` entry ``{"tokens_per_chunk": x, "scenario": where}``, so that a reader holding one
    result knows (:func:`not_comparable`); idempotent. Returns :func:`run_bursty`."""
    found = run_bursty(data)
    for sc in data.get("scenarios") or []:
        for r in sc.get("results") or []:
            if isinstance(r, dict) and str(r.get("engine")) in found:
                x, where = found[str(r.get("engine"))]
                r["delivery_in_run"] = {"tokens_per_chunk": x, "scenario": where}
            elif isinstance(r, dict):
                r.pop("delivery_in_run", None)  # from an earlier reading of other results (a merge)
    return found


def not_comparable(metric: str, result: Mapping[str, Any] | None) -> str:
    """"not comparable: tokens delivered in bursts (x per chunk)" when ``metric`` is a gap figure and
    ``result``'s engine delivered in bursts (in this result, or elsewhere in the run once :func:`annotate`d);
    "" otherwise."""
    if result is None or not is_gap_metric(metric):
        return ""
    d = of_result(result)
    if d is not None and bursty(float(d["tokens_per_chunk"])):
        return f"not comparable: tokens delivered in bursts ({float(d['tokens_per_chunk']):.1f} per chunk)"
    run = result.get("delivery_in_run")
    if isinstance(run, Mapping) and isinstance(run.get("tokens_per_chunk"), int | float):
        where = f" in {str(run.get('scenario')).replace('_', ' ')}" if run.get("scenario") else ""
        x = f"{float(run['tokens_per_chunk']):.1f}{where}"
        return ("not comparable: tokens delivered in bursts ("
                + (f"{float(d['tokens_per_chunk']):.1f} per chunk here, {x})" if d is not None else f"{x} per chunk)"))
    return ""


#: how a table cell marks a gap figure that is not comparable: a footnote mark, so that a wide table still fits
#: (the note under the table says why, in full: :func:`table_note`)
CELL_MARK = "†"


def table_note(results: Iterable[Mapping[str, Any]]) -> str:
    """The note under a table whose cells carry :data:`CELL_MARK`: each bursty engine and its tokens per chunk,
    over the results shown ("" when no engine among them delivered in bursts)."""
    seen: dict[str, list[float]] = {}
    for r in results:
        if not_comparable("tbt_p99", r):
            d = of_result(r)
            seen.setdefault(str(r.get("engine")), []).extend([float(d["tokens_per_chunk"])] if d else [])
    parts = []
    for engine, xs in seen.items():
        x = "" if not xs else f"{min(xs):.1f} per chunk" if min(xs) == max(xs) else \
            f"{min(xs):.1f} to {max(xs):.1f} per chunk"
        parts.append(f"{engine}, tokens delivered in bursts" + (f" ({x})" if x else " elsewhere in the run"))
    return (f"{CELL_MARK} not comparable: gaps between tokens of " + "; ".join(parts)
            + ", which say when the server wrote, not when its engine computed") if parts else ""


def not_comparable_among(metric: str, results: Iterable[Mapping[str, Any]]) -> str:
    """The first :func:`not_comparable` reason among ``results``, prefixed with its engine ("" when none): a
    gap metric is never ranked where any engine compared delivered in bursts."""
    for r in results:
        why = not_comparable(metric, r)
        if why:
            return f"{r.get('engine')}: {why}"
    return ""


def chart_note(results: Iterable[Mapping[str, Any]]) -> str:
    """A gap chart's note naming the engines among ``results`` whose gaps are not comparable ("" when none)."""
    named = {}
    for r in results:
        why = not_comparable("tbt_max", r)
        if why:
            named.setdefault(str(r.get("engine")), why.partition("(")[2].rstrip(")"))
    if not named:
        return ""
    return ("not comparable: tokens delivered in bursts by " + ", ".join(f"{e} ({x})" for e, x in named.items())
            + ", whose gaps say when the server wrote, not when its engine computed")
