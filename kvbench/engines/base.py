"""The one small protocol every engine adapter implements.

An adapter wraps one engine (in-process or remote) and offers two things:

* ``generate(requests, knobs)``: batch generation for conformance checks. All requests are
  submitted before the engine runs; the result carries the outputs and whatever counters the
  engine exposes (preemptions by mode, swap-ins, prefix hits, prefill chunks...), so a check can
  prove that the mechanism it is about actually fired.
* ``serve(workload, recorder, knobs)``: timed serving for benchmarks. Requests are released at
  their arrival times on the wall clock and the adapter reports what happened to a
  :class:`kvbench.trace.TraceRecorder`.

Pressure is forced through :class:`Knobs`, kvbench's engine-neutral names for the levers every
paged-KV engine has. Each adapter maps them onto its own configuration and lists the knobs it
cannot map in ``unsupported_knobs`` so that checks can skip with that reason.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.trace import TraceRecorder
    from kvbench.workloads import WorkloadRequest

#: Capabilities an adapter may declare. A check needing one the engine lacks is skipped.
CAPABILITIES = frozenset(
    {
        "recompute",  # can preempt by discarding KV and recomputing it
        "swap",  # can preempt by copying KV to host memory
        "prefix_caching",  # reuses KV of shared prompt prefixes
        "chunked_prefill",  # splits a prefill across steps under a token budget
        "priority",  # honours per-request priorities
        "block_introspection",  # exposes its block manager to the stateful refcount machine
        "events",  # reports preemptions/swaps/hits as they happen
        "sampling",  # seeded temperature sampling
        "abort",  # can abort a request in flight
    }
)


@dataclass(frozen=True)
class Knobs:
    """Engine-neutral configuration. ``None`` means "the engine's default".

    Fields follow vLLM's names. ``num_gpu_blocks`` is the size of the device KV pool in blocks,
    ``num_cpu_blocks`` the host (swap / offload) pool in blocks.
    """

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    preemption_mode: str | None = None  # "recompute" | "swap"
    scheduling_policy: str | None = None  # "fcfs" | "priority"

    def merged(self, other: Knobs) -> Knobs:
        """``other``'s non-None fields win over ours."""
        updates = {f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        return replace(self, **updates)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


#: "Every knob at the engine's default", shared as the default argument of adapter methods.
DEFAULT_KNOBS = Knobs()


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


@dataclass
class GenOutput:
    """What one request produced. ``num_preemptions`` is None if the engine cannot tell."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "length" | "stop" | "abort" | "rejected" | "error"
    num_preemptions: int | None = None
    error: str | None = None  # why a request was rejected or failed, in the engine's words


@dataclass
class GenResult:
    """Outputs in request order, plus the engine's counters after the run.

    ``counters`` uses these names where the engine can tell (absent keys mean "not exposed"):
    ``preemptions_recompute``, ``preemptions_swap``, ``swap_outs``, ``swap_ins``, ``swap_fallbacks``,
    ``prefix_cache_queries``, ``prefix_cache_hits`` (tokens), ``prefill_chunks``,
    ``recomputed_tokens``, ``computed_tokens``, ``swapped_out_bytes``, ``swapped_in_bytes``,
    ``leaked_blocks`` (device blocks still held after everything finished).
    ``evidence`` lists free-text lines (log lines, event summaries) a check may quote.
    """

    outputs: list[GenOutput]
    counters: dict[str, int | float] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)


class EngineAdapter(abc.ABC):
    """Base class of engine adapters. Subclasses set ``kind``, ``capabilities``, ``option_keys``."""

    #: the kind named on the command line, e.g. "reference", "hf", "hf-cb"
    kind: str = ""
    #: what this engine can do (subset of CAPABILITIES)
    capabilities: frozenset[str] = frozenset()
    #: option keys accepted in ``--engine kind:key=value`` with a one-line help each
    option_keys: dict[str, str] = {}  # noqa: RUF012 - read-only class-level table
    #: Knobs fields this adapter cannot map, with the reason
    unsupported_knobs: dict[str, str] = {}  # noqa: RUF012

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        """Raises ValueError naming any option not in ``option_keys``."""
        self.model_dir = model_dir
        self.options = dict(options or {})
        self.name = name or self.kind
        unknown = set(self.options) - set(self.option_keys)
        if unknown:
            raise ValueError(f"engine {self.kind!r}: unknown option(s) {sorted(unknown)}; "
                             f"allowed: {sorted(self.option_keys)}")

    def describe(self) -> dict[str, Any]:
        """Engine identity and configuration for results files."""
        return {"name": self.name, "kind": self.kind, "options": dict(self.options),
                "capabilities": sorted(self.capabilities)}

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """Run all requests to completion (all submitted before the engine steps)."""

    def serve(self, workload: Sequence[WorkloadRequest], recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS) -> None:
        """Serve a timed workload, reporting to ``recorder``. Default: not supported."""
        raise NotImplementedError(f"engine {self.kind!r} does not support timed serving")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, servers, device memory)."""
