"""The timed HTTP driver: a workload served over streamed ``/v1/completions``, measured from the client.

Every request is released at its arrival time (open loop) or when one of ``concurrency`` slots frees
(closed loop) on its own asyncio task and connection, and streamed. The time each chunk of tokens
arrives is read from the recorder's clock as soon as its SSE line is complete, so TTFT and every
inter-token gap are what a client saw (network and server queueing included). A request whose
``abort_at`` passes is aborted by closing its stream, as a user closing a tab would. Meanwhile a poller
samples ``/metrics`` (default 10 Hz) into :class:`~kvbench.core.trace.StepRecord` samples of queue
lengths and KV usage. Each scrape is work for the server, and on a front end that runs one loop (vLLM's
API server) it is work the streams wait for: every open stream sees a gap as long as the scrape, once
per period, which can become a surge's p99 inter-token gap
(docs/journal/simulator.md#2026-12-03-late-vllms-scheduler-placement-and-kvbenchs-own-sampler). :class:`DriverStats`
records how long the scrapes took; the adapters' ``metrics_interval`` option sets the period or turns the
sampler off.

What a client cannot see (admission, per-request preemptions, per-step token counts) is named in the
trace's ``not_exposed``. :class:`DriverStats` says how far the driver itself lagged behind the
workload's clock, so a late driver is visible instead of being blamed on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_client import Completion, CompletionClient
from kvbench.drivers.http_watchdog import HttpWatchdog, watched
from kvbench.drivers.release import Release, ReleaseSchedule, record_arrival
from kvbench.drivers.server_metrics import MetricsSnapshot, sampled_step

#: what a client-side trace never holds, and why (shown by the report instead of zeros)
#: (keys are the names :mod:`kvbench.bench.metrics` reads, so a per-request figure nobody could see is
#: "not exposed" rather than rebuilt as 0 from empty per-request records; run totals still come from
#: the counters where /metrics publishes them)
CLIENT_SIDE_BLIND_SPOTS = {
    "admission": "over HTTP the client sees the first token, not when the server admitted the request",
    "events": "over HTTP there are no engine events: preemptions are counted from /metrics for the whole run, "
              "not per request",
    "recompute": "over HTTP recomputed tokens are not seen per request; the run's total comes from /metrics where "
                 "the server publishes it",
    "prefix_cache": "over HTTP prefix-cache hits are not seen per request; the run's totals come from /metrics "
                    "where the server publishes them",
    "engine_steps": "queue and KV-usage records are /metrics samples taken by a poller, not engine steps: "
                    "they carry no token counts, preemptions or step durations",
}


@dataclass
class DriverStats:
    """How the driver kept up. ``max_release_lag`` is the latest a request went out after its
    arrival time (seconds); ``samples`` counts /metrics samples taken, ``scrape_seconds`` holds how long
    each took to answer (the server's time on it, as the client saw it)."""

    requests: int = 0
    tokens: int = 0
    max_release_lag: float = 0.0
    samples: int = 0
    sample_errors: int = 0
    scrape_seconds: list[float] = field(default_factory=list)

    @property
    def scrape_median_s(self) -> float | None:
        """The scrapes' median answer time (seconds); None without one."""
        return statistics.median(self.scrape_seconds) if self.scrape_seconds else None

    def scrapes(self) -> str:
        """``"N /metrics samples"``, with the median and longest answer time where any was taken."""
        text = f"{self.samples} /metrics samples"
        if (median := self.scrape_median_s) is not None:
            text += f" (answered in {median * 1e3:.1f} ms median, {max(self.scrape_seconds) * 1e3:.1f} ms at most)"
        return text


def _body(client: CompletionClient, req: Any, stream: bool) -> dict[str, Any]:
    return client.body(req.prompt_token_ids, req.max_tokens, stream=stream,
                       temperature=getattr(req, "temperature", 0.0), seed=getattr(req, "seed", None),
                       ignore_eos=getattr(req, "ignore_eos", True), priority=getattr(req, "priority", 0))


async def _poll_metrics(http: httpx.AsyncClient, recorder: TraceRecorder, interval: float, stats: DriverStats,
                        stop: asyncio.Event, watchdog: HttpWatchdog) -> None:
    last = recorder.now()
    first: MetricsSnapshot | None = None  # the server's counters are cumulative since it started
    while not stop.is_set():
        try:
            asked = recorder.now()
            response = await http.get("/metrics", timeout=max(1.0, 5 * interval))
            t = recorder.now()
            stats.scrape_seconds.append(t - asked)
            snap = MetricsSnapshot.parse(response.text) if response.status_code == 200 else None
            first = first or snap
            record = sampled_step(snap, t, t - last, first) if snap is not None else None
            if snap is not None:
                watchdog.saw_metrics(snap)
        except (httpx.HTTPError, ValueError):
            stats.sample_errors += 1
            record = None
        if record is not None:
            recorder.step(record)
            stats.samples += 1
            last = record.t
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)


