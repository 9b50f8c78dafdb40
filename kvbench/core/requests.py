"""Requests and outputs: what adapters are given and what they return.

``GenRequest``/``GenOutput``/``GenResult`` are batch generation (conformance); ``WorkloadRequest``
is one request of a timed workload (benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.core.counters import Counters
from kvbench.core.engine_events import EventRecord


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class GenRequest:
    """One request for batch generation."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True
    priority: int = 0
    #: tokens that end the request (finish reason "stop") when sampled; the token is kept in the output
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenOutput:
    """What one request produced. ``num_preemptions`` is None if the engine cannot tell; ``cached_tokens``
    (prompt tokens the engine says it served from its prefix cache for this request: vLLM's
    ``usage.prompt_tokens_details.cached_tokens``) is None where the engine does not say."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "length" | "stop" | "abort" | "rejected" | "error"
    num_preemptions: int | None = None
    error: str | None = None  # why a request was rejected or failed, in the engine's words
    cached_tokens: int | None = None


@dataclass
class GenResult:
    """Outputs in request order, plus the engine's counters after the run.

    ``counters`` is the counter contract (:class:`~kvbench.core.counters.Counters`): a field is
    ``None`` where the engine does not expose it, never 0. A plain mapping given here is read with
    :meth:`Counters.from_dict` (unknown names are refused, naming them).
    ``evidence`` lists free-text lines (log lines, event summaries, why a counter is not exposed)
    a check may quote.
    ``events`` are the engine's events in order (:mod:`kvbench.core.engine_events`); ``None`` when the
    engine reports none (checks that need them skip saying so).
    """

    outputs: list[GenOutput]
    counters: Counters = field(default_factory=Counters)
    evidence: list[str] = field(default_factory=list)
    events: list[EventRecord] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.counters, Counters):
            self.counters = Counters.from_dict(self.counters)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload. Treat ``prompt_token_ids`` as read-only.

    ``arrival_time`` is in seconds from the start of the run (0.0 in closed-loop workloads, where
    the driver submits a request when a slot frees). ``abort_at`` is in seconds after the request
    is submitted. ``priority``: lower is more important, as in vLLM.
    """

    request_id: str
    # Excluded from the hash (a list is unhashable); equality still compares the tokens.
    prompt_token_ids: list[int] = field(hash=False)
    max_tokens: int
    arrival_time: float
    priority: int = 0
    abort_at: float | None = None
    temperature: float = 0.0
    seed: int | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        where = f"WorkloadRequest {self.request_id!r}"
        _check(len(self.prompt_token_ids) >= 1, f"{where}: prompt_token_ids must not be empty")
        _check(self.max_tokens >= 1, f"{where}: max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.arrival_time >= 0, f"{where}: arrival_time must be >= 0, got {self.arrival_time}")
        _check(self.abort_at is None or self.abort_at >= 0,
               f"{where}: abort_at must be None or >= 0, got {self.abort_at}")
        _check(self.temperature >= 0, f"{where}: temperature must be >= 0, got {self.temperature}")
