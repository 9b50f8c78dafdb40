"""The head-to-head benchmark (docs/benchmarks.md#the-head-to-head-scenario): closed-loop throughput and TTFT at
fixed concurrencies on every ``--engine`` of the session, under matched knobs, one test per engine.

    pytest suites/benchmarks --benchmark --engine A --engine B -k head_to_head

The first of its tests to run serves the scenario on every engine whose test is selected (``-k`` and shards
respected; an engine that differs from an earlier one only in its preemption mode is skipped, since nothing is
preempted here): an untimed warm-up each, then interleaved rounds with the engines' order rotating
(:func:`kvbench.bench.scenarios.run_head_to_head`), on the session's one clock
(:mod:`kvbench.bench.clock_rule`). Each test then records its engine's figures per concurrency into the
session's results (results.json and the report, as the storms' are) and asserts its claims: every request got
exactly its output tokens, and its greedy outputs are not wholesale different from the first engine's of its
dtype in float32. A divergence short of that is recorded and shown, not failed. Never a time.

Rounds: the session's ``--benchmark-repeats``, at least 2 (a head-to-head of one round shows no spread).
"""

from __future__ import annotations

import pytest

from kvbench.bench import scenarios as sc
from suites.benchmarks.conftest import skip_reason

pytestmark = pytest.mark.benchmark

#: the outcomes of a session's head-to-head not handed to their test yet, by the session's scheduler
_SERVED: dict[int, dict[str, sc.Outcome | Exception]] = {}


def test_head_to_head(request, storm_scheduler, bench_model, engine_spec, kvbench_session, kvbench_results,
                      pinned_threads):
    """Closed-loop throughput and TTFT at fixed concurrencies, every engine under the same knobs."""
    scenario = sc.HEAD_TO_HEAD
    adapter = storm_scheduler.adapter(engine_spec)
    reason = skip_reason(scenario, adapter, engine_spec, kvbench_session.engine_specs)
    if reason:
        kvbench_results.add_skipped_scenario(scenario.name, adapter.describe(), reason)
        pytest.skip(reason)
    rounds = max(kvbench_session.repeats, 2)
    pending = _SERVED.setdefault(id(storm_scheduler), {})
    if engine_spec.name not in pending:
        specs = storm_scheduler.engines_for(request.node, scenario)
        if engine_spec.name not in {s.name for s in specs}:  # not among the selected (a direct call): alone
            specs = [engine_spec]
        pending.update(sc.run_head_to_head({s.name: storm_scheduler.adapter(s) for s in specs}, bench_model,
                                           kvbench_session.scale, rounds=rounds,
                                           step_seconds=storm_scheduler.clock.step_seconds))
    outcome = pending.pop(engine_spec.name)
    if isinstance(outcome, Exception):
        raise outcome
    outcome.parameters.update({"torch_threads": pinned_threads, "repeats": rounds, "clock": (
        "wall" if outcome.step_seconds is None else f"step ({outcome.step_seconds:g} s per engine step)")})
    kvbench_results.data["clock_rule"] = storm_scheduler.clock.to_dict()
    if outcome.interleaved:
        outcome.parameters["interleaved"] = ", ".join(outcome.interleaved)
    sc.record(outcome, kvbench_results, adapter.describe(), slos=kvbench_session.slos)
    assert not outcome.failures(), outcome.explain()
