"""The storm benchmarks: one test per scenario of the seeds, on every ``--engine`` that can run it.

Each test serves its scenario (sizes from ``--benchmark-scale``), records every run into the
session's results (the report, the baseline gate), then asserts that the scenario did what it
claims: the storm preempted, the surge filled the pool, the crossover holds both modes... never a
time. What each scenario serves and claims is in :mod:`kvbench.bench.scenarios`; the fixtures (model,
threads, progress bar, de-duplication of equivalent engines) in this folder's ``conftest.py``.

Run with ``pytest suites/benchmarks --benchmark``; without ``--benchmark`` every test here is skipped.
"""

from __future__ import annotations

import pytest

from kvbench.bench import scenarios as sc

pytestmark = pytest.mark.benchmark


def test_evening_surge(run_storm):
    """Seed 000: steady short traffic, then a wave of long-context requests fills the pool."""
    run_storm(sc.EVENING_SURGE)


def test_flash_crowd(run_storm):
    """Seed 001: traffic doubles within a minute; concurrency just over capacity."""
    run_storm(sc.FLASH_CROWD)


def test_preemption_storm(run_storm):
    """Seed 004: concurrency swept past capacity; the knee, and the recompute waste beyond it."""
    run_storm(sc.PREEMPTION_STORM)


def test_swap_vs_recompute_crossover(run_storm):
    """Seeds 000/004: preempt-and-resume cost by sequence length, swap and recompute side by side."""
    run_storm(sc.SWAP_VS_RECOMPUTE)


def test_prefix_caching_and_recompute(run_storm):
    """Seed 004 (3.4): a shared system prompt; recomputed tokens with and without prefix caching."""
    run_storm(sc.PREFIX_CACHING)


def test_chunked_prefill_decode_stalls(run_storm):
    """Seeds 000/004: TBT spikes of long prefills, unchunked vs chunked at two budgets."""
    run_storm(sc.CHUNKED_PREFILL)


def test_priority_online_beside_offline(run_storm):
    """Seed 001: high-priority online traffic beside offline batch work, priority policy vs FCFS."""
    run_storm(sc.PRIORITY)


def test_swap_space_exhaustion(run_storm):
    """Seeds 001/004: a host pool too small; the moment swap falls back to recompute."""
    run_storm(sc.SWAP_EXHAUSTION)
