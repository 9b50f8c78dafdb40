"""Engine events as kvbench sees them: what happened to which request, in order.

An adapter whose engine reports events translates them into :class:`EventRecord` s with the
kinds and data keys below and hands them over in :attr:`kvbench.core.requests.GenResult.events`
(``None`` there means "this engine reports no events": checks that need them skip saying so).
A data key the engine cannot fill is left out, never guessed.

=================  =======================================================================
kind               data
=================  =======================================================================
``admitted``       ``cached_tokens`` (tokens served by the prefix cache at this admission),
                   ``resumed`` (True when re-admitted after a recompute preemption),
                   ``kv_usage`` (fraction of the device pool in use right after this admission,
                   its own blocks included), ``num_running`` (requests already running that it joined)
``preempted``      ``mode`` ("recompute" | "swap"), ``wanted`` (the mode the engine's policy chose
                   for this victim before the host pool was consulted: "swap" with mode
                   "recompute" is a swap fallback), ``tokens_discarded`` (recompute: tokens of
                   KV thrown away), ``running`` (ids of the requests running at that moment,
                   in admission order, oldest first, the victim included)
``swapped_out``    ``bytes``
``swapped_in``     ``bytes``
``finished``       ``reason``
``aborted``        ``state`` (what the request was doing when it was aborted)
=================  =======================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EVENT_KINDS = ("admitted", "preempted", "swapped_out", "swapped_in", "finished", "aborted")


@dataclass(frozen=True)
class EventRecord:
    """One engine event. ``step`` is the engine step it happened in (None if unknown)."""

    kind: str
    request_id: str
    step: int | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PreemptionRecord:
    """One preemption, the ``order``-th of the run (0-based).

    ``running``: the requests running when the victim was chosen, oldest admission first, the
    victim included; None when the engine does not say.
    """

    request_id: str
    order: int
    mode: str
    step: int | None = None
    running: tuple[str, ...] | None = None
    tokens_discarded: int | None = None


def preemption_records(events: Iterable[EventRecord]) -> list[PreemptionRecord]:
    """Every ``preempted`` event as a :class:`PreemptionRecord`, in the order they happened."""
    out: list[PreemptionRecord] = []
    for e in events:
        if e.kind != "preempted":
            continue
        running = e.data.get("running")
        out.append(PreemptionRecord(e.request_id, len(out), str(e.data.get("mode")), e.step,
                                    tuple(running) if running is not None else None, e.data.get("tokens_discarded")))
    return out
