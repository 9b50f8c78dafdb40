"""Check 11: the engine's metrics tell the truth. Its counters agree with each other, with its own
events and with the outputs kvbench received (see :mod:`kvbench.conformance.metrics_truth`)."""

from __future__ import annotations

import pytest

from kvbench.conformance.metrics_truth import metrics_disagreements, recomputed_from_events, told_twice_disagreements
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


def test_counts_told_twice_agree(engine, requests_greedy):
    """11b. Without events (any engine, a server too): what the engine counts two ways agrees, and with
    what kvbench received: its one preemption total with its by-mode counts, per-request preemption counts
    with the totals, generated tokens with the tokens received. A disagreement names both figures."""
    require(engine, "recompute")
    knobs = pressured_knobs(engine, requests_greedy, preemption_mode="recompute")
    result = engine.generate(requests_greedy, knobs)
    prove(result, engine, "preemptions_recompute", "a recompute preemption")
    c = result.counters
    told_twice = [what for what, both in (
        ("preemptions_total", c.preemptions_total is not None and c.preemptions is not None),
        ("per-request preemptions", c.preemptions is not None
         and all(o.num_preemptions is not None for o in result.outputs)),
        ("generated_tokens", c.generated_tokens is not None)) if both]
    if not told_twice:
        pytest.skip(f"{engine.name} tells none of these counts two ways (not exposed): preemptions_total beside "
                    "the by-mode counts, per-request preemptions, generated_tokens")
    problems = told_twice_disagreements(result)
    assert not problems, f"{engine.name}'s counts disagree ({', '.join(told_twice)} told twice):\n" + \
        "\n".join(problems[:10])
