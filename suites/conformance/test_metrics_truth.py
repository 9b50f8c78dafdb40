"""Check 11: the engine's metrics tell the truth. Its counters agree with each other, with its own
events and with the outputs kvbench received (see :mod:`kvbench.conformance.metrics_truth`)."""

from __future__ import annotations

import pytest

from kvbench.conformance.metrics_truth import metrics_disagreements, recomputed_from_events
from kvbench.conformance.prove import pressured_knobs, prove, require_events
from kvbench.engines.base import Knobs
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

MODES = {
    # recompute with prefix caching: resumed requests re-hit their own blocks, so the recomputed-token
    # count must leave out what the cache served
    "recompute+prefix": (("recompute", "prefix_caching"),
                         Knobs(preemption_mode="recompute", enable_prefix_caching=True)),
    "swap": (("swap",), Knobs(preemption_mode="swap", num_cpu_blocks=512)),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_counters_agree_with_events_and_outputs(mode, engine, requests_greedy):
    caps, mode_knobs = MODES[mode]
    require(engine, *caps)
    knobs = pressured_knobs(engine, requests_greedy).merged(mode_knobs)
    result = engine.generate(requests_greedy, knobs)
    counter = "preemptions_swap" if mode == "swap" else "preemptions_recompute"
    prove(result, engine, counter, f"a {mode} preemption")
    events = require_events(result, engine, "what the counters should say")
    if mode != "swap":
        # proved from the events, not the counter under test: KV was discarded and computed again
        assert (recomputed_from_events(events) or 0) > 0, \
            "the events show no recomputed work: the recomputed-token comparison would prove nothing"
    problems = metrics_disagreements(result)
    assert not problems, f"{engine.name}'s counters disagree with what happened:\n" + "\n".join(problems[:10])
