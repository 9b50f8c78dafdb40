"""Structured engine events: what happened to which request, when, and what it cost.

Kinds and their ``data``:

=================  ===================================================================
``admitted``       ``cached_tokens`` (prefix hit), ``resumed`` (True after a recompute)
``preempted``      ``mode`` ("recompute" | "swap"), ``blocks``, ``tokens_discarded`` (recompute)
                   or ``bytes`` (swap)
``swap_fallback``  ``blocks``, ``free_cpu_blocks``: swap wanted but the host pool was full,
                   so the victim was recomputed instead
``swapped_out``    ``blocks``, ``bytes``, ``seconds`` (the batched copy of that step)
``swapped_in``     ``blocks``, ``bytes``, ``seconds``
``prefix_hit``     ``tokens``: KV reused from the prefix cache at admission
``finished``       ``reason`` ("length" | "stop"), ``output_tokens``
``aborted``        ``state`` the request was in
``rejected``       ``reason``: refused at ``add_request``
=================  ===================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineEvent:
    kind: str
    request_id: str
    step: int
    time: float
    data: dict[str, Any] = field(default_factory=dict)
