"""The engine in its own process, so the HTTP event loop and the engine's steps do not share one GIL.

::

    server process (front end)                               engine process (exactly one)
    --------------------------                               ----------------------------
    await proc.add(rid, ids, params) -- ("add", ...) ------>  drain commands: add_request / abort_request
    queue = the request's asyncio queue                       step() while anything is unfinished
    reader thread, one hop to the loop      <--- one batch -- per iteration: add replies, failures,
       -> RequestOutput per request, metrics observed            stats snapshot, new tokens per request
    proc.abort(rid)                   -- ("abort", rid) --->
    await proc.reconfigure(config)    -- ("reconfigure", ..) >  idle only: a new LLMEngine for config
                                      <--- its EngineInfo ---    (torch and the checkpoint are loaded)
    proc.stop()                       -- ("stop",) -------->  fails what is in flight, exits

It is a drop-in for :class:`~reference_engine.serve.engine_loop.EngineLoop` (same ``start``, ``add``,
``abort``, ``stats``, ``stop`` and the same contracts), chosen by ``python -m reference_engine.serve``
unless ``--no-engine-process``. Why: with the engine on a thread of the server, every streamed token
costs the event loop CPU under the same GIL the steps need, and the server fell well short of the
in-process engine's throughput on two cores (docs/journal/measurements.md#the-reference-servers-overhead); vLLM's V1
engine core runs in its own process for the same reason.

Contracts beyond ``EngineLoop``'s:

* The engine process is built from an ``EngineConfig`` alone (it loads the model itself); a bad config
  or model raises :class:`EngineStartError` in the constructor with the engine's own message.
* The engine's stats snapshot goes with every batch that finishes a request, answers a command or fails
  one, and otherwise at most every ``STATS_INTERVAL_S`` while tokens stream: ``/metrics`` is exact once a
  request has finished and never further behind than that.
* The pipe carries only new tokens per request and step (not the cumulative outputs); the front end
  rebuilds each ``RequestOutput`` with cumulative ``token_ids``, as ``EngineLoop`` delivers them. The
  messages are pickled, as ``multiprocessing`` does, between this process and the child it started.
* A step the engine runs as several forward passes (``EngineConfig.microbatch_tokens``) sends the tokens of
  each pass but its last as soon as they are sampled, in a batch of their own (no stats snapshot); the
  step's own batch then carries what is left (later passes' tokens, finishes). So the clients of a wave of
  prompts prefilled in one step get their first tokens pass by pass, not all when the step ends.
  ``EngineLoop`` (``--no-engine-process``) delivers a step's tokens when it ends.
* The pipe is read and written by two threads of the server, never by the event loop: the loop cannot
  block on a full pipe while the engine blocks writing outputs to it (a deadlock with blocking writes
  on both ends), and each batch of outputs costs the loop one hop, as ``EngineLoop``'s do.
* :meth:`EngineProcess.reconfigure` (the server's ``--allow-reconfigure``) replaces the engine with one
  built from another ``EngineConfig`` in the same process: only when nothing is in flight (else
  :class:`EngineBusy`, and the engine process checks again on its side, so a request added meanwhile
  wins); a config the engine refuses raises :class:`EngineStartError` and the old engine serves on. The
  new engine's counters start at zero, and the batch that says it is ready carries them.
* A step that raises fails every request in flight, each after the tokens the engine holds for it beyond
  those already sent (a step can fail after its model run produced them): the client of a failed stream
  has every token the engine produced for it before the error.
* If the engine process dies, every request in flight gets an ``EngineFailure`` and later ``add`` calls
  raise it; the server keeps answering ``/metrics`` and errors, and ``/health`` answers 503. The engine
  process ignores SIGINT (the server's own shutdown stops it) and exits when the server's end of the
  pipe closes. A SIGTERM to the whole process group ends it at once: requests still in flight end with
  an error rather than being drained by uvicorn's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reference_engine.config import ConfigError, EngineConfig
from reference_engine.outputs import RequestOutput
from reference_engine.request import RequestRejected
from reference_engine.sampling_params import SamplingParams, TokenLogprobs
from reference_engine.serve.allocator import preloading
from reference_engine.serve.engine_loop import (
    IDLE_WAIT_S,
    EngineFailure,
    InFlight,
    abort_and_drain,
    held_outputs,
    observe_output,
)
from reference_engine.serve.prometheus import EngineStats, ServerMetrics, read_engine_stats

log = logging.getLogger("reference_engine.serve")

START_TIMEOUT_S = 600.0  # loading a checkpoint from a slow disk; the child's death is noticed at once
# While tokens stream, the engine's counters and gauges go out at most this often (and with every batch
# that finishes a request, answers a command or reports a failure). Reading and pickling them is a
# visible share of a tiny model's step, so not done every step; /metrics lags by no more.
STATS_INTERVAL_S = 0.005
# While requests are in flight, the front end's reader looks at the pipe this often instead of sleeping on
# it (0: always sleeps on it). Why: a write to a pipe that a thread sleeps on wakes that thread's core, and
# on a VM whose idle cores halt (cpuidle haltpoll, guest_halt_poll_ns 0) waking one delays the engine's
# send and its next step by a visible share of a tiny model's step; a reader that looks on a timer is never
# asleep on the pipe, so the engine's write wakes no one. The price: a batch reaches the event loop up to
# this much later (half of it on average), and the reader wakes this often while requests stream.
OUTPUT_POLL_S = 0.0002


class EngineStartError(RuntimeError):
    """The engine process could not build its engine. ``kind`` is ``"config"`` (a ``ConfigError``: the
    message names the field, ``field`` holds it where known) or ``"load"`` (the model could not be
    loaded) or ``"process"``."""

    def __init__(self, kind: str, message: str, field: str | None = None):
        super().__init__(message)
        self.kind, self.field = kind, field


class EngineBusy(RuntimeError):
    """A reconfigure asked for while requests are in flight (or another reconfigure is under way)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of an engine it does not hold: for the API, limits and metrics."""

    config: EngineConfig  # resolved (max_model_len filled in from the model)
    num_gpu_blocks: int
    num_cpu_blocks: int
    vocab_size: int
    torch_threads: int = 0  # intra-op threads the engine steps on
    allocator: str = "system"  # the engine process's malloc: "tcmalloc" or "system" (serve.allocator)

    @classmethod
    def of(cls, engine) -> EngineInfo:
        import torch

        from reference_engine.serve.allocator import loaded_allocator

        return cls(engine.config, engine.block_manager.num_gpu_blocks, engine.block_manager.num_cpu_blocks,
                   engine.model.config.vocab_size, torch.get_num_threads(), loaded_allocator())


def default_engine_threads(env: dict[str, str] | None = None, cores: int | None = None) -> int:
    """The engine process's torch threads when ``--engine-threads`` is not given: ``OMP_NUM_THREADS`` where
    it is set (a launcher pinning threads wins), else every core but one, at least one.

    Why one core is left: the HTTP process streams every token and shares the machine with the engine.
    At torch's default (a thread per core) the engine's OpenMP threads spin on the core the HTTP process
    needs: on 2 cores the tiny model served several times fewer tokens per second than with one engine
    thread (docs/journal/measurements.md#reference-engine-vs-vllm-cpu). vLLM's CPU build does the same: its
    ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds the worker's threads to all cores but one it reserves."""
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    cores = cores if cores is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    return max(1, cores - 1)


def split_cpus(threads: int, cpus: Sequence[int] | None = None) -> tuple[list[int], list[int]] | None:
    """(the engine process's cores, the HTTP process's cores) for an engine of ``threads`` torch threads on
    ``cpus`` (default: the cores this process may run on), or None when there is no core to spare.

    The engine takes the first ``threads`` cores, the HTTP process the rest, as vLLM's CPU build binds its
    worker's threads to all cores but the ones it reserves for its front end (``VLLM_CPU_OMP_THREADS_BIND``
    auto). Unbound, the OS moved the HTTP process and a client on the same machine onto the engine's core
    and the engine's step waited for them (docs/journal/measurements.md#the-reference-servers-overhead)."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return None
        cpus = sorted(os.sched_getaffinity(0))
    cpus = list(cpus)
    if threads < 1 or len(cpus) <= threads:
        return None
    return cpus[:threads], cpus[threads:]


# ---------------------------------------------------------------------------------------- engine process
# One step's news for one request: (request_id, new token ids, finished, finish_reason, num_preemptions,
# num_recomputed_tokens, num_cached_tokens, new logprobs or None).
_Delta = tuple[str, list[int], bool, "str | None", int, int, int, "list[TokenLogprobs] | None"]


def _engine_main(config: EngineConfig, conn: multiprocessing.connection.Connection, threads: int | None = None,
                 cpus: Sequence[int] | None = None) -> None:
    """The engine process: build the engine, say so (or why not), then serve commands until told to stop.
    ``threads``: torch's intra-op threads here (None: torch's default); ``cpus``: the cores this process is
    bound to, before torch starts a thread (None: not bound)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from reference_engine.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except ConfigError as e:
        conn.send(("error", "config", str(e)))
        return
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        conn.send(("error", "load", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", EngineInfo.of(engine)))
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
        _EngineCore(engine, conn, rebuild=LLMEngine).run()


def _build_engine(build: Callable[[EngineConfig], Any], config: EngineConfig) -> tuple[Any, tuple | None]:
    """(engine, None), or (None, ("config" | "load", message, field or None)) when ``build`` refuses."""
    try:
        return build(config), None
    except ConfigError as e:
        return None, ("config", str(e), e.field)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return None, ("load", f"{type(e).__name__}: {e}", None)


class _EngineCore:
    """The engine process's loop: the engine-thread half of ``EngineLoop``, speaking over a pipe."""

    def __init__(self, engine, conn: multiprocessing.connection.Connection,
                 rebuild: Callable[[EngineConfig], Any] | None = None):
        """``rebuild(config)``: a new engine for a ``("reconfigure", ...)`` command (None: refused)."""
        self.engine, self.conn, self.rebuild = engine, conn, rebuild
        engine.on_sampled = self._send_early
        self.sent: dict[str, int] = {}  # request id -> tokens already sent, for requests in flight
        self.broken: str | None = None
        self.stopping = False
        self.replies: list[tuple[str, tuple[str, str] | None]] = []
        self.failed: list[tuple[str, str]] = []
        self.reconfigured: list[tuple[int, tuple]] = []  # (token, ("ok", EngineInfo) | ("busy" | "error", ...))

    def run(self) -> None:
        # One poll object for the whole loop: Connection.poll(0) builds a selector per call, and this
        # check runs before every step (a visible share of a tiny model's step).
        commands = select.poll()
        commands.register(self.conn.fileno(), select.POLLIN)
        stats_at = None  # when the last stats snapshot went out (None: never)
        while not self.stopping:
            busy = self.broken is None and self.engine.has_unfinished_requests()
            if commands.poll(0 if busy else IDLE_WAIT_S * 1000):  # (milliseconds)
                while commands.poll(0):
                    self._command(self.conn.recv())
            deltas: list[_Delta] = []
            if self.broken is None and self.engine.has_unfinished_requests() and not self.stopping:
                deltas = self._step()
            news = bool(self.replies or self.failed or self.reconfigured)
            if news or deltas or stats_at is None:
                now = time.monotonic()
                fresh = (news or stats_at is None or now - stats_at >= STATS_INTERVAL_S
                         or any(delta[2] for delta in deltas))
                if fresh:
                    stats_at = now
                self._send_batch(read_engine_stats(self.engine) if fresh else None, deltas, now)
        self._fail_all("the server is shutting down")
        self._send_batch(read_engine_stats(self.engine), [], time.monotonic())

    def _send_batch(self, stats: EngineStats | None, deltas: list[_Delta], now: float) -> None:
        # pickle itself, not Connection.send: its ForkingPickler copies copyreg's dispatch table for every
        # message (a third more per batch); a batch is plain data, and recv() reads either.
        self.conn.send_bytes(pickle.dumps((self.replies, self.failed, now, stats, deltas, self.broken,
                                           self.reconfigured), protocol=pickle.HIGHEST_PROTOCOL))
        self.replies, self.failed, self.reconfigured = [], [], []

    def _command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, priority, *salt = command  # the salt is optional: older senders
            cache_salt = salt[0] if salt else None
            if self.broken is not None:
                self.replies.append((request_id, ("failure", f"the engine is not serving: {self.broken}")))
                return
            try:
                self.engine.add_request(request_id, prompt_ids, params, priority=priority, cache_salt=cache_salt)
            except RequestRejected as e:
                self.replies.append((request_id, ("rejected", str(e))))
                return
            except Exception as e:  # any refusal goes back to its caller; the loop goes on
                self.replies.append((request_id, ("failure", f"{type(e).__name__}: {e}")))
                return
            self.sent[request_id] = 0
            self.replies.append((request_id, None))
        elif kind == "abort":
            if command[1] in self.sent:
                try:
                    self.engine.abort_request(command[1])
                except Exception:
                    log.exception("abort of %s failed", command[1])
        elif kind == "reconfigure":
            _, token, config = command
            self.reconfigured.append((token, self._reconfigure(config)))
        elif kind == "stop":
            self.stopping = True

    def _reconfigure(self, config: EngineConfig) -> tuple:
        """A new engine for ``config`` in place of this one, if nothing is in flight; the answer to send."""
        if self.rebuild is None:
            return ("error", "config", "this engine core cannot be reconfigured", None)
        if self.broken is not None:
            return ("busy", f"the engine is not serving: {self.broken}")
        if self.sent or self.engine.has_unfinished_requests():
            return ("busy", f"{len(self.sent)} request(s) in flight: reconfigure only an idle engine")
        started = time.perf_counter()
        engine, refusal = _build_engine(self.rebuild, config)
        if refusal is not None:
            return ("error", *refusal)
        self.engine = engine
        engine.on_sampled = self._send_early
        log.info("engine reconfigured in %.0f ms: %s", (time.perf_counter() - started) * 1e3, engine.config)
        return ("ok", EngineInfo.of(engine))

    def _step(self) -> list[_Delta]:
        """The step's news per request. A step that raises fails every request in flight; the tokens it
        had already given them (a step can fail after its model run) go out first, in the same batch as
        the failures (:func:`~reference_engine.serve.engine_loop.held_outputs`)."""
        try:
            outputs = self.engine.step().outputs
        except Exception as e:
            log.exception("engine step failed; failing the %d requests in flight", len(self.sent))
            deltas = self._deltas(held_outputs(self.engine, self.sent))
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            return deltas
        return self._deltas(outputs)

    def _send_early(self, tokens: dict[str, int]) -> None:
        """A forward pass of the step running has sampled ``tokens`` (the engine's ``microbatch_tokens``):
        send them now, each request's delta as its step-end output will hold it, and count them as sent,
        so the step's own batch carries only what is left (its finish, the later passes' tokens)."""
        held = self.engine.scheduler.requests
        early = []
        for request_id, token in tokens.items():
            req = held.get(request_id)
            if req is None or request_id not in self.sent:
                continue
            out = RequestOutput.of(req)
            early.append(replace(out, token_ids=[*out.token_ids, token]))
        if deltas := self._deltas(early):
            self._send_batch(None, deltas, time.monotonic())

    def _deltas(self, outputs: list[RequestOutput]) -> list[_Delta]:
        deltas: list[_Delta] = []
        for out in outputs:
            sent = self.sent.get(out.request_id)
            if sent is None:
                continue
            if not out.finished and len(out.token_ids) <= sent:
                continue  # its tokens went out early (_send_early) and it goes on: nothing new to say
            logprobs = out.logprobs[sent:] if out.logprobs is not None else None
            deltas.append((out.request_id, out.token_ids[sent:], out.finished, out.finish_reason,
                           out.num_preemptions, out.num_recomputed_tokens, out.num_cached_tokens, logprobs))
            if out.finished:
                del self.sent[out.request_id]
            else:
                self.sent[out.request_id] = len(out.token_ids)
        return deltas

    def _fail_all(self, message: str) -> None:
        failed, self.sent = self.sent, {}
        self.failed.extend((request_id, message) for request_id in failed)
        if (error := abort_and_drain(self.engine, failed)) is not None:
            self.broken = f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------------------------------- server side
@dataclass
class _Request:
    flight: InFlight
    prompt_ids: list[int]
    accepted: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


class EngineProcess:
    """Starts the engine process and speaks to it; see the module docstring for the contract."""

    def __init__(self, conn: multiprocessing.connection.Connection, info: EngineInfo,
                 process: multiprocessing.process.BaseProcess | None = None, output_poll_s: float = OUTPUT_POLL_S):
        """Speak to an engine core at the other end of ``conn`` (which has sent its ready message,
        ``info``): normally the engine process that :meth:`spawn` started, which :meth:`stop` joins.
        ``output_poll_s``: how often the reader looks at the pipe while requests are in flight (0: it
        sleeps on the pipe; see :data:`OUTPUT_POLL_S`)."""
        if output_poll_s < 0:
            raise ValueError(f"output_poll_s={output_poll_s} is invalid: expected seconds >= 0")
        self._conn, self.info, self._process = conn, info, process
        self._output_poll_s = output_poll_s
        self.metrics: ServerMetrics | None = None
        self._stats = EngineStats()
        self._requests: dict[str, _Request] = {}  # touched only on the event loop
        self._aio: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._broken: str | None = None
        self._stopping = False
        self._tokens = itertools.count(1)
        self._reconfiguring: tuple[int, asyncio.Future] | None = None  # touched only on the event loop

    @classmethod
    def spawn(cls, config: EngineConfig, start_timeout: float = START_TIMEOUT_S,
              threads: int | None = None, while_loading: Callable[[], Any] | None = None,
              bind_cpus: bool = False, output_poll_s: float = OUTPUT_POLL_S,
              preload: Path | None = None) -> EngineProcess:
        """Start the engine process for ``config`` and wait until its engine is built; raises
        :class:`EngineStartError` with the engine's own message if it cannot be. ``threads``: the engine
        process's torch threads (None: torch's default there). ``bind_cpus``: bind the engine process to
        ``threads`` cores and this process to the others (:func:`split_cpus`; nothing is bound where no core
        is left over). ``while_loading()`` runs here once the process has started, before waiting for it
        (the server imports its HTTP stack meanwhile: the two start-ups overlap instead of adding up); if
        it raises, the engine process is killed. ``output_poll_s``: as in the constructor. ``preload``: a
        library the engine process is started with (its malloc: :mod:`reference_engine.serve.allocator`)."""
        if output_poll_s < 0:
            raise ValueError(f"output_poll_s={output_poll_s} is invalid: expected seconds >= 0")
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads or torch
        conn, child_conn = ctx.Pipe(duplex=True)
        split = split_cpus(threads) if bind_cpus and threads is not None else None
        engine_cpus, own_cpus = split if split is not None else (None, None)
        process = ctx.Process(target=_engine_main, args=(config, child_conn, threads, engine_cpus),
                              name="reference_engine-core", daemon=True)
        with preloading(preload):
            process.start()
        if own_cpus is not None:
            os.sched_setaffinity(0, own_cpus)
            log.info("engine process bound to cores %s, HTTP process to %s", engine_cpus, own_cpus)
        child_conn.close()  # ours is closed in the child: its death reads as EOF here
        if while_loading is not None:
            try:
                while_loading()
            except BaseException:
                _kill(process)
                raise
        return cls(conn, _await_ready(conn, process, start_timeout), process, output_poll_s)

    # ------------------------------------------------------------------ the EngineLoop interface
    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine's outputs on ``aio_loop``; once (the pipe has one reader)."""
        if self._aio is not None:
            raise RuntimeError("EngineProcess.start() was called twice")
        self._aio = aio_loop
        self._reader = threading.Thread(target=self._read, name="reference_engine-outputs", daemon=True)
        self._writer = threading.Thread(target=self._write, name="reference_engine-commands", daemon=True)
        self._reader.start()
        self._writer.start()

    async def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                  priority: int = 0, cache_salt: str | None = None) -> asyncio.Queue:
        """As ``EngineLoop.add``: the queue of ``request_id``'s outputs, or ``RequestRejected`` /
        ``EngineFailure``. A caller cancelled while waiting must still call :meth:`abort`."""
        if self._broken is not None or self._stopping:
            raise EngineFailure(f"the engine is not serving: {self._broken or 'server stopping'}")
        if request_id in self._requests:  # as the engine would: the first request keeps its outputs
            raise RequestRejected(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        accepted = asyncio.get_running_loop().create_future()
        request = _Request(InFlight(asyncio.Queue(), time.monotonic(), len(prompt)), prompt, accepted)
        self._requests[request_id] = request
        self._outbox.put(("add", request_id, prompt, params, priority, cache_salt))
        await accepted
        return request.flight.outputs

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` if it is still in flight (does not wait); its queue gets the aborted output."""
        self._outbox.put(("abort", request_id))

    async def reconfigure(self, config: EngineConfig) -> EngineInfo:
        """Replace the engine with one built from ``config`` in the engine process (torch and the model are
        loaded there already); return its info. From then on ``info``, ``stats()`` and ``metrics`` describe
        the new engine alone (``metrics`` is a fresh :class:`ServerMetrics`: counters and histograms at zero).
        Raises :class:`EngineBusy` while requests are in flight (here or in the engine process),
        :class:`EngineStartError` when the engine refuses ``config`` (the old engine serves on), or
        :class:`EngineFailure` when the engine is not serving."""
        if self._broken is not None or self._stopping:
            raise EngineFailure(f"the engine is not serving: {self._broken or 'server stopping'}")
        if self._reconfiguring is not None:
            raise EngineBusy("another reconfigure is under way")
        if self._requests:
            raise EngineBusy(f"{len(self._requests)} request(s) in flight: reconfigure only an idle engine")
        token = next(self._tokens)
        answer = asyncio.get_running_loop().create_future()
        self._reconfiguring = (token, answer)
        try:
            self._outbox.put(("reconfigure", token, config))
            return await answer
        finally:
            self._reconfiguring = None

    @property
    def broken(self) -> str | None:
        """Why the engine no longer serves (its process died), or None while it does."""
        return self._broken

    def num_waiting_on(self) -> int:
        """Requests this side still waits on (added or being added, not yet finished or failed)."""
        return len(self._requests)

    def stats(self) -> EngineStats:
        """The latest snapshot the engine process sent: exact as of any batch that finished a request or
        answered a command, else at most ``STATS_INTERVAL_S`` older than the tokens streamed (tokens sent
        early, while their step runs, are in the counters once the step has ended)."""
        return self._stats

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (failing what is in flight) and wait for it; kill it if it hangs."""
        self._stopping = True
        if self._writer is None:  # never started: nobody drains the outbox
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("stop",))
        else:
            self._outbox.put(("stop",))
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                log.error("engine process did not stop within %.1f s (a step is still running): killing it",
                          timeout)
                _kill(self._process)
        self._outbox.put(None)
        for thread in (self._writer, self._reader):
            if thread is not None:
                thread.join(timeout)
        self._conn.close()

    # ------------------------------------------------------------------ the pipe
    def _write(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                return  # the engine process is gone; the reader sees it
            except Exception as e:  # a command that cannot be pickled, say: fail that request, not all
                log.exception("could not send %s to the engine process", command[0])
                if command[0] == "add":
                    self._hop(self._refuse, command[1], f"could not send the request to the engine: "
                                                        f"{type(e).__name__}: {e}")

    def _read(self) -> None:
        """One blocking read per batch and one hop onto the event loop with it. A thread rather than
        ``add_reader``: uvloop makes a watched descriptor non-blocking, and multiprocessing's framing
        needs blocking reads and writes on it. While requests are in flight the thread looks at the pipe
        every ``output_poll_s`` rather than sleeping on it (:data:`OUTPUT_POLL_S` says why); otherwise it
        sleeps on it, so an idle server does not wake."""
        pipe = select.poll()
        pipe.register(self._conn.fileno(), select.POLLIN)
        poll_s = self._output_poll_s
        while True:
            if poll_s and self._requests and not pipe.poll(0):  # (a bool of a dict: safe off the loop)
                time.sleep(poll_s)
                continue
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                if self._process is not None:
                    self._process.join(1)  # here, not on the event loop: its exit status for the log
                self._hop(self._gone, None)
                return
            except Exception as e:  # an unreadable message: the stream is out of step, nothing after it counts
                log.exception("unreadable message from the engine process")
                if self._process is not None:
                    _kill(self._process)
                self._hop(self._gone, f"unreadable message from the engine process: {type(e).__name__}: {e}")
                return
            self._hop(self._handle, batch)

    def _hop(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
            self._aio.call_soon_threadsafe(fn, *args)

    def _gone(self, reason: str | None) -> None:
        """The pipe closed (at shutdown, or because the engine process died) or became unreadable."""
        if self._stopping:
            reason = "the server is shutting down"
        else:
            if reason is None:
                code = None if self._process is None else self._process.exitcode
                reason = f"the engine process exited (status {code})"
            log.log(logging.ERROR if self._requests else logging.WARNING, "%s: failing the %d requests in flight",
                    reason, len(self._requests))
            self._broken = reason
        self._detach(reason)

    def _refuse(self, request_id: str, message: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._fail(request, EngineFailure(message))

    def _detach(self, reason: str) -> None:
        """Fail every request still waiting, and a reconfigure: the engine process is gone."""
        if self._reconfiguring is not None and not self._reconfiguring[1].done():
            self._reconfiguring[1].set_exception(EngineFailure(reason))
        requests, self._requests = self._requests, {}
        for request in requests.values():
            self._fail(request, EngineFailure(reason))

    @staticmethod
    def _fail(request: _Request, error: EngineFailure) -> None:
        if not request.accepted.done():
            request.accepted.set_exception(error)
        else:
            request.flight.outputs.put_nowait(error)

    def _handle(self, batch: tuple[list, list, float, EngineStats | None, list[_Delta], str | None, list]) -> None:
        """One batch from the engine process, in its order of events: replies to adds, then the tokens of
        the step, then failures (a failed step's batch carries the tokens it gave its requests before they
        failed: each request's queue gets them ahead of its failure)."""
        replies, failed, now, stats, deltas, broken, reconfigured = batch
        if stats is not None:
            self._stats = stats
        for token, answer in reconfigured:
            self._reconfigured(token, answer)
        if broken is not None and self._broken is None:  # even aborting failed requests failed there
            self._broken = f"engine step failed and its requests could not be aborted: {broken}"
        for request_id, refusal in replies:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if refusal is not None:  # never in the engine: forget it, even if its caller is gone
                del self._requests[request_id]
                if not request.accepted.done():
                    kind, message = refusal
                    request.accepted.set_exception(RequestRejected(message) if kind == "rejected"
                                                   else EngineFailure(message))
            elif not request.accepted.done():  # (a cancelled caller's abort follows and ends it)
                request.accepted.set_result(None)
        for delta in deltas:
            self._deliver(delta, now)
        for request_id, message in failed:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._fail(request, EngineFailure(message))

    def _reconfigured(self, token: int, answer: tuple) -> None:
        """The engine process's answer to reconfigure ``token``. On success the new engine's info and fresh
        metrics are in place before the caller hears of it (and before any output of the new engine), even
        when the caller is gone: the engine process has swapped all the same."""
        if answer[0] == "ok":
            self.info = answer[1]
            if self.metrics is not None:
                self.metrics = self.metrics.renewed(self.info.config, self.info.num_gpu_blocks,
                                                    self.info.num_cpu_blocks)
        if self._reconfiguring is None or self._reconfiguring[0] != token or self._reconfiguring[1].done():
            return  # its caller was cancelled
        future = self._reconfiguring[1]
        if answer[0] == "ok":
            future.set_result(self.info)
        elif answer[0] == "busy":
            future.set_exception(EngineBusy(answer[1]))
        else:
            _, kind, message, field_name = answer
            future.set_exception(EngineStartError(kind, message, field_name))

    def _deliver(self, delta: _Delta, now: float) -> None:
        request_id, new_ids, finished, reason, preemptions, recomputed, cached, new_logprobs = delta
        request = self._requests.get(request_id)
        if request is None:
            return
        request.token_ids.extend(new_ids)
        if new_logprobs is not None:
            if request.logprobs is None:
                request.logprobs = []
            request.logprobs.extend(new_logprobs)
        out = RequestOutput(request_id, request.prompt_ids, list(request.token_ids), finished, reason, preemptions,
                            recomputed, cached, list(request.logprobs) if request.logprobs is not None else None)
        observe_output(self.metrics, request.flight, out, now)
        request.flight.outputs.put_nowait(out)
        if finished:
            del self._requests[request_id]


def _await_ready(conn: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess,
                 timeout: float) -> EngineInfo:
    """The engine process's ready message, or :class:`EngineStartError` with why it never came."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not process.is_alive():
            raise EngineStartError("process", f"the engine process exited with status {process.exitcode} "
                                              "before it was ready")
        if time.monotonic() > deadline:
            _kill(process)
            raise EngineStartError("process", f"the engine process was not ready within {timeout:.0f} s")
    try:
        message = conn.recv()
    except EOFError:
        process.join(5)
        raise EngineStartError("process", f"the engine process exited with status {process.exitcode} "
                                          "before it was ready") from None
    if message[0] == "error":
        process.join(5)
        raise EngineStartError(message[1], message[2])
    return message[1]


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    process.kill()
    process.join(5)
