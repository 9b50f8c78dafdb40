"""The storm benchmarks: one test per scenario (docs/benchmarks.md#scenarios), on every ``--engine`` that can run it.

Each test serves its scenario (sizes from ``--benchmark-scale``), records every run into the
session's results (the report, the baseline gate), then asserts that the scenario did what it
claims: the storm preempted, the surge filled the pool, the crossover holds both modes... never a
time. What each scenario serves and claims is in :mod:`kvbench.bench.scenarios`; the fixtures (model,
threads, progress bar, de-duplication of equivalent engines) in this folder's ``conftest.py``.

A claim that cannot be decided says which way it stayed open (:mod:`kvbench.bench.scenarios.claims`):
the engine does not expose what it needs, its counter did not move, or the workload did not reach the
pressure it was built for on this engine (never a failure: that is the workload's doing). A benchmark
whose every claim is undecided is skipped with each claim's reason after its runs are recorded: it
proved nothing, so it must not read as passed. Every skip, this one or the engine's (a capability or a
knob it lacks), is listed in results.json's ``skipped_scenarios`` with its reason, for the report.

Run with ``pytest suites/benchmarks --benchmark``; without ``--benchmark`` every test here is skipped.
"""

from __future__ import annotations

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.scenarios.claims import undecided_summary

pytestmark = pytest.mark.benchmark


@pytest.fixture
def storm(run_storm, storm_scheduler, engine_spec, kvbench_results):
    """``run_storm`` (serve, record, assert no claim failed), then skip if no claim could be decided; every skip
    recorded in the results with its reason."""

    def skipped(scenario: sc.Scenario, reason: str) -> None:
        engine = storm_scheduler.adapter(engine_spec).describe()
        kvbench_results.add_skipped_scenario(scenario.name, engine, reason)

    def run(scenario: sc.Scenario) -> sc.Outcome:
        try:
            outcome = run_storm(scenario)
        except pytest.skip.Exception as e:  # the engine cannot run it (a capability, a knob): said in the results
            skipped(scenario, str(e.msg or "skipped"))
            raise
        reason = undecided_summary(outcome)
        if reason:
            skipped(scenario, reason)
            pytest.skip(reason)
        return outcome

    return run


def test_evening_surge(storm):
    """Steady short traffic, then a wave of long-context requests fills the pool."""
    storm(sc.EVENING_SURGE)


def test_flash_crowd(storm):
    """Traffic doubles within a minute; concurrency just over capacity."""
    storm(sc.FLASH_CROWD)


def test_preemption_storm(storm):
    """Concurrency swept past capacity; the knee, and the recompute waste beyond it."""
    storm(sc.PREEMPTION_STORM)


def test_swap_vs_recompute_crossover(storm):
    """Preempt-and-resume cost by sequence length, swap and recompute side by side."""
    storm(sc.SWAP_VS_RECOMPUTE)


def test_prefix_caching_and_recompute(storm):
    """A shared system prompt; recomputed tokens with and without prefix caching."""
    storm(sc.PREFIX_CACHING)


def test_chunked_prefill_decode_stalls(storm):
    """TBT spikes of long prefills, unchunked vs chunked at two budgets."""
    storm(sc.CHUNKED_PREFILL)


def test_priority_online_beside_offline(storm):
    """High-priority online traffic beside offline batch work, priority policy vs FCFS."""
    storm(sc.PRIORITY)


def test_swap_space_exhaustion(storm):
    """A host pool too small; the moment swap falls back to recompute."""
    storm(sc.SWAP_EXHAUSTION)


def test_preemption_policies(storm):
    """Static configuration vs preemption_mode=auto vs admission control, side by side."""
    storm(sc.PREEMPTION_POLICIES)
