"""Check 9: the preemption victim is the request the declared policy names. FCFS preempts the
latest admitted running request; the priority policy the least important one (highest priority
value, then latest arrival), never one more important than another request running."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvbench.conformance.prove import pressured_knobs, prove, require_events
from kvbench.conformance.victims import victim_violations
from kvbench.core.engine_events import preemption_records
from kvbench.plugin import require

pytestmark = pytest.mark.conformance


def with_priorities(requests, seed: int = 9):
    """The request set with seeded priorities 0-2 (lower = more important), in the same order."""
    rng = random.Random(seed)
    return [replace(r, priority=rng.randrange(3)) for r in requests]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_follows_the_policy(policy, engine, requests_greedy):
    require(engine, "recompute", *(("priority",) if policy == "priority" else ()))
    requests = with_priorities(requests_greedy) if policy == "priority" else requests_greedy
    knobs = pressured_knobs(engine, requests, preemption_mode="recompute", scheduling_policy=policy)
    result = engine.generate(requests, knobs)
    prove(result, engine, "preemptions_recompute", "a preemption")
    records = preemption_records(require_events(result, engine, "which request was preempted"))
    assert records, f"{engine.name} counted preemptions but reported no preemption event"
    if any(r.running is None for r in records):
        pytest.skip(f"{engine.name}'s preemption events do not say which requests were running")
    problems = victim_violations(records, policy, requests)
    assert not problems, f"{len(problems)} of {len(records)} preemptions chose the wrong victim:\n" + \
        "\n".join(problems[:10])
