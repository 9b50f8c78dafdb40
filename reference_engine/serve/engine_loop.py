"""The engine loop: one thread owns the engine; asyncio handlers talk to it through commands and queues.

::

    asyncio side (any number of connections)             engine thread (exactly one)
    ----------------------------------------             ---------------------------
    await loop.add(rid, ids, params) --- command ---->   drain commands: add_request / abort_request
         (RequestRejected raised back here)                  |
    queue = loop.outputs(rid)                             step() while anything is unfinished
    await queue.get()  <--- one call_soon_threadsafe <--- outputs of the step, grouped per request
    loop.abort(rid)    --- command ---->                  stats snapshot for /metrics
                                                          (idle: sleep on an Event until a command)

Contracts:

* Every engine call (``add_request``, ``abort_request``, ``step``, ``stats``) happens on the loop's
  thread: the engine is not thread safe. Requests that arrive while a step runs are added before the
  next step, so concurrent connections are batched together.
* Each accepted request's queue receives ``RequestOutput`` objects (cumulative ``token_ids``) until one
  with ``finished=True``, or one :class:`EngineFailure` if a step raised: then every request in flight
  is failed, the engine is asked to abort them, and the loop keeps serving new requests. A failed
  request's queue first gets the tokens the engine holds for it beyond those delivered (a step can fail
  after producing them: :func:`held_outputs`), in the same hop as its failure, so its client has every
  token the engine produced before the error. If even the aborts fail, the engine is declared broken and
  later ``add`` calls raise ``EngineFailure``.
* ``stop()`` ends the thread cleanly: requests still in flight get an ``EngineFailure`` and are
  aborted, and the thread is joined.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from reference_engine.outputs import RequestOutput
from reference_engine.sampling_params import SamplingParams
from reference_engine.serve.prometheus import EngineStats, ServerMetrics, read_engine_stats

log = logging.getLogger("reference_engine.serve")

IDLE_WAIT_S = 0.5  # the idle thread re-checks this often even without a wake-up (stop is also a wake-up)


class EngineFailure(RuntimeError):
    """The engine could not serve a request: a step raised, or the server is stopping."""


@dataclass
class InFlight:
    """A request the server is waiting on: where its outputs go, and what its metrics need."""

    outputs: asyncio.Queue
    arrival: float
    prompt_len: int
    num_tokens: int = 0
    last_token_time: float = 0.0


class EngineLoop:
    """Owns ``engine`` on one background thread; see the module docstring for the contract."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._broken: BaseException | None = None
        self._in_flight: dict[str, InFlight] = {}  # touched only on the engine thread
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ asyncio side
    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``aio_loop``."""
        self._aio = aio_loop
        self._thread = threading.Thread(target=self._run, name="reference_engine-loop", daemon=True)
        self._thread.start()

    async def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                  priority: int = 0, cache_salt: str | None = None) -> asyncio.Queue:
        """Queue a request on the engine; return the queue its outputs arrive on (``cache_salt``: see
        ``LLMEngine.add_request``).

        Raises the engine's ``RequestRejected`` (the request was never added) or :class:`EngineFailure`.
        If the caller is cancelled while waiting, it must still call :meth:`abort`.
        """
        if self._broken is not None or self._stopping:
            raise EngineFailure(f"the engine is not serving: {self._broken or 'server stopping'}")
        outputs: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic()

        def command() -> None:
            if self._broken is not None:
                done.set_exception(EngineFailure(f"the engine is not serving: {self._broken}"))
                return
            try:
                self.engine.add_request(request_id, list(prompt_token_ids), params, priority=priority,
                                        cache_salt=cache_salt)
            except BaseException as e:
                done.set_exception(e)
                return
            self._in_flight[request_id] = InFlight(outputs, arrival, len(prompt_token_ids))
            done.set_result(None)

        self._post(command)
        await asyncio.wrap_future(done)
        return outputs

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` if it is still in flight (thread safe, does not wait). Its blocks are
        freed by the engine; its queue gets the aborted output."""
        self._post(lambda: self.engine.abort_request(request_id))

    @property
    def broken(self) -> str | None:
        """Why the engine no longer serves (even aborting its requests failed), or None while it does."""
        return None if self._broken is None else f"{type(self._broken).__name__}: {self._broken}"

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (or command) on the engine thread."""
        return self._stats

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (failing and aborting what is in flight) and join it."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.1f s (a step is still running)", timeout)

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        self._stats = read_engine_stats(self.engine)
        while not self._stopping:
            self._wake.clear()  # before draining: a command posted after the drain sets it again
            self._drain_commands()
            if self._broken is None and self.engine.has_unfinished_requests():
                self._step()
            else:
                self._stats = read_engine_stats(self.engine)
                self._wake.wait(IDLE_WAIT_S)
        self._drain_commands()
        self._fail_all(EngineFailure("the server is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # an abort of an unknown id, say: never let it kill the loop
                log.exception("engine command failed")

    def _step(self) -> None:
        try:
            outputs = self.engine.step().outputs
        except Exception as e:
            log.exception("engine step failed; failing the %d requests in flight", len(self._in_flight))
            sent = {rid: flight.num_tokens for rid, flight in self._in_flight.items()}
            self._fail_all(EngineFailure(f"engine step failed: {type(e).__name__}: {e}"),
                           self._outputs_batch(held_outputs(self.engine, sent)))
            return
        self._send(self._outputs_batch(outputs))
        self._stats = read_engine_stats(self.engine)

    def _outputs_batch(self, outputs: list[RequestOutput]) -> list[tuple[asyncio.Queue, object]]:
        now = time.monotonic()
        batch: list[tuple[asyncio.Queue, object]] = []
        for out in outputs:
            flight = self._in_flight.get(out.request_id)
            if flight is None:
                continue  # a request added by someone else (never, in the server)
            observe_output(self.metrics, flight, out, now)
            batch.append((flight.outputs, out))
            if out.finished:
                del self._in_flight[out.request_id]
        return batch

    def _fail_all(self, error: EngineFailure, first: list[tuple[asyncio.Queue, object]] | None = None) -> None:
        """Hand ``error`` to every request in flight and abort them, so none hangs and no block leaks;
        ``first`` (outputs the requests are owed) goes in the same hop, ahead of the failures."""
        failed, self._in_flight = self._in_flight, {}
        self._send([*(first or []), *((flight.outputs, error) for flight in failed.values())])
        if (error := abort_and_drain(self.engine, failed, lambda: self._stopping)) is not None:
            self._broken = error
        try:
            self._stats = read_engine_stats(self.engine)
        except Exception:
            log.exception("could not read engine stats")

    def _send(self, batch: list[tuple[asyncio.Queue, object]]) -> None:
        """One hop to the asyncio thread per step, however many requests it touched."""
        if not batch or self._aio is None:
            return

        def put_all() -> None:
            for q, item in batch:
                q.put_nowait(item)

        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
            self._aio.call_soon_threadsafe(put_all)


def observe_output(metrics: ServerMetrics | None, flight: InFlight, out: RequestOutput, now: float) -> None:
    """Count ``out`` (cumulative, stamped ``now`` on the monotonic clock) into ``metrics``: TTFT for a
    request's first tokens, an inter-token gap for later ones, its finish reason once finished."""
    new_tokens = len(out.token_ids) - flight.num_tokens
    m = metrics
    if m is not None and new_tokens > 0:
        if flight.num_tokens == 0:
            m.ttft.observe(now - flight.arrival)
            m.prompt_tokens.inc(flight.prompt_len)
        else:
            m.itl.observe(now - flight.last_token_time)
    if m is not None and out.finished:
        m.observe_finished(out.finish_reason or "abort")
    if new_tokens > 0:
        flight.num_tokens, flight.last_token_time = len(out.token_ids), now


def held_outputs(engine, sent: dict[str, int]) -> list[RequestOutput]:
    """For each request of ``sent`` (request id -> tokens already delivered) that the engine still holds
    with more tokens than that, its output as the engine holds it now (not finished: the caller fails it).
    After a step raised, these are the tokens the step gave its requests before it failed. A request the
    failed step finished is no longer held, and its last tokens cannot be had."""
    held = getattr(engine.scheduler, "requests", {})
    out = []
    for request_id, delivered in sent.items():
        req = held.get(request_id)
        if req is not None and len(req.output_token_ids) > delivered:
            out.append(replace(RequestOutput.of(req), finished=False, finish_reason=None))
    return out


def abort_and_drain(engine, request_ids, stopping: Callable[[], bool] = lambda: False) -> Exception | None:
    """Abort ``request_ids`` (requests already failed to their callers) and step until the engine holds
    nothing, so no block leaks; stop early once ``stopping()``. Returns the exception if even that
    failed (the engine can no longer be served), else None. Shared by both engine loops."""
    try:
        for request_id in request_ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests() and not stopping():
            engine.step()  # delivers the aborted outputs, clearing the engine's own queues
    except Exception as e:
        log.exception("could not abort the failed requests: the engine is no longer served")
        return e
    return None
