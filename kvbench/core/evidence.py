"""Evidence a check gathers while it runs, handed to whoever records the test (the pytest plugin).

Two kinds of fact reach a test's record from code that has no handle on the test:

* the counters :func:`kvbench.conformance.prove.prove` saw (``record_evidence``), and
* the engine options a check's knobs overrode (``record_knob_overrides``, called by the adapters
  :func:`kvbench.engines.registry.make_adapter` builds).

The plugin opens a :func:`collecting` block around each test. The active collector lives in a
:class:`contextvars.ContextVar`, the standard way to scope "the current thing" without threading it
through every call: outside a block (a script, the CLI) recording is a no-op. Evidence goes into the
test item's ``user_properties`` as ``("kvbench.evidence.<counter>", value)``, so ``--junitxml``
carries it as properties and pytest-xdist ships it to the controller with each report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

#: prefix of the ``user_properties`` names that carry counters a check proved
EVIDENCE_PREFIX = "kvbench.evidence."
#: the ``user_properties`` name of each mechanism a check proved fired (one entry per mechanism)
PROVEN_PROPERTY = "kvbench.proven"


@dataclass
class EvidenceCollector:
    """What one test gathered: ``properties`` is the test item's ``user_properties`` list (shared, not a
    copy); ``knob_overrides`` maps a knob to ``[option value given, value(s) used]``."""

    properties: list[tuple[str, Any]]
    knob_overrides: dict[str, list[Any]] = field(default_factory=dict)


_active: ContextVar[EvidenceCollector | None] = ContextVar("kvbench_evidence", default=None)


@contextlib.contextmanager
def collecting(properties: list[tuple[str, Any]]) -> Iterator[EvidenceCollector]:
    """Collect evidence into ``properties`` (a test item's ``user_properties``) until the block ends."""
    collector = EvidenceCollector(properties)
    token = _active.set(collector)
    try:
        yield collector
    finally:
        _active.reset(token)


def record_evidence(counter: str, value: Any) -> None:
    """Record that a check saw ``counter`` = ``value`` (a later value of the same counter is kept too)."""
    collector = _active.get()
    if collector is not None:
        collector.properties.append((EVIDENCE_PREFIX + counter, value))


def recorded(counter: str) -> list[Any]:
    """The values recorded for ``counter`` in the running test so far, oldest first (empty outside a block)."""
    collector = _active.get()
    if collector is None:
        return []
    return [value for name, value in collector.properties if name == EVIDENCE_PREFIX + counter]


def record_proven(mechanism: str) -> None:
    """Record that the running check proved ``mechanism`` fired (``kvbench.conformance.verdict.record_proof``)."""
    collector = _active.get()
    if collector is not None and (PROVEN_PROPERTY, mechanism) not in collector.properties:
        collector.properties.append((PROVEN_PROPERTY, mechanism))


def proven_of(properties: list[tuple[str, Any]]) -> list[str]:
    """The mechanisms a check proved fired, from its ``user_properties``."""
    return [value for name, value in properties if name == PROVEN_PROPERTY]


def record_knob_overrides(overrides: Mapping[str, tuple[Any, Any]]) -> None:
    """Record ``{knob: (option value given, knob value used)}``; several values used by one test are
    kept in the order first seen, as a list in place of the single value."""
    collector = _active.get()
    if collector is None:
        return
    for knob, (given, used) in overrides.items():
        entry = collector.knob_overrides.setdefault(knob, [given, used])
        if entry[1] == used or (isinstance(entry[1], list) and used in entry[1]):
            continue
        entry[1] = [*entry[1], used] if isinstance(entry[1], list) else [entry[1], used]


def evidence_of(properties: list[tuple[str, Any]]) -> dict[str, Any]:
    """``{counter: value}`` from ``user_properties`` (the last value recorded for each counter)."""
    return {name.removeprefix(EVIDENCE_PREFIX): value for name, value in properties
            if isinstance(name, str) and name.startswith(EVIDENCE_PREFIX)}
