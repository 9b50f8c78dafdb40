"""EngineCounters: the engine's cumulative counters, one field per fact.

This is the project-wide counter record: its field names are the names of kvbench's counter contract
(``kvbench.core.counters``), each field's docstring is its one meaning, and every reader takes the fields
by name: ``engine.counters()`` in process, ``reference_engine:<name>_total`` on the server's ``/metrics``
(:mod:`reference_engine.serve.prometheus` loops over the fields). A name means the same thing everywhere
it appears. Every field starts at 0 and only grows. Each is incremented in exactly one place, where the
fact happens:

==========================  ===================  ==========================================
fields                      incremented by       when
==========================  ===================  ==========================================
preemptions_*, swap_outs,   Scheduler            while scheduling a step
swap_ins, swap_fallbacks,
prefill_chunks, steps
computed_tokens,            Scheduler.update     after the model ran
recomputed_tokens,
generated_tokens
prefix_cache_*              BlockManager         when the scheduler admits a request
aborts                      Scheduler.abort      when a client aborts an unfinished request
evicted_blocks              BlockPool            when a cached block is handed out again
swapped_*_bytes,            LLMEngine            after the step's swap copies
swap_seconds
==========================  ===================  ==========================================

Events (:mod:`reference_engine.events`) add up to these: one ``preempted`` event per preemption
with its mode, one ``swap_fallback``, ``swapped_out`` and ``swapped_in`` per request each, whose
``bytes`` sum to the byte counters, ``prefix_hit`` events whose ``tokens`` sum to
``prefix_cache_hits``, and one ``aborted`` event per abort.

Constructible without a model and importing nothing of the project, so every part may hold the record.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Cumulative counters of one engine since it was built (see the module docstring)."""

    preemptions_recompute: int = 0
    """Preemption events that discarded the victim's KV (requests may be counted more than once),
    including swap fallbacks."""
    preemptions_swap: int = 0
    """Preemption events that moved the victim's KV to the host pool."""

    swap_outs: int = 0
    """Requests swapped out to the host pool (equals ``preemptions_swap``: every swap-out is one)."""
    swap_ins: int = 0
    """Requests swapped back in from the host pool."""
    swap_fallbacks: int = 0
    """Swap preemptions wanted while the host pool was too full, so recomputed instead (each is also
    one of ``preemptions_recompute``)."""
    swapped_out_bytes: int = 0
    """Bytes of KV copied device -> host."""
    swapped_in_bytes: int = 0
    """Bytes of KV copied host -> device."""
    swap_seconds: float = 0.0
    """Wall-clock seconds spent in the swap copies, both directions."""

    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache: the request's whole sequence at each admission (its prompt,
    plus the tokens it generated before a recompute preemption when it is admitted again), as vLLM v1
    counts them; once per admission however often the lookup was retried. Counted with prefix caching
    off too (then with 0 hits)."""
    prefix_cache_hits: int = 0
    """Tokens whose KV was served from the prefix cache at admission (a multiple of the block size)."""

    prefill_chunks: int = 0
    """Scheduled chunks that ended before the end of the request's sequence (prompt, plus the
    generated tokens being recomputed after a recompute preemption), so sampled no token. A prefill
    done in k pieces adds k - 1; one done in a single piece, and every decode, adds 0. A chunk is
    counted when its step is scheduled (chunks dropped by a preemption in the same step are not)."""

    computed_tokens: int = 0
    """Tokens whose KV the model computed (prefill and decode positions; prefix hits excluded)."""
    recomputed_tokens: int = 0
    """Of ``computed_tokens``, positions computed again because a recompute preemption discarded
    them (positions below the request's highest computed position). Positions restored from the
    prefix cache are not computed, so not counted."""
    generated_tokens: int = 0
    """Output tokens sampled (including those of requests later aborted)."""

    aborts: int = 0
    """Requests aborted on the client's request while in flight (unfinished: waiting, running or
    swapped); aborting a finished or unknown request counts nothing."""

    evicted_blocks: int = 0
    """Cached device blocks whose prefix-cache entry was dropped because the block was handed out again."""
    steps: int = 0
    """Scheduler steps taken (``schedule()`` calls, empty ones included)."""

    @property
    def preemptions(self) -> int:
        """Preemption events of either mode."""
        return self.preemptions_recompute + self.preemptions_swap

    def snapshot(self) -> EngineCounters:
        """An independent copy: later increments of this record do not change it."""
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int | float]:
        """Field name -> value, the names of the contract."""
        return dataclasses.asdict(self)


@functools.cache
def field_docs() -> dict[str, str]:
    """Field name -> its docstring on one line (the meaning ``/metrics`` gives as help text).

    Python keeps no attribute docstrings at run time, so they are read from this module's source."""
    tree = ast.parse(inspect.getsource(EngineCounters))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
