"""Check 11: the engine's metrics tell the truth. Its counters agree with each other, with its own
events and with what kvbench sent and received (see :mod:`kvbench.conformance.metrics_truth`).

11 needs the engine's events; 11b and 11c hold any engine, a server above all: 11b compares what the engine
counts two ways, 11c what it counts against what kvbench itself sent and received. Each asserts what it can
about the run's outputs first (11c compares them with the ground truth, 11b that every request was answered in
full), and each disagreement is its own claim, naming both figures."""

from __future__ import annotations

import pytest

from kvbench.conformance.metrics_truth import (
    client_view_counts,
    metrics_disagreements,
    prefix_hit_ceiling,
    recomputed_from_events,
    told_twice,
    told_twice_disagreements,
)
from kvbench.conformance.prove import (
    assert_conforms,
    compare_outputs,
    pressured_knobs,
    prove,
    require_events,
    until_triggered,
)
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
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
    # what the counters should say is read from the engine's events: without them the check cannot decide, so it
    # skips before its run (whose pressure on a server depends on timing) rather than after
    require(engine, *caps, "events")
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
    what kvbench received: its own preemption total with its by-mode counts and with its per-request counts,
    per-request preemption counts with the totals, generated tokens with the tokens received, the responses'
    cached tokens with the prefix-cache hits, and the hits with the most the requests can give. A count the
    engine tells once (vLLM's one preemption total, which kvbench reads as its recompute count) is said to be
    told once, and never compared with itself. A disagreement names both figures."""
    require(engine, "recompute")
    knobs = pressured_knobs(engine, requests_greedy, preemption_mode="recompute")

    def attempt():
        result = engine.generate(requests_greedy, knobs)
        for req, out in zip(requests_greedy, result.outputs, strict=True):  # outputs first: each answered in full
            claim(out.finish_reason == "length" and len(out.token_ids) == req.max_tokens,
                  f"{req.request_id} was not answered in full on {engine.name}: {len(out.token_ids)} of "
                  f"{req.max_tokens} tokens, finish reason {out.finish_reason!r} ({out.error or 'no error'})")
        return result

    result = until_triggered(engine, "preemptions_recompute", attempt)
    prove(result, engine, "preemptions_recompute", "a recompute preemption")
    twice, once = told_twice(result)
    record_evidence("told_twice", twice)
    record_evidence("told_once", once)
    if not twice:
        undecided(f"{engine.name} tells none of its counts two ways (told once: {'; '.join(once) or 'none'}; not "
                  "exposed: preemptions_total beside by-mode counts, per-request preemptions, generated_tokens, "
                  "per-response cached tokens)")
    block_size = knobs.block_size or engine.kv_layout.block_size()
    for problem in told_twice_disagreements(result, hit_ceiling=prefix_hit_ceiling(requests_greedy, result,
                                                                                    block_size)):
        claim(False, f"{engine.name}'s counts disagree ({', '.join(twice)} told twice): {problem}")


def test_what_the_client_saw_agrees_with_the_counters(engine, requests_greedy, truth, truth_engine, near_ties,
                                                      tolerance):
    """11c. What kvbench sent and received against what the engine counted of it (any engine, a server
    above all: its ``/metrics``): output tokens received against generated tokens, prompt tokens sent
    against the prompt-token counter (cached prompt tokens included), requests seen finishing ``length`` or
    ``stop`` against the engine's finishes by reason. Each comparison is its own claim naming both figures.
    Undecided where the engine exposes none of these counters.

    Not compared: streams that stalled against preemptions. A client's arrival times bound the server's only
    from above, so no set of stalls, however long, proves that a request was preempted rather than waiting
    on another's prefill."""
    require(engine, "recompute")
    result = engine.generate(requests_greedy, pressured_knobs(engine, requests_greedy, preemption_mode="recompute"))
    assert_conforms(compare_outputs(engine, result, truth, requests_greedy, truth_engine.top2_margins,
                                    f"{engine.name} recompute, the client's view", tolerance,
                                    gap_of=truth_engine.logit_gap), near_ties)
    counts = client_view_counts(requests_greedy, result)
    if not counts:
        undecided(f"{engine.name} exposes none of generated_tokens, prompt_tokens, finished_length, finished_stop: "
                  "nothing it counts can be held against what kvbench sent and received")
    for count in counts:
        claim(count.agrees, f"{engine.name}: {count.problem()}")
    if all(count.agrees for count in counts):
        record_proof("client_view", {count.counter: count.engine for count in counts})
