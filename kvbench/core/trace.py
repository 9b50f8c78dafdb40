"""The trace: everything that happened in one timed run, from which every metric is computed.

Times are seconds since the start of the run (the workload's clock: a request with
``arrival_time=2.0`` is released two seconds after the run starts).

Per request: arrival, admission (first time the engine scheduled it), the time of every output
token, preemptions with their mode, resumes, finish and reason. Per engine step: queue lengths,
KV usage of both pools and tokens scheduled. An adapter that cannot observe something says so
with :meth:`TraceRecorder.not_exposed`, and the report shows it rather than a zero.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvbench.core.counters import Counters


@dataclass
class RequestTrace:
    request_id: str
    arrival: float
    prompt_len: int
    max_tokens: int
    priority: int = 0
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: list[tuple[float, str]] = field(default_factory=list)  # (time, "recompute"|"swap")
    resumes: list[float] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0
    # how many times the engine reported this request finished: `finished` and `finish_reason` keep
    # the first, and anything above 1 is an engine bug that checks must see
    finish_count: int = 0
    # set by a driver that aborts by closing the client's stream (HTTP): when it closed a stream that had not
    # ended, and how many tokens the client had received by then. Evidence of what the client did, never of
    # what the engine did (the engine's own counters and gauges say that)
    abort_sent: float | None = None
    tokens_at_abort: int | None = None
    # what the client read, where the recorder keeps outputs (``TraceRecorder(keep_outputs=True)``): the
    # output's token ids and its text (streamed deltas joined); None where not kept or not returned
    output_token_ids: list[int] | None = None
    output_text: str | None = None
    # the server's words when a response that had begun (HTTP 200) ended in an error event, else None
    error_event: str | None = None
    # the server's (or the transport's) words for a request that ended "error" or "rejected", however it ended
    # (an HTTP error status, an error event, a broken connection), else None
    error: str | None = None


@dataclass
class StepRecord:
    t: float  # when the step ended
    duration: float
    num_running: int
    num_waiting: int
    num_swapped: int = 0
    kv_usage: float | None = None  # device pool, 0..1
    cpu_kv_usage: float | None = None  # host pool, 0..1
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0  # preemptions that happened in this step
    # the step clock's time when this step ran (step index x step_seconds); None on the wall clock
    virtual_t: float | None = None
    # True: not an engine step but a sample of a server's /metrics (queues and KV usage only): its
    # token counts and num_preempted are not exposed (left 0), and must never be read as "none"
    sampled: bool = False
    # samples only: what the server's /metrics counted since the run's first sample (cumulative); None where
    # the server does not expose it. Preemptions of every mode; prefix-cache hits and lookups in tokens.
    server_preemptions: int | None = None
    server_prefix_hits: int | None = None
    server_prefix_queries: int | None = None


@dataclass
class Trace:
    engine: str
    scenario: str
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    #: the engine's own cumulative counters at the end (the counter contract: None = not exposed)
    counters: Counters = field(default_factory=Counters)
    not_exposed: dict[str, str] = field(default_factory=dict)  # what the engine could not report, and why
    duration: float = 0.0
    # set when arrivals and aborts were released by engine step (kvbench.drivers.step_loop): virtual
    # seconds per step. Times above stay on the wall clock; StepRecord.virtual_t maps them back.
    step_seconds: float | None = None
    # every /metrics scrape kvbench's own sampler made during the run, (asked, answered) on the same clock as
    # the token times (kvbench.bench.sampler_cost); None where no sampler ran (an in-process engine, or a
    # server sampled with metrics_interval=0)
    scrapes: list[tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.counters, Counters):
            self.counters = Counters.from_dict(self.counters)
        if self.scrapes is not None:
            self.scrapes = [(float(a), float(b)) for a, b in self.scrapes]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def finished_more_than_once(self) -> dict[str, int]:
        """Request id -> number of finishes, for every request the engine finished twice or more."""
        return {rid: r.finish_count for rid, r in self.requests.items() if r.finish_count > 1}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        requests = {}
        for rid, r in data.get("requests", {}).items():
            r = dict(r)
            r["preemptions"] = [tuple(p) for p in r.get("preemptions", [])]
            requests[rid] = RequestTrace(**r)
        steps = [StepRecord(**s) for s in data.get("steps", [])]
        return cls(engine=data["engine"], scenario=data["scenario"], requests=requests, steps=steps,
                   counters=Counters.from_dict(data.get("counters")), not_exposed=dict(data.get("not_exposed", {})),
                   duration=float(data.get("duration", 0.0)), step_seconds=data.get("step_seconds"),
                   scrapes=data.get("scrapes"))


class TraceRecorder:
    """Collects a :class:`Trace` as an adapter serves a workload. Not thread-safe on purpose:
    adapters that run engines on other threads record from one thread (see ``hf.continuous_batching``).

    ``keep_outputs``: keep each request's output token ids and text where the driver reads them
    (:meth:`output`); off by default, since a benchmark's trace needs only times and counts."""

    def __init__(self, engine: str, scenario: str, clock=time.perf_counter, keep_outputs: bool = False):
        self.trace = Trace(engine=engine, scenario=scenario)
        self._clock = clock
        self._t0 = clock()
        self.keeps_outputs = keep_outputs

    def now(self) -> float:
        return self._clock() - self._t0

    def use_clock(self, clock) -> None:
        """Read times from ``clock`` from now on (a simulator's virtual clock), starting at zero."""
        self._clock = clock
        self._t0 = clock()

    def restart_clock(self) -> None:
        """Make ``now()`` zero: call right before releasing the first request."""
        self._t0 = self._clock()

    def _req(self, request_id: str) -> RequestTrace:
        return self.trace.requests[request_id]

    def arrived(self, request_id: str, t: float, prompt_len: int, max_tokens: int, priority: int = 0) -> None:
        self.trace.requests[request_id] = RequestTrace(request_id, t, prompt_len, max_tokens, priority)

    def admitted(self, request_id: str, t: float) -> None:
        r = self._req(request_id)
        if r.admitted is None:
            r.admitted = t

    def tokens(self, request_id: str, t: float, n: int = 1) -> None:
        self._req(request_id).token_times.extend([t] * n)

    def preempted(self, request_id: str, t: float, mode: str) -> None:
        self._req(request_id).preemptions.append((t, mode))

    def resumed(self, request_id: str, t: float) -> None:
        self._req(request_id).resumes.append(t)

    def finished(self, request_id: str, t: float, reason: str | None) -> None:
        """Keep the first finish; count every one (:meth:`Trace.finished_more_than_once`)."""
        r = self._req(request_id)
        r.finish_count += 1
        if r.finished is None:
            r.finished = t
            r.finish_reason = reason

    def abort_sent(self, request_id: str, t: float, tokens_received: int) -> None:
        """The client closed ``request_id``'s stream at ``t``, before it ended, having received
        ``tokens_received`` tokens (the first close is kept)."""
        r = self._req(request_id)
        if r.abort_sent is None:
            r.abort_sent, r.tokens_at_abort = t, tokens_received

    def output(self, request_id: str, token_ids: list[int] | None, text: str | None) -> None:
        """What the client read of ``request_id``: the token ids the server returned (None where it returned
        none) and its text; kept only with ``keep_outputs``."""
        if self.keeps_outputs:
            r = self._req(request_id)
            r.output_token_ids = None if token_ids is None else list(token_ids)
            r.output_text = text

    def error_event(self, request_id: str, message: str) -> None:
        """``request_id``'s response began and then ended in an error event saying ``message``."""
        self._req(request_id).error_event = message

    def error(self, request_id: str, message: str) -> None:
        """``request_id`` ended in an error or a refusal, the server or the transport saying ``message``."""
        self._req(request_id).error = message

    def add_request_counts(self, request_id: str, recomputed_tokens: int = 0, prefix_hit_tokens: int = 0) -> None:
        r = self._req(request_id)
        r.recomputed_tokens += recomputed_tokens
        r.prefix_hit_tokens += prefix_hit_tokens

    def step(self, record: StepRecord) -> None:
        self.trace.steps.append(record)

    def scraped(self, asked: float, answered: float) -> None:
        """kvbench's own sampler scraped the server's /metrics from ``asked`` to ``answered`` (this clock)."""
        if self.trace.scrapes is None:
            self.trace.scrapes = []
        self.trace.scrapes.append((asked, answered))

    def set_counters(self, counters: Counters | dict[str, float]) -> None:
        """The engine's counters at the end of the run (a mapping is read with ``Counters.from_dict``)."""
        self.trace.counters = counters if isinstance(counters, Counters) else Counters.from_dict(counters)

    def not_exposed(self, what: str, why: str) -> None:
        self.trace.not_exposed[what] = why

    def finish(self) -> Trace:
        self.trace.duration = self.now()
        return self.trace
