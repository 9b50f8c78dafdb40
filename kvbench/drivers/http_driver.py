"""The timed HTTP driver: a workload served over streamed ``/v1/completions``, measured from the client.

Every request is released at its arrival time (open loop) or when one of ``concurrency`` slots frees
(closed loop) on its own asyncio task and connection, and streamed. The time each chunk of tokens
arrives is read from the recorder's clock as soon as its SSE line is complete, so TTFT and every
inter-token gap are what a client saw (network and server queueing included). A request whose
``abort_at`` passes is aborted by closing its stream, as a user closing a tab would: once the server has
answered with the response's head, and, for a :class:`ClientRequest` with ``abort_after_tokens``, once
that many tokens have arrived (an abort placed mid-stream, where the engine cannot have finished yet).
The trace records each close with the tokens the client had by then (``RequestTrace.abort_sent``,
``tokens_at_abort``): what the client did, which a check holds the engine's own counters against. A
:class:`ClientRequest` with ``stream=False`` goes as one non-streamed completion. Where the recorder keeps
outputs, each request's token ids and text are recorded as the client read them; a stream that ended in
an error event is recorded with the server's words (``RequestTrace.error_event``).

Meanwhile a poller samples ``/metrics`` (default 10 Hz) into :class:`~kvbench.core.trace.StepRecord`
samples of queue lengths and KV usage, and goes on after the last response until a sample shows the
server holding nothing (at most :data:`DRAIN_SECONDS`), so the trace's last sample says what the server
still held once the run was over. Each scrape is work for the server, and on a front end that runs one loop (vLLM's
API server) it is work the streams wait for: every open stream sees a gap as long as the scrape, once
per period, which can become a surge's p99 inter-token gap
(docs/journal/simulator.md#2026-12-03-late-vllms-scheduler-placement-and-kvbenchs-own-sampler). :class:`DriverStats`
records how long the scrapes took, and the trace when each began and ended, on the clock of the token times
(:mod:`kvbench.bench.sampler_cost` measures from them what the scrapes cost the streams); the adapters'
``metrics_interval`` option sets the period or turns the sampler off.

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

from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_client import Completion, CompletionClient
from kvbench.drivers.http_watchdog import HttpWatchdog, watched
from kvbench.drivers.release import Release, ReleaseSchedule, record_arrival
from kvbench.drivers.server_metrics import MetricsSnapshot, in_flight, sampled_step

#: seconds the /metrics poller goes on after the last response, waiting for a sample of a server that holds
#: nothing (a healthy server shows it at the first scrape; the adapters' own settle waits longer)
DRAIN_SECONDS = 10.0
#: seconds between the drain's scrapes
DRAIN_INTERVAL = 0.05


@dataclass(frozen=True)
class ClientRequest(WorkloadRequest):
    """A workload request with what an HTTP client does with it beyond the common fields; every other
    driver serves it as the :class:`~kvbench.core.requests.WorkloadRequest` it is.

    ``stream``: False sends it as one non-streamed completion (its tokens all arrive with the response; an
    abort closes its connection at ``abort_at``). ``abort_after_tokens``: its abort waits, once ``abort_at``
    has passed, until the client has received this many tokens (0: only for the response's head), so a
    check can place an abort mid-stream, where the engine cannot have finished the request yet.
    ``abort_before_head``: its abort closes the connection at ``abort_at`` without waiting for the response's
    head, for an abort placed while the server holds the request waiting: a server that sends its head only
    with the first token (llama-server) would otherwise never see a close before that token. The check must
    then prove otherwise (from ``/metrics``) that the server held the request when it was closed."""

    stream: bool = True
    abort_after_tokens: int = 0
    abort_before_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.abort_after_tokens, bool) or not isinstance(self.abort_after_tokens, int) \
                or self.abort_after_tokens < 0:
            raise ValueError(f"ClientRequest {self.request_id!r}: abort_after_tokens must be an int >= 0, "
                             f"got {self.abort_after_tokens!r}")

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


class _Poller:
    """Samples ``/metrics`` every ``interval`` seconds into the trace until the run is over and then, every
    :data:`DRAIN_INTERVAL`, until a sample shows the server holding nothing (or :data:`DRAIN_SECONDS` pass)."""

    def __init__(self, http: httpx.AsyncClient, recorder: TraceRecorder, interval: float, stats: DriverStats,
                 watchdog: HttpWatchdog):
        self.http, self.recorder, self.interval, self.stats, self.watchdog = http, recorder, interval, stats, watchdog
        self.last = recorder.now()
        self.first: MetricsSnapshot | None = None  # the server's counters are cumulative since it started
        self.run_over = asyncio.Event()

    async def sample(self) -> int | None:
        """One scrape recorded as a sample; the requests the server holds (None: unknown). Every scrape's
        (asked, answered) times go into the trace (:meth:`TraceRecorder.scraped`), a failed one's too (the
        server may have worked on it all the same), so that its cost to the streams can be measured."""
        asked = self.recorder.now()
        try:
            try:
                response = await self.http.get("/metrics", timeout=max(1.0, 5 * self.interval))
            finally:
                t = self.recorder.now()
                self.recorder.scraped(asked, t)
            self.stats.scrape_seconds.append(t - asked)
            snap = MetricsSnapshot.parse(response.text) if response.status_code == 200 else None
            self.first = self.first or snap
            record = sampled_step(snap, t, t - self.last, self.first) if snap is not None else None
            if snap is not None:
                self.watchdog.saw_metrics(snap)
        except (httpx.HTTPError, ValueError):
            self.stats.sample_errors += 1
            return None
        if record is None:
            return None
        self.recorder.step(record)
        self.stats.samples += 1
        self.last = record.t
        return in_flight(snap)

    async def run(self) -> None:
        while not self.run_over.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.run_over.wait(), timeout=self.interval)
        deadline = self.recorder.now() + DRAIN_SECONDS
        while await self.sample() not in (0, None) and self.recorder.now() < deadline:
            await asyncio.sleep(DRAIN_INTERVAL)


async def _abort(task: asyncio.Future[Completion], abortable: asyncio.Event) -> Completion | None:
    """Abort a request whose ``abort_at`` passed by closing its connection; None once aborted, or its
    completion if it turned out to have finished.

    Two races would make the client's "abort" disagree with the server's own count, so both are closed:
    a request the server has not taken yet cannot be aborted there (``abortable`` is set no earlier than
    the response's head: the user closes the tab once the page has begun to load; later, for an abort
    placed after some tokens), and a request whose last token is already on the wire finished (what has
    arrived is read before deciding)."""
    waiter = asyncio.ensure_future(abortable.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await asyncio.sleep(0)  # let the protocol read what has already arrived
    if task.done():
        return task.result()
    task.cancel()  # closes the connection: the server must abort the request and free its blocks
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await task
    return None


async def _serve_one(client: CompletionClient, http: httpx.AsyncClient | None, release: Release,
                     recorder: TraceRecorder, stats: DriverStats, watchdog: HttpWatchdog) -> None:
    req, rid = release.request, release.request_id
    stats.max_release_lag = max(stats.max_release_lag, recorder.now() - release.at)
    record_arrival(recorder, req, release.at)
    watchdog.sent(rid)
    try:
        await _Exchange(client, http, release, recorder, stats, watchdog).run()
    finally:
        watchdog.ended(rid)


class _Exchange:
    """One request from release to its end: sent (streamed, or not), aborted where its time comes, recorded."""

    def __init__(self, client: CompletionClient, http: httpx.AsyncClient | None, release: Release,
                 recorder: TraceRecorder, stats: DriverStats, watchdog: HttpWatchdog):
        self.client, self.http, self.release = client, http, release
        self.recorder, self.stats, self.watchdog = recorder, stats, watchdog
        self.rid = release.request_id
        self.received = 0  # tokens the client has
        self.after_tokens = getattr(release.request, "abort_after_tokens", 0)
        self.abortable = asyncio.Event()  # the head has come, and the tokens the abort waits for
        self.head = _CallingEvent(self.on_head)  # set by the stream when the response's head arrives
        if getattr(release.request, "abort_before_head", False):
            self.abortable.set()  # the check proves from /metrics that the server held it when it closed

    def on_tokens(self, t: float, ids: list[int]) -> None:
        n = len(ids)
        self.recorder.tokens(self.rid, t, n)
        self.stats.tokens += n
        self.watchdog.tokens(self.rid, n)
        self.received += n
        if self.received >= self.after_tokens and not self.abortable.is_set() and self.head.is_set():
            self.abortable.set()

    def on_head(self) -> None:
        if self.received >= self.after_tokens:
            self.abortable.set()

    async def _send(self) -> Completion:
        req = self.release.request
        if getattr(req, "stream", True):
            return await self.client.stream(_body(self.client, req, True), self.on_tokens, clock=self.recorder.now,
                                            started=self.head)
        assert self.http is not None, "a non-streamed request needs the driver's httpx session"
        self.head.set()  # no head to wait for: the abort closes the connection at its time
        done = await self.client.complete(self.http, _body(self.client, req, False))
        if done.token_ids:
            self.on_tokens(self.recorder.now(), done.token_ids)
        return done

    async def run(self) -> None:
        recorder, rid = self.recorder, self.rid
        task = asyncio.ensure_future(self._send())
        deadline = self.release.abort_due
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
                aborted = await _abort(task, self.abortable)
                if aborted is None:
                    t = recorder.now()
                    recorder.abort_sent(rid, t, self.received)
                    recorder.finished(rid, t, "abort")
                    return
                done = aborted
                break
        recorder.output(rid, None if done.ids_from_text else done.token_ids, done.text)
        if done.error_event:
            recorder.error_event(rid, done.error or "")
        if done.error:
            recorder.error(rid, done.error)
        recorder.finished(rid, recorder.now(), done.finish_reason or "error")
        self.stats.requests += 1


class _CallingEvent(asyncio.Event):
    """An event that calls ``on_set()`` when it is set (the stream sets it when the response's head comes)."""

    def __init__(self, on_set: Callable[[], None]):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        already = self.is_set()
        super().set()
        if not already:
            self._on_set()


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
    unstreamed = any(not getattr(r, "stream", True) for r in requests)
    # the httpx session serves the /metrics poller and non-streamed requests (streams go over bare
    # connections): not made without them, as building it (an SSL context, anyio) costs the driver CPU
    async with client.session() if poll_interval or unstreamed else contextlib.nullcontext() as http:
        recorder.restart_clock()
        sampler = _Poller(http, recorder, poll_interval, stats, watchdog) if poll_interval else None
        poller = asyncio.ensure_future(sampler.run()) if sampler is not None else None

        async def one(release: Release) -> None:
            await _serve_one(client, http, release, recorder, stats, watchdog)
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
        except BaseException:
            if poller is not None:  # a run that failed (its watchdog fired) is not drained
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            raise
        if sampler is not None and poller is not None:
            sampler.run_over.set()
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
    which lowers the driver's CPU per streamed token (docs/journal/measurements.md#serving-over-http)."""
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
