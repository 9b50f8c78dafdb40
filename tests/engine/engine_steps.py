"""Helpers the engine's tests share: run an engine until it is idle, read an engine core's batches off its pipe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def finished_outputs(engine: Any) -> dict[str, Any]:
    """Step ``engine`` until idle; the final output of every request that finished, by request id."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                final[out.request_id] = out
    return final


def core_batches(conn: Any, done: Callable[[set[str]], bool], timeout: float = 60.0) -> list[tuple]:
    """The raw batches an engine core (``reference_engine.serve.engine_process``) sends on ``conn`` until
    ``done(finished request ids)`` holds; fails the test if the core is silent for ``timeout`` seconds."""
    batches: list[tuple] = []
    finished: set[str] = set()
    while not done(finished):
        assert conn.poll(timeout), f"the engine core sent nothing for {timeout:.0f} s"
        batch = conn.recv()
        batches.append(batch)
        finished |= {delta[0] for delta in batch[4] if delta[2]}
    return batches
