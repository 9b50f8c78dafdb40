"""Structured engine events: what happened to which request, when, and what it cost.

Kinds and their ``data``:

=================  ===================================================================
``admitted``       ``cached_tokens`` (prefix hit), ``resumed`` (True after a recompute),
                   ``kv_usage`` (fraction of the device pool in use right after this admission),
                   ``num_running`` (requests already running that it joined)
``preempted``      ``mode`` ("recompute" | "swap"), ``wanted`` (the mode the policy chose before
                   the host pool was consulted: "swap" with mode "recompute" is a fallback),
                   ``blocks``, ``tokens_discarded`` (recompute only: the computed tokens whose
                   KV was dropped); a swap's bytes are in its ``swapped_out`` event. Under
                   ``preemption_mode="auto"`` also the decision: ``why`` (a name of
                   :class:`~reference_engine.policies.preemption.Why`, lower case: what code
                   reads), ``reason`` (the same in words), ``estimated_swap_s``,
                   ``estimated_recompute_s``
``swap_fallback``  ``blocks``, ``free_cpu_blocks``: swap wanted but the host pool was full,
                   so the victim was recomputed instead
``swapped_out``    ``blocks``, ``bytes``, ``seconds`` (of the step's whole batched copy) and
                   ``requests`` (how many requests shared that copy)
``swapped_in``     ``blocks``, ``bytes``, ``seconds``, ``requests``
``prefix_hit``     ``tokens``: KV reused from the prefix cache at admission
``finished``       ``reason`` ("length" | "stop"), ``output_tokens``
``aborted``        ``state`` the request was in
``rejected``       ``reason``: refused at ``add_request``
=================  ===================================================================

Bounded: an :class:`EventLog` keeps only the latest ``max_events`` (a server runs for days), and
hands every event, as it is recorded, to the sinks added with :meth:`EventLog.add_sink`. A consumer
that needs every event takes them from a sink, not by re-reading the log.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

DEFAULT_MAX_EVENTS = 10_000  # EngineConfig.max_events' default: a few thousand requests' worth


@dataclass(frozen=True)
class EngineEvent:
    kind: str
    request_id: str
    step: int
    time: float
    data: dict[str, Any] = field(default_factory=dict)


EventSink = Callable[[EngineEvent], None]


class EventLog:
    """The latest ``max_events`` events, oldest first, plus sinks that receive every event.

    Reads like a list of the retained events: ``len``, iteration, ``log[i]`` and ``log[a:b]``
    (indices count retained events, so once the log is full an index no longer names the same
    event from one step to the next: follow new events with a sink, or with :meth:`since`).
    ``num_recorded`` counts every event ever recorded, ``num_dropped`` those no longer retained.
    """

    def __init__(self, max_events: int):
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 0:
            raise ValueError(f"max_events={max_events!r} is invalid: expected an integer >= 0")
        self.max_events = max_events
        self._events: deque[EngineEvent] = deque(maxlen=max_events)
        self._sinks: list[EventSink] = []
        self.num_recorded = 0

    def append(self, event: EngineEvent) -> None:
        """Retain ``event`` (dropping the oldest when full) and hand it to every sink, in the order
        they were added. A sink that raises propagates to the caller, mid-step: sinks must not raise."""
        self._events.append(event)
        self.num_recorded += 1
        for sink in self._sinks:
            sink(event)

    def add_sink(self, sink: EventSink) -> None:
        """Call ``sink(event)`` for every event recorded from now on."""
        if not callable(sink):
            raise TypeError(f"event sink {sink!r} is not callable")
        self._sinks.append(sink)

    def remove_sink(self, sink: EventSink) -> None:
        """Stop calling ``sink``; ValueError if it was never added."""
        self._sinks.remove(sink)

    @property
    def num_dropped(self) -> int:
        return self.num_recorded - len(self._events)

    def since(self, position: int) -> tuple[list[EngineEvent], int]:
        """Retained events recorded after the first ``position`` ones, and the position to pass next
        time (``num_recorded``). Events dropped in between are missing: size ``max_events`` above
        what one reader lets accumulate, or use a sink."""
        skip = max(position - self.num_dropped, 0)
        return list(itertools.islice(self._events, skip, None)), self.num_recorded

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[EngineEvent]:
        return iter(self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    @overload
    def __getitem__(self, index: int) -> EngineEvent: ...

    @overload
    def __getitem__(self, index: slice) -> list[EngineEvent]: ...

    def __getitem__(self, index: int | slice) -> EngineEvent | list[EngineEvent]:
        if isinstance(index, slice):
            return list(self._events)[index]
        return self._events[index]

    def __repr__(self) -> str:
        return (f"EventLog({len(self._events)} of max_events={self.max_events} retained, "
                f"{self.num_recorded} recorded, {len(self._sinks)} sinks)")
