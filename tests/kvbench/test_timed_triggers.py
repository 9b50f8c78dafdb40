"""A preemption that did not happen is a failed proof on an engine kvbench steps (the same workload preempts
every time), and undecided, saying why, on one it reaches over HTTP (whether a pool runs dry depended on how the
requests' arrivals overlapped): :func:`kvbench.conformance.prove.prove` and ``timed_trigger_missed``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbench.conformance.prove import prove, timed_trigger_missed
from kvbench.conformance.verdict import Undecided
from kvbench.core.requests import GenResult


def _engine(steppable: bool) -> SimpleNamespace:
    return SimpleNamespace(name="e", steppable=steppable)


def _result(**counters: float) -> GenResult:
    return GenResult([], counters)


def test_no_preemption_fails_on_a_stepped_engine_and_is_undecided_over_http():
    with pytest.raises(AssertionError, match="recompute preemption did not happen on e"):
        prove(_result(preemptions_recompute=0), _engine(True), "preemptions_recompute", "recompute preemption")
    with pytest.raises(Undecided, match="arrivals overlapped"):
        prove(_result(preemptions_recompute=0), _engine(False), "preemptions_recompute", "recompute preemption")
    assert prove(_result(preemptions_recompute=2), _engine(False), "preemptions_recompute", "x") == 2


def test_a_trigger_that_does_not_depend_on_timing_still_fails_over_http():
    """Prefix hits or chunks do not wait on arrivals: zero of them fails wherever the engine runs."""
    with pytest.raises(AssertionError, match="prefix-cache hit did not happen"):
        prove(_result(prefix_cache_hits=0), _engine(False), "prefix_cache_hits", "a prefix-cache hit")


def test_timed_trigger_missed_returns_on_a_stepped_engine():
    timed_trigger_missed(_engine(True), "nothing preempted")  # the caller's claim decides
    with pytest.raises(Undecided, match="nothing preempted in this run"):
        timed_trigger_missed(_engine(False), "nothing preempted")


def test_a_pressured_run_that_did_not_preempt_is_served_again_over_http_only():
    """Over HTTP a run whose timed trigger stayed at zero is tried again, up to TIMED_TRIES, and the first that
    preempted is the result; on a stepped engine, or for a trigger that does not depend on timing, one run; a run
    whose own claim failed is never tried again."""
    from kvbench.conformance.prove import TIMED_TRIES, until_triggered
    from kvbench.conformance.verdict import claim
    from kvbench.core.evidence import collecting, evidence_of

    def runs(*counts: int):
        made: list[int] = []

        def attempt() -> GenResult:
            made.append(1)
            return _result(preemptions_recompute=counts[len(made) - 1])
        return attempt, made

    attempt, made = runs(0, 0, 3)
    properties: list = []
    with collecting(properties):
        assert until_triggered(_engine(False), "preemptions_recompute", attempt).counters["preemptions_recompute"] == 3
    assert len(made) == 3 and evidence_of(properties)["pressured_tries"] == 3
    attempt, made = runs(*[0] * TIMED_TRIES)
    assert until_triggered(_engine(False), "preemptions_recompute", attempt).counters["preemptions_recompute"] == 0
    assert len(made) == TIMED_TRIES
    for engine, counter in ((_engine(True), "preemptions_recompute"), (_engine(False), "prefix_cache_hits")):
        attempt, made = runs(0, 0, 0)
        until_triggered(engine, counter, attempt)
        assert len(made) == 1

    hidden: list[int] = []

    def uncounted() -> GenResult:  # an engine that counts no preemption cannot show one: one run
        hidden.append(1)
        return _result()

    until_triggered(_engine(False), ("preemptions_recompute", "preemptions_swap"), uncounted)
    assert len(hidden) == 1
    attempt, made = runs(0, 2)
    until_triggered(_engine(False), ("preemptions_swap", "preemptions_recompute"), attempt)
    assert len(made) == 2  # several counters: any of them moving ends the tries

    tries: list[int] = []

    def wrong() -> GenResult:
        tries.append(1)
        claim(False, "outputs differ")
        return _result()

    with pytest.raises(AssertionError, match="outputs differ"):
        until_triggered(_engine(False), "preemptions_recompute", wrong)
    assert len(tries) == 1
