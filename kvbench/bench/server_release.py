"""Servers a benchmark session no longer needs are stopped as soon as it knows, not at its end.

A benchmark session serves each scenario once, on every engine of it together, in the first of its tests to
run (:class:`suites.benchmarks.conftest.StormScheduler`, the head-to-head alike); the other engines' tests of
that scenario only record what was served. pytest runs an engine's tests one after another (the engine is a
session-scoped parameter), so with two ``server:`` engines every scenario is served during the first
engine's tests, and the second engine's servers, kept for reuse up to its ``keep_servers``, would idle to the
end of the run beside the first's: ten servers on a 2-core machine.

The rule (:func:`engines_needed`): after each test, an engine is still needed when a later test of the session
is one whose scenario has not been served yet and is selected on that engine (some test of the same test
function runs on it), or is that engine's own test of an unserved scenario. Every other engine that kvbench
started servers for has them stopped (:meth:`stop_server <kvbench.engines.http.server.ServerAdapter.stop_server>`,
each with its process group); the adapter stays usable, and a later call it did not foresee (a test selected
after its scenario was served) starts a server again rather than failing. Within a scenario the adapter
itself keeps at most ``keep_servers`` running (it stops the least recently used after each start).

A scenario counts as served once the scheduler served it, or once any of its tests ran to a pass or a failure
(a head-to-head is served by its first test that is not skipped). A test skipped before serving (the engine
lacks a capability) leaves its scenario unserved: the next engine's test serves it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Planned:
    """A test of the session as this module sees it: ``function`` (its node id without the parameters, one
    per scenario test), ``engine`` (its ``--engine`` spec name, None for a test of no engine)."""

    function: str
    engine: str | None


def function_of(nodeid: str) -> str:
    """The test function of a node id: ``path::test_x[engine]`` -> ``path::test_x``."""
    return nodeid.split("[", 1)[0]


def engines_needed(later: Iterable[Planned], served: Collection[str]) -> set[str]:
    """The engines some test in ``later`` may still serve on: for each test of a function not in ``served``,
    its own engine and every engine that function has a test on (the engines its first test serves)."""
    later = list(later)
    per_function: dict[str, set[str]] = {}
    for t in later:
        if t.engine is not None:
            per_function.setdefault(t.function, set()).add(t.engine)
    needed: set[str] = set()
    for t in later:
        if t.function not in served:
            needed |= per_function.get(t.function, set())
    return needed


class ServerRelease:
    """Stops, after each benchmark test, the servers of every engine no later test needs (module docstring).
    ``adapters``: engine spec name -> adapter, as the session's scheduler made them; ``plan``: every test of
    the session, in run order."""

    def __init__(self, plan: list[tuple[str, Planned]]):
        self.plan = plan  # (node id, what it is), in run order
        self.served: set[str] = set()
        self.stopped: set[str] = set()

    def mark_served(self, nodeid: str) -> None:
        """The scenario of ``nodeid``'s test function has been served (on every engine it runs on)."""
        self.served.add(function_of(nodeid))

    def after(self, nodeid: str, adapters: Mapping[str, Any]) -> list[str]:
        """After the test ``nodeid``: stop the servers of each adapter whose engine no later test needs; returns
        the engines stopped now (each once: a stopped adapter that serves again is stopped again later)."""
        ids = [n for n, _ in self.plan]
        later = [p for _, p in self.plan[ids.index(nodeid) + 1:]] if nodeid in ids else []
        needed = engines_needed(later, self.served)
        stopped = []
        for name, adapter in adapters.items():
            if name in needed:
                continue
            stop = getattr(adapter, "stop_server", None)
            if stop is None or not _anything_up(adapter):
                continue  # an engine in process, or one with nothing running: nothing to stop
            stop()
            stopped.append(name)
            self.stopped.add(name)
        return stopped


def _anything_up(adapter: Any) -> bool:
    """Whether ``adapter`` runs a server or is starting one (``running_servers``, ``live_launches``)."""
    running = getattr(adapter, "running_servers", None)
    live = getattr(adapter, "live_launches", None)
    return bool((running is not None and running()) or (live is not None and live()))
