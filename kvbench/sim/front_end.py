"""A serving front end's delivery, simulated: what a client of a served engine sees of its steps.

A served engine's client does not see its steps. In vLLM V1 the engine core (its own process) sends
each step's outputs to the API server, one asyncio loop that (``v1/engine/async_llm.py``):

* takes requests in: HTTP, tokenization, hand-off to the engine core (``add_request``);
* absorbs each step's outputs (``output_handler``: ``engine_core.get_output_async()``, then
  ``OutputProcessor.process_outputs``: detokenize per request, ``RequestOutputCollector.put``);
* runs each request's stream task (``generate()``: ``q.get_nowait() or await q.get()``, then the
  OpenAI layer formats an SSE chunk and writes it).

``RequestOutputCollector.put`` *merges* a request's delta into the output its stream has not taken
yet, so when the stream tasks do not get the loop in time, the tokens of several steps leave as one
chunk, and a request's finish reaches the client only with its last chunk. A closed-loop client sends
its next request when it sees the finish.

How the loop takes turns decides the chunks. The socket reader (``process_outputs_socket``) drains
every engine output the socket holds without yielding (a ready ``recv_multipart`` is a done future),
and the output handler drains its queue without yielding (``asyncio.Queue.get`` on a non-empty queue;
``process_outputs`` is synchronous up to ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` outputs); the stream tasks
it woke run when it finally waits, and only then does the loop poll its sockets again. So the loop
runs in *cycles*: take in the HTTP requests and read the engine outputs that arrived by the poll,
absorb every output read, then write one chunk per stream with something pending. Outputs arriving
during a cycle wait for the next: the longer a cycle, the more steps the next one merges; when
absorbing a step costs more than the engine takes to make one, cycles grow without end and the
client falls ever further behind.

:class:`FrontEnd` is that loop: one cycle at a time, starting when the last ended (or at the next
arrival), each ``intake`` (``per_request_s``; the request reaches the engine when it is done), each
``absorb`` (``per_step_s + per_output_s`` per request in the step), each ``deliver`` (``per_chunk_s``:
one chunk holding every token the request had pending) one after another. Costs are a profile's
:class:`~reference_engine.costs.FrontEndCosts`. All zero: every step's tokens reach the client at the
step's end, one chunk per step, as without a front end. What it does not model: the API server
waiting for a core (on a loaded machine, or under ``nice``, whole requests can leave in one chunk
because the process did not run); its fit folds that into the costs.

:func:`serve_through_front_end` runs a simulated engine and a front end side by side on the virtual
clock; :func:`fit_front_end` calibrates the costs from what a client observes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.drivers.step_loop import record_scheduling
from reference_engine.costs import FrontEndCosts


@dataclass(frozen=True)
class Submitted:
    """The front end handed ``request`` to the engine at ``t``."""

    t: float
    request: Any


@dataclass(frozen=True)
class Chunk:
    """The client received ``tokens`` tokens of ``request_id`` at ``t`` (and its finish, if ``reason`` is set:
    ``finished`` True)."""

    t: float
    request_id: str
    tokens: int
    finished: bool = False
    reason: str | None = None


class FrontEnd:
    """vLLM's API server loop as cycles of intake, absorb, deliver (see the module docstring).

    Causality contract: :meth:`run_until` ``(t)`` carries out every cycle that *starts* at or before
    ``t``, so every input that arrives at or before ``t`` (engine outputs, requests) must have been given
    first. Its events may lie after ``t`` (a cycle started before ``t`` ends when it ends)."""

    def __init__(self, costs: FrontEndCosts):
        self.costs = costs
        self.free_at = 0.0  # when the cycle in progress ends
        self._inputs: list[tuple[float, int, str, Any]] = []  # (arrived at, order, "intake"|"absorb", payload)
        self._order = itertools.count()
        self.cycles = 0

    def take_in(self, t: float, request: Any) -> None:
        """A client sent ``request`` at ``t``."""
        heapq.heappush(self._inputs, (t, next(self._order), "intake", request))

    def engine_output(self, t: float, new_tokens: dict[str, int], finished: dict[str, str | None]) -> None:
        """An engine step ended at ``t`` with these tokens and finishes."""
        if new_tokens or finished:
            heapq.heappush(self._inputs, (t, next(self._order), "absorb", (dict(new_tokens), dict(finished))))

    def next_start(self) -> float | None:
        """When the next cycle would start; None when nothing is queued."""
        return max(self.free_at, self._inputs[0][0]) if self._inputs else None

    def idle(self) -> bool:
        return not self._inputs

    def run_until(self, t: float) -> list[Submitted | Chunk]:
        """Carry out every cycle that starts at or before ``t``; their effects, in order."""
        out: list[Submitted | Chunk] = []
        c = self.costs
        while (start := self.next_start()) is not None and start <= t:
            self.cycles += 1
            taken = []
            while self._inputs and self._inputs[0][0] <= start:
                taken.append(heapq.heappop(self._inputs))
            clock = start
            for _, _, kind, payload in taken:  # HTTP requests first: their tasks were ready before the reader's
                if kind == "intake":
                    clock += c.per_request_s
                    out.append(Submitted(clock, payload))
            pending: dict[str, list] = {}  # request id -> [tokens, finished, reason], in the order streams woke
            for _, _, kind, payload in taken:
                if kind != "absorb":
                    continue
                tokens, finished = payload
                ids = tokens.keys() | finished.keys()
                clock += c.per_step_s + c.per_output_s * len(ids)
                for rid in sorted(ids):
                    got = pending.setdefault(rid, [0, False, None])
                    got[0] += tokens.get(rid, 0)
                    if rid in finished:
                        got[1], got[2] = True, finished[rid]
            for rid, (n, done, reason) in pending.items():
                clock += c.per_chunk_s
                out.append(Chunk(clock, rid, n, done, reason))
            self.free_at = clock
        return out


def serve_through_front_end(engine: Any, clock: Any, requests: Sequence[Any], recorder: Any, costs: FrontEndCosts,
                            concurrency: int | None = None, progress: Any = None) -> None:
    """Serve ``requests`` on a simulated ``engine`` (the driver's SteppableEngine protocol, stepped on the
    plain path) behind a :class:`FrontEnd` of ``costs``, on the virtual ``clock``.

    The client's view goes into ``recorder``: a request arrives when the client sends it (its workload
    arrival; in a closed loop of ``concurrency``, when the client sees a predecessor's finish), its tokens
    and finish when a chunk delivers them; engine events (admissions, preemptions, resumes, steps) at
    the end of the engine step they happened in. The engine takes a request in before its first step
    that starts after the front end handed it over. Aborts (``abort_at``, seconds after the client
    sent the request) reach the engine before the first step that starts after they are due. Raises
    RuntimeError naming the requests that can never finish (no engine work, nothing queued)."""
    front = FrontEnd(costs)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    released = 0
    to_engine: list[tuple[float, int, Any]] = []
    aborts: list[tuple[float, int, str]] = []
    order = itertools.count()
    open_ids: set[str] = set()  # sent, finish not yet seen by the client
    in_engine: set[str] = set()  # handed over to the engine, finish not yet seen by the client
    abort_on_arrival: set[str] = set()  # due for abort before the front end handed them over

    def send(t: float) -> None:
        nonlocal released
        req = pending[released]
        released += 1
        recorder.arrived(req.request_id, t, len(req.prompt_token_ids), req.max_tokens, req.priority)
        open_ids.add(req.request_id)
        front.take_in(t, req)
        if req.abort_at is not None:
            heapq.heappush(aborts, (t + req.abort_at, next(order), req.request_id))

    recorder.use_clock(clock.now)
    recorder.restart_clock()
    t0 = clock.now()
    if concurrency is not None:
        while released < min(concurrency, len(pending)):
            send(0.0)
    while released < len(pending) or open_ids:
        now = clock.now() - t0
        if concurrency is None:  # open loop: every request the client has sent by now
            while released < len(pending) and pending[released].arrival_time <= now:
                send(pending[released].arrival_time)
        while True:  # front-end actions that start by now (a delivered finish may send a request)
            events = front.run_until(now)
            if not events:
                break
            for ev in events:
                if isinstance(ev, Submitted):
                    heapq.heappush(to_engine, (ev.t, next(order), ev.request))
                    continue
                if ev.tokens:
                    recorder.tokens(ev.request_id, ev.t, ev.tokens)
                if ev.finished:
                    recorder.finished(ev.request_id, ev.t, ev.reason)
                    open_ids.discard(ev.request_id)
                    in_engine.discard(ev.request_id)
                    if progress is not None:
                        progress(1)
                    if concurrency is not None and released < len(pending):
                        send(ev.t)
        while aborts and aborts[0][0] <= now:
            rid = heapq.heappop(aborts)[2]
            if rid in in_engine:
                engine.abort(rid)
            elif rid in open_ids:  # still in the front end: the engine aborts it as soon as it has it
                abort_on_arrival.add(rid)
        while to_engine and to_engine[0][0] <= now:
            req = heapq.heappop(to_engine)[2]
            engine.submit(req)
            in_engine.add(req.request_id)
            if req.request_id in abort_on_arrival:
                engine.abort(req.request_id)
        if engine.has_work():
            started = clock.now() - t0
            report = engine.step()
            t = clock.now() - t0
            record_scheduling(recorder, report, t)
            report.record.t, report.record.duration = t, t - started
            recorder.step(report.record)
            front.engine_output(t, report.new_tokens, report.finished)
            continue
        # the engine is idle: done, or on to the next thing that happens
        if released == len(pending) and not open_ids:
            break
        times = [x for x in (front.next_start(), to_engine[0][0] if to_engine else None,
                             aborts[0][0] if aborts else None,
                             pending[released].arrival_time if concurrency is None and released < len(pending)
                             else None) if x is not None and x > now]
        if not times:
            stuck = sorted(open_ids)[:5]
            raise RuntimeError(f"serve_through_front_end: {len(open_ids)} requests can never finish (engine and "
                               f"front end idle, nothing due): {stuck}")
        clock.advance_to(t0 + min(times))


# ---------------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class DeliveryCell:
    """What a client saw of one calibration cell: ``batch`` requests decoding together, one token each per
    engine step of ``step_s`` seconds (the engine's own clock, e.g. ``vllm:request_decode_time_seconds``),
    ``tokens`` tokens each; ``tokens_per_chunk``: the client's tokens over distinct arrival times, over the
    cell's requests; ``lag_s`` (None: not known): the mean over them of the client's time from sending to
    the finish less the engine's own time for the request (queued + inference, engine timestamps), i.e.
    the way in and the delivery after the engine's last token."""

    batch: int
    tokens: int
    step_s: float
    tokens_per_chunk: float
    lag_s: float | None = None


def simulate_cell(costs: FrontEndCosts, batch: int, tokens: int, step_s: float) -> float:
    """Tokens per chunk a front end of ``costs`` delivers for ``batch`` requests whose tokens leave the
    engine together, one per request every ``step_s`` (the last step finishes them all)."""
    return cell_figures(costs, batch, tokens, step_s)[0]


def cell_figures(costs: FrontEndCosts, batch: int, tokens: int, step_s: float) -> tuple[float, float]:
    """(tokens per chunk, lag) of :func:`simulate_cell`'s cell; the lag as :class:`DeliveryCell`'s: the
    intake plus the mean time from the engine's last step to the client's last chunk."""
    front = FrontEnd(costs)
    ids = [f"r{i}" for i in range(batch)]
    chunks, finished = 0, []
    for j in range(1, tokens + 2):
        t = j * step_s
        if j <= tokens:
            front.engine_output(t, dict.fromkeys(ids, 1), dict.fromkeys(ids, "length") if j == tokens else {})
        for e in front.run_until(t if j <= tokens else math.inf):
            if isinstance(e, Chunk):
                chunks += 1
                if e.finished:
                    finished.append(e.t)
    lag = costs.per_request_s + statistics.fmean(finished) - tokens * step_s
    return batch * tokens / chunks, lag


#: the costs :func:`fit_front_end` tries (seconds; 0 and 10 us to 100 ms, four per decade)
FIT_GRID = (0.0, *(10 ** (k / 4) * 1e-5 for k in range(17)))
#: lags below this (seconds) count as equal in the fit (a client's own timing noise)
LAG_FLOOR_S = 1e-3


def fit_front_end(cells: Sequence[DeliveryCell], lone_overhead_s: float | None,
                  grid: Sequence[float] = FIT_GRID) -> tuple[FrontEndCosts, float]:
    """Front-end costs that reproduce the tokens per chunk the client saw in ``cells``, and the fit's
    median relative error on them.

    ``per_step_s``, ``per_output_s`` and ``per_chunk_s`` are searched on ``grid``, minimizing the summed
    squared log error of :func:`cell_figures` against each cell's ``tokens_per_chunk`` and ``lag_s`` (where
    known; lags under :data:`LAG_FLOOR_S` count as equal; the lag says whether the front end keeps up
    with the engine, which tokens per chunk alone can leave open): every
    point of every other grid value in all three, then from the best four a coordinate pass on the grid
    and finer ones (16, then 64 steps per decade: the edge of keeping up is sharp). A lone request's way in
    and out holds one absorb and one delivery, so with
    ``lone_overhead_s`` (its client TTFT less the engine's time for it) only costs whose absorb of one
    output plus one delivery fit in it are tried. Ties (a client that saw one token per chunk everywhere
    is matched by any small costs) go to the cheapest costs. ``per_request_s`` is what is left of
    ``lone_overhead_s`` after that absorb and delivery. Raises ValueError without a cell."""
    if not cells:
        raise ValueError("fit_front_end: no delivery cell to fit (a server without /metrics decode times gives none)")
    seen: dict[tuple[float, float, float], tuple[float, float]] = {}

    limit = math.inf if lone_overhead_s is None else lone_overhead_s

    def key(v: tuple[float, float, float]) -> tuple[float, float]:
        if sum(v) > limit:
            return (math.inf, sum(v))
        if v not in seen:
            costs = with_intake(v)
            loss = 0.0
            for x in cells:
                per_chunk, lag = cell_figures(costs, x.batch, x.tokens, x.step_s)
                loss += (math.log(per_chunk) - math.log(x.tokens_per_chunk)) ** 2
                if x.lag_s is not None:
                    loss += (math.log(max(lag, 0.0) + LAG_FLOOR_S) - math.log(max(x.lag_s, 0.0) + LAG_FLOOR_S)) ** 2
            seen[v] = (round(loss, 9), sum(v))
        return seen[v]

    def with_intake(v: tuple[float, float, float]) -> FrontEndCosts:
        intake = max(0.0, (lone_overhead_s or 0.0) - sum(v))
        return FrontEndCosts(intake, *v)

    coarse = grid[::2]
    starts = sorted(itertools.product(coarse, coarse, coarse), key=key)[:4]
    found = []
    for best in starts:
        for step in (0, 16, 16, 64, 64):  # a coordinate pass on the grid, then finer ones around the best
            for i in range(3):
                if step and best[i] == 0:
                    continue
                values = [best[i] * 10 ** (k / step) for k in range(-4, 5)] if step else grid
                best = min((tuple(g if j == i else best[j] for j in range(3)) for g in values),  # type: ignore[misc]
                           key=key)
        found.append(best)
    best = min(found, key=key)
    costs = with_intake(best)
    errors = [abs(simulate_cell(costs, x.batch, x.tokens, x.step_s) / x.tokens_per_chunk - 1) for x in cells]
    return costs, statistics.median(errors)


def tokens_per_chunk(token_times: Sequence[Sequence[float]]) -> float | None:
    """Tokens over distinct arrival times, over requests (1: every token on its own); None without tokens."""
    tokens = sum(len(t) for t in token_times)
    chunks = sum(len(set(t)) for t in token_times)
    return tokens / chunks if chunks else None
