"""How a conformance check ends: passed, failed, undecided, or failed the one way a pin expects.

A check compares outputs first and only then asks whether its mechanism fired, so that a wrong answer
fails whatever the engine can prove. Three calls settle the rest:

* :func:`claim` is an assertion a pin can excuse. An expected failure
  (:mod:`kvbench.conformance.expectations`) excuses the one assertion whose message it matches: that
  failure is recorded and the check goes on, so every later assertion still runs and can fail. A plain
  ``assert`` that a pin matches still ends the check (the older, coarser form).
* :func:`undecided` ends a check that could not decide: its mechanism cannot be proven from what the
  engine exposes, or an inference is ambiguous. It is a skip whose reason starts with ``Undecided:``,
  recorded with outcome ``"undecided"``, never counted as passed.
* :func:`record_proof` notes that the check's mechanism was proven to fire (``prove()`` calls it, and so
  does any black-box proof), so the run can tell a pressured check that proved something from one that
  merely did not fail: a run is green only when some check passed with its mechanism proven.

The pin in force is the running test's, set by the plugin around each call (:func:`pinned`); outside a
test, or without ``--kvbench-expectations``, :func:`claim` is a plain assertion.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pytest

from kvbench.core.evidence import record_evidence, record_proven

#: how an undecided verdict's skip reason begins (the exception's name, as pytest prints a skip)
UNDECIDED_PREFIX = "Undecided: "


class Undecided(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A check that could not decide. A skip to pytest, printed ``Undecided: <reason>``; ``undecided`` in
    kvbench's records."""

    # as pytest's own outcomes do, so that its reports print "Undecided: why", not the module path
    __module__ = "builtins"

    def __init__(self, reason: str):
        super().__init__(reason, allow_module_level=False)


def undecided(reason: str) -> NoReturn:
    """End the running check as undecided, saying why (``reason``: what could not be proven or inferred)."""
    raise Undecided(reason)


def is_undecided(reason: str | None) -> bool:
    """Whether a skip's reason marks it as an undecided verdict."""
    return bool(reason) and reason.startswith(UNDECIDED_PREFIX)


@dataclass
class PinScope:
    """The expected failure in force for one test call, and the claims it excused."""

    expectation: Any  # kvbench.conformance.expectations.Expectation
    excused: list[str] = field(default_factory=list)


_SCOPE: contextvars.ContextVar[PinScope | None] = contextvars.ContextVar("kvbench_pin", default=None)


@contextlib.contextmanager
def pinned(expectation: Any) -> Iterator[PinScope]:
    """Run a test call with ``expectation`` (or None) as its pin; yields the scope the call fills."""
    scope = PinScope(expectation)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def failure_message(message: str) -> str:
    """A claim's message as a pin's ``match`` sees it: the form pytest prints an assertion's E line in."""
    return f"AssertionError: {message}"


def claim(condition: Any, message: str) -> None:
    """Assert ``condition``; on failure, fail with ``message`` unless the running check's pin matches it, in
    which case the failure is recorded as the expected one and the check goes on."""
    if condition:
        return
    scope = _SCOPE.get()
    expectation = scope.expectation if scope is not None else None
    if expectation is not None and expectation.matches_failure(failure_message(message)):
        scope.excused.append(message)
        return
    raise AssertionError(message)


def record_proof(mechanism: str, value: Any = True) -> None:
    """Note that the running check proved ``mechanism`` fired, with ``value`` as its evidence; a check
    that passes having proved something is what makes a run green (*decided means proven*)."""
    record_evidence(mechanism, value)
    record_proven(mechanism)
