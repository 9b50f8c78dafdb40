"""Per-request state, kept as explicit counters.

The scheduler's single rule is that ``num_computed_tokens`` catches up with ``num_tokens``
(prompt + generated). A fresh request, a chunked prefill, a prefix-cache hit and a
recompute after preemption are all just different starting values of ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from reference_engine.sampling_params import SamplingParams, TokenLogprobs


class RequestRejected(ValueError):
    """``add_request`` refused a request; the engine and every other request are untouched. (Here, not in
    ``engine``, so the HTTP server can catch it without importing torch.)"""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_LENGTH = "length"
    FINISHED_STOP = "stop"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    # mixed into the hash of the first block (vLLM's cache_salt): requests share cached prefixes only with
    # requests of the same salt, so a client can keep runs apart on one server
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Highest num_computed_tokens ever reached: tokens computed again below it are recompute waste.
    max_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit of the latest admission
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # summed over admissions
    admitted_seq: int = -1  # increases with every admission: the FCFS victim is the largest
    # One entry per output token when sampling_params.logprobs is set (appended where the token is sampled).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def priority_key(self) -> tuple[int, float]:
        """Lower sorts first: more important, then earlier."""
        return (self.priority, self.arrival_time)