async def _abort(task: asyncio.Future[Completion], started: asyncio.Event, req: Any) -> Completion | None:
    """Abort a request whose ``abort_at`` passed by closing its connection; None once aborted, or its
    completion if it turned out to have finished.

    Two races would make the client's "abort" disagree with the server's own count, so both are closed:
    a request the server has not taken yet cannot be aborted there (the close waits for the response's
    head: the user closes the tab once the page has begun to load), and a request whose last token is
    already on the wire finished (what has arrived is read before deciding)."""
    waiter = asyncio.ensure_future(started.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await asyncio.sleep(0)  # let the protocol read what has already arrived
    if task.done():
        return task.result()
    task.cancel()  # closes the connection: the server must abort the request and free its blocks
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await task
    return None


async def _serve_one(client: CompletionClient, release: Release, recorder: TraceRecorder, stats: DriverStats,
                     watchdog: HttpWatchdog) -> None:
    req, rid = release.request, release.request_id
    stats.max_release_lag = max(stats.max_release_lag, recorder.now() - release.at)
    record_arrival(recorder, req, release.at)

    def on_tokens(t: float, ids: list[int]) -> None:
        recorder.tokens(rid, t, len(ids))
        stats.tokens += len(ids)
        watchdog.tokens(rid, len(ids))

    watchdog.sent(rid)
    try:
        await _stream_one(client, release, recorder, stats, on_tokens)
    finally:
        watchdog.ended(rid)


async def _stream_one(client: CompletionClient, release: Release, recorder: TraceRecorder,
                      stats: DriverStats, on_tokens: Callable[[float, list[int]], None]) -> None:
    req, rid = release.request, release.request_id
    started = asyncio.Event()
    task = asyncio.ensure_future(client.stream(_body(client, req, True), on_tokens, clock=recorder.now,
                                               started=started))
    deadline = release.abort_due
    while True:
        timeout = None if deadline is None else max(0.0, deadline - recorder.now())
        try:
            done: Completion = await asyncio.wait_for(asyncio.shield(task), timeout=timeout)
            break
        except asyncio.CancelledError:  # the run is being stopped (the watchdog fired): close the stream too
            task.cancel()
            raise
        except TimeoutError:
            if deadline is not None and recorder.now() < deadline:
                continue  # the timer fired early (uvloop's round to the millisecond): not time to abort yet
            aborted = await _abort(task, started, req)
            if aborted is None:
                recorder.finished(rid, recorder.now(), "abort")
                return
            done = aborted
            break
    recorder.finished(rid, recorder.now(), done.finish_reason or "error")
    stats.requests += 1


async def serve_workload(client: CompletionClient, requests: Sequence[Any], recorder: TraceRecorder, *,
                         concurrency: int | None = None, poll_interval: float | None = 0.1,
                         progress: Callable[[int], None] | None = None,
                         watchdog: HttpWatchdog | None = None) -> DriverStats:
    """Serve ``requests`` (WorkloadRequest-like) against the server; every request ends finished in the
    trace (with its reason, "abort" for the ones aborted here, "error"/"rejected" for failures).

    ``watchdog`` (default: :class:`HttpWatchdog` at the default liveness) follows every open stream and
    the poller's scrapes; when it fires, the streams still open are closed and its
    :class:`~kvbench.core.liveness.LivenessError`, naming them, is raised."""
    stats = DriverStats()
    watchdog = watchdog or HttpWatchdog()
    schedule = ReleaseSchedule(requests, concurrency)
    stop = asyncio.Event()
    # the httpx session serves only the /metrics poller (streams go over bare connections): not made
    # without one, as building it (an SSL context, anyio) costs the driver CPU on every run
    async with client.session() if poll_interval else contextlib.nullcontext() as http:
        recorder.restart_clock()
        poller = (asyncio.ensure_future(_poll_metrics(http, recorder, poll_interval, stats, stop, watchdog))
                  if poll_interval else None)

        async def one(release: Release) -> None:
            await _serve_one(client, release, recorder, stats, watchdog)
            schedule.finished(release.request_id)
            if progress is not None:
                progress(1)

        try:
            if concurrency is None:
                async def released(release: Release) -> None:
                    # looped: a loop's timers may fire early by their rounding (uvloop's are whole
                    # milliseconds, rounded to nearest), and a request must never go out before its time
                    while (wait := release.at - recorder.now()) > 0:
                        await asyncio.sleep(wait)
                    await one(release)

                await watched(watchdog, asyncio.gather(*(released(r) for r in schedule.planned())))
            else:
                async def slot(release: Release | None) -> None:
                    # the slot a finish frees goes to the next request on this same task: no hop through
                    # the event loop between a finish and the next release
                    while release is not None:
                        await one(release)
                        due = schedule.release_due(recorder.now())
                        # one finish frees one slot, and every task asks for its next request right after
                        # its finish (no await between): so at most one comes back. A second would be a
                        # request released to no task, never sent and never finished.
                        if len(due) > 1:
                            raise RuntimeError(f"closed loop: one finish released {len(due)} requests "
                                               f"({', '.join(r.request_id for r in due)}); a slot takes one")
                        release = due[0] if due else None

                await watched(watchdog, asyncio.gather(*(slot(r) for r in schedule.release_due(recorder.now()))))
        finally:
            stop.set()
            if poller is not None:
                await poller
    return stats


def event_loop_name() -> str:
    """The event loop :func:`run_serve` drives on: ``"uvloop"`` where it is installed, else ``"asyncio"``."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_serve(client: CompletionClient, requests: Sequence[Any], recorder: TraceRecorder, **kwargs: Any) -> DriverStats:
    """:func:`serve_workload` on a fresh event loop (callers are synchronous), and the blind spots noted.

    The loop is uvloop's where installed (:func:`event_loop_name`): its connections and reads are cheaper,
    which lowers the driver's CPU per streamed token (docs/results.md#serving-over-http)."""
    for what, why in CLIENT_SIDE_BLIND_SPOTS.items():
        recorder.not_exposed(what, why)
    if event_loop_name() == "uvloop":
        import uvloop

        return uvloop.run(serve_workload(client, requests, recorder, **kwargs))
    return asyncio.run(serve_workload(client, requests, recorder, **kwargs))


def timestamp_overhead(recorder: TraceRecorder | None = None, n: int = 100_000) -> float:
    """Seconds the driver spends per token on its own bookkeeping (clock read + trace append), measured."""
    recorder = recorder or TraceRecorder("overhead", "overhead")
    recorder.arrived("x", 0.0, 1, n)
    start = time.perf_counter()
    for _ in range(n):
        recorder.tokens("x", recorder.now(), 1)
    return (time.perf_counter() - start) / n
