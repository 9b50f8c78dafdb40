"""Check 13: block accounting, in process. After every step, every running request holds the blocks its
computed tokens need (``ceil(tokens / block_size)``), a request readmitted after a recompute preemption
included; and under ``preemption_mode="auto"`` with a full host pool, every preemption is counted the
step it happens, as its kind: a swap auto wanted but could not make is one more ``swap_fallbacks`` and one
more ``preemptions_recompute`` (:mod:`kvbench.conformance.block_accounting`).

Outputs first: each run's tokens are held to the ground truth before anything is asked of its blocks or
counters, so a wrong answer fails whatever the accounting shows."""

from __future__ import annotations

import pytest

from kvbench.conformance.block_accounting import can_observe, observe
from kvbench.conformance.prove import assert_conforms, compare_outputs, pressured_knobs, prove
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: at most this many violations named in a failure message
SHOWN = 5


def _observed(engine, requests, truth, truth_engine, near_ties, tolerance, label, **knobs):
    """The requests run under pressure with every step observed, their outputs held to the ground truth."""
    why_not = can_observe(engine)
    if why_not:
        undecided(why_not)
    run = observe(engine, requests, pressured_knobs(engine, requests, **knobs))
    assert_conforms(compare_outputs(engine, run.result, truth, requests, truth_engine.top2_margins,
                                    f"{engine.name} {label}", tolerance, gap_of=truth_engine.logit_gap), near_ties)
    return run


def _holdings_claim(engine, run, label: str) -> None:
    wrong = run.observer.wrong_holdings
    claim(not wrong, f"{label}: {len(wrong)} times a running request on {engine.name} held other than the blocks its "
                     "tokens need:\n" + "\n".join(f"  {h.explain()}" for h in wrong[:SHOWN]))


def test_running_requests_hold_the_blocks_their_tokens_need(engine, requests_greedy, truth, truth_engine,
                                                            near_ties, tolerance):
    """13a. Recompute pressure: at every step each running request holds ceil(tokens / block_size) blocks,
    readmitted requests included; proven by recompute preemptions and readmitted requests checked."""
    require(engine, "block_introspection", "recompute", "events")
    run = _observed(engine, requests_greedy, truth, truth_engine, near_ties, tolerance, "recompute",
                    preemption_mode="recompute")
    observer = run.observer
    _holdings_claim(engine, run, "recompute")
    prove(run.result, engine, "preemptions_recompute", "recompute preemption")
    claim(observer.readmitted_checked > 0,
          f"no request readmitted after a recompute preemption was seen running on {engine.name} "
          f"({observer.holdings_checked} holdings checked over {observer.steps} steps): the readmission rule was "
          "not exercised")
    if observer.readmitted_checked:
        record_proof("readmitted_holdings_checked", observer.readmitted_checked)


def test_auto_counts_every_fallback_the_step_it_happens(engine, requests_greedy, truth, truth_engine, near_ties,
                                                        tolerance):
    """13b. ``auto`` with a host pool of one block (every request spans two or more, so every swap auto wants
    falls back): each step's preemption counters move by what its preemption events say, fallbacks in
    ``swap_fallbacks`` and in ``preemptions_recompute``; blocks held as in 13a. Proven by a fallback counted."""
    require(engine, "block_introspection", "swap", "auto_preemption", "events")
    requests = [r for r in requests_greedy if len(r.prompt_token_ids) > engine.kv_layout.block_size()]
    wanted = {r.request_id for r in requests}
    subset = type(truth)([o for o in truth.outputs if o.request_id in wanted])
    run = _observed(engine, requests, subset, truth_engine, near_ties, tolerance, "auto, host pool full",
                    preemption_mode="auto", num_cpu_blocks=1)
    observer = run.observer
    if not observer.events_seen["swap_fallbacks"]:
        undecided(f"auto wanted no swap the full host pool refused ({dict(observer.events_seen)} over "
                  f"{observer.steps} steps): nothing shows whether its fallbacks are counted")
    wrong = observer.wrong_counts
    claim(not wrong, f"auto, host pool full: {len(wrong)} steps on {engine.name} counted their preemptions otherwise "
                     "than their events say:\n" + "\n".join(f"  {c.explain()}" for c in wrong[:SHOWN]))
    counters = run.result.counters
    for name, seen in sorted(observer.events_seen.items()):
        if name in counters:
            claim(counters[name] == seen, f"auto, host pool full: {name}={counters[name]} at the end on "
                                          f"{engine.name}, but its events say {seen}")
    _holdings_claim(engine, run, "auto, host pool full")
    prove(run.result, engine, "swap_fallbacks", "a swap fallback")
