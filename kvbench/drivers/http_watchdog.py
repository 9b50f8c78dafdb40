"""Liveness over HTTP: a watchdog over the requests kvbench has open on a server.

In process the engine's steps show progress (:mod:`kvbench.core.liveness`); over HTTP the client sees
only what the server sends and publishes. A server that drops a request (forgets it, or finishes it,
without ever ending its response) would leave the client waiting for its request timeout (600 s by
default) while the suite sits idle. :class:`HttpWatchdog` watches what a server does expose and raises
:class:`~kvbench.core.liveness.LivenessError` naming every request still open, with what the client
got of each:

* **a server that holds nothing**: ``/metrics`` says nothing is running, waiting or swapped
  (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) on every scrape for ``idle_grace``
  seconds (and at least :data:`IDLE_SCRAPES` scrapes) while requests are still open, with no token
  or response arriving meanwhile: the server has let go of them;
* **a stall**: for ``Liveness.stall_seconds`` no token arrived on any stream, no response ended and the
  server's ``vllm:generation_tokens_total`` did not move (the one progress a non-streamed request
  shows before its answer);
* **the deadline** of the whole run (``Liveness.deadline``).

The client's own requests are what is named: the server's ids are not visible over HTTP.
:func:`watched` runs a batch of request coroutines under a watchdog and, when it fires, cancels them
(closing their connections, which a server takes as aborts) before raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvbench.core.liveness import DEFAULT_LIVENESS, Liveness, LivenessError
from kvbench.drivers.server_metrics import MetricsSnapshot, in_flight

#: seconds a server may report holding nothing while kvbench still has requests open on it, before
#: they count as dropped: long enough for a finished request's
#: last bytes and a gauge published a step late, and well inside the minute a stuck suite may cost
IDLE_GRACE = 10.0
#: consecutive scrapes that must all show an empty server before the idle rule fires
IDLE_SCRAPES = 3


#: the most the idle grace is stretched (a container may report its host's load average, not its own)
MAX_LOAD_STRETCH = 6.0


def machine_load() -> float:
    """How many times over the machine's cores are asked for: the one-minute load average per core, at least 1
    and at most :data:`MAX_LOAD_STRETCH`.
    A server's gauges move only when its engine steps, and on an overloaded machine (a 2-core one with a dozen
    runnable processes: 6.0) an engine gets its turns that many times more slowly; the idle rule's grace is
    stretched by it, so that a starved server is not taken for one that dropped its requests (seen on vLLM at
    load 12: nothing published for 10.6 s, then it went on)."""
    try:
        return min(MAX_LOAD_STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    except OSError:  # no load average on this platform
        return 1.0
T = TypeVar("T")


@dataclass
class _Open:
    sent: float
    tokens: int = 0
    tokens_seen: int = 0  # ``tokens`` at the last check
    last_token: float | None = None  # the check that first saw the latest tokens


class HttpWatchdog:
    """Feed it what the client sees (:meth:`sent`, :meth:`tokens`, :meth:`ended`) and what ``/metrics``
    says (:meth:`saw_metrics`); :meth:`check` raises :class:`LivenessError` when a limit is passed."""

    def __init__(self, liveness: Liveness | None = None, idle_grace: float = IDLE_GRACE,
                 clock: Callable[[], float] = time.monotonic, load: Callable[[], float] = machine_load):
        self.liveness = liveness or DEFAULT_LIVENESS
        self.idle_grace = idle_grace  # a shorter stall limit fires first anyway
        self._load = load  # stretches idle_grace on an overloaded machine (machine_load)
        self._clock = clock
        self._started = self._progress = clock()
        self.open: dict[str, _Open] = {}
        self._idle_since: float | None = None
        self._idle_scrapes = 0
        self._generated: float | None = None
        self._received = self._received_seen = 0  # tokens received on every stream, and at the last check

    def _moved(self, now: float) -> None:
        self._progress = now
        self._idle_since, self._idle_scrapes = None, 0

    def sent(self, request_id: str) -> None:
        now = self._clock()
        if not self.open:  # the stall clock starts with the first open request, not with the run
            self._progress = now
        self.open[request_id] = _Open(now)

    def tokens(self, request_id: str, n: int) -> None:
        """``n`` tokens arrived for ``request_id``: counted only (this runs per streamed token); the time
        is taken at the next :meth:`check`, at most a tick later."""
        seen = self.open.get(request_id)
        if seen is not None:
            seen.tokens += n
        self._received += n

    def _take_tokens(self, now: float) -> None:
        if self._received == self._received_seen:
            return
        self._received_seen = self._received
        self._moved(now)
        for seen in self.open.values():
            if seen.tokens != seen.tokens_seen:
                seen.tokens_seen, seen.last_token = seen.tokens, now

    def ended(self, request_id: str) -> None:
        if self.open.pop(request_id, None) is not None:
            self._moved(self._clock())

    def saw_metrics(self, snap: MetricsSnapshot) -> None:
        now = self._clock()
        self._take_tokens(now)
        generated = snap.value("vllm:generation_tokens_total")
        if generated is not None and generated != self._generated:
            if self._generated is not None:
                self._moved(now)
            self._generated = generated
        if in_flight(snap) == 0 and self.open:
            if self._idle_since is None:
                self._idle_since = now
            self._idle_scrapes += 1
        else:
            self._idle_since, self._idle_scrapes = None, 0

    def stuck(self) -> dict[str, str]:
        """Each open request and what the client has seen of it."""
        now = self._clock()
        out = {}
        for rid, seen in self.open.items():
            if seen.last_token is None:
                out[rid] = f"sent {now - seen.sent:.1f} s ago, nothing received"
            else:
                out[rid] = (f"sent {now - seen.sent:.1f} s ago, {seen.tokens} token(s) received, the last "
                            f"{now - seen.last_token:.1f} s ago, no end of response")
        return out

    def check(self) -> None:
        now = self._clock()
        self._take_tokens(now)
        lv = self.liveness
        if lv.deadline is not None and now - self._started > lv.deadline:
            raise LivenessError(f"the run passed its deadline of {lv.deadline:g} s", self.stuck())
        if not self.open:
            return
        idle = (self._idle_since is not None and self._idle_scrapes >= IDLE_SCRAPES
                and now - self._idle_since >= self.idle_grace)
        if idle and now - self._idle_since >= self.idle_grace * (load := self._load()):
            stretched = (f", the grace of {self.idle_grace:g} s stretched {load:.1f}x by the machine's load"
                         if load > 1 else "")
            raise LivenessError(f"the server's /metrics has shown nothing running or waiting for "
                                f"{now - self._idle_since:.1f} s ({self._idle_scrapes} scrapes{stretched}) while "
                                f"{len(self.open)} request(s) are still open on it: it dropped them without "
                                "ending their responses", self.stuck())
        if lv.stall_seconds is not None and now - self._progress > lv.stall_seconds:
            raise LivenessError(f"no token on any stream, no response ended and no generated token counted on "
                                f"/metrics for {now - self._progress:.1f} s (limit {lv.stall_seconds:g} s)",
                                self.stuck())


async def watched(watchdog: HttpWatchdog, work: Awaitable[T],
                  scrape: Callable[[], Awaitable[MetricsSnapshot | None]] | None = None,
                  tick: float | None = None) -> T:
    """``work``'s result, checking ``watchdog`` every ``tick`` seconds meanwhile (scraping ``/metrics``
    with ``scrape`` first, where given: pass None when another task feeds the watchdog its scrapes).
    When the watchdog fires, ``work`` is cancelled (its connections closed) and the LivenessError raised."""
    tick = tick if tick is not None else max(0.05, min(1.0, watchdog.idle_grace / (IDLE_SCRAPES + 2)))
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=tick)
            if done:
                return task.result()
            if scrape is not None:
                with contextlib.suppress(Exception):  # a failed scrape says nothing either way
                    snap = await asyncio.wait_for(scrape(), timeout=max(1.0, 5 * tick))
                    if snap is not None:
                        watchdog.saw_metrics(snap)
            watchdog.check()
    except BaseException:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise
