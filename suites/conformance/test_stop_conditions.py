"""Check 10: stop conditions under pressure. EOS (when not ignored), ``stop_token_ids`` and
``max_tokens`` each end every request at the same token, with the same finish reason, as an
unpressured run and as the ground truth, while recompute preemptions provably happen.

EOS runs on a checkpoint of its own, the session's model with EOS moved onto a token the greedy outputs
reach mid-output (:mod:`kvbench.models.eos_checkpoint`), so the stops are known in advance and happen under
pressure rather than by luck (:mod:`kvbench.conformance.stops`)."""

from __future__ import annotations

import pytest

from kvbench.conformance.on_checkpoint import engine_on
from kvbench.conformance.prove import (
    assert_conforms,
    compare_outputs,
    pressured_knobs,
    prove,
    roomy_knobs,
)
from kvbench.conformance.stops import CONDITIONS, eos_positions, eos_requests, stop_token_requests
from kvbench.conformance.verdict import claim, undecided
from kvbench.core.evidence import record_evidence
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: pools to try, tightest last, until recompute preemption fires: requests that stop early leave less
#: pressure behind than their max_tokens promise, and engines admit differently (a tighter pool can mean fewer
#: requests admitted at once and so no preemption at all), so no single size fires on every engine. Each is
#: (factor, by the ground truth's real lengths?): 1.35x the largest max_tokens need (reference engine: 16
#: blocks of 16), then 1.35x and 1.1x the largest real need. The largest request always fits.
POOLS = ((1.35, False), (1.35, True), (1.1, True))


def _same_finish(label, got, want) -> list[str]:
    return [f"{label}: {g.request_id} finished with {g.finish_reason!r} after {len(g.token_ids)} tokens, expected "
            f"{w.finish_reason!r} after {len(w.token_ids)}"
            for g, w in zip(got.outputs, want.outputs, strict=True)
            if g.finish_reason != w.finish_reason and g.token_ids[:len(w.token_ids)] == w.token_ids[:len(g.token_ids)]]


@pytest.mark.parametrize("condition", CONDITIONS)
def test_stop_condition_holds_under_pressure(condition, engine, requests_greedy, truth, truth_engine, near_ties,
                                            tolerance):
    require(engine, "recompute", *(("stop_token_ids",) if condition == "stop_token_ids" else ()))
    if condition == "eos":
        _eos_holds_under_pressure(engine, requests_greedy, truth, truth_engine, near_ties, tolerance)
        return
    requests = list(requests_greedy) if condition == "max_tokens" else stop_token_requests(requests_greedy, truth)
    _holds_under_pressure(condition, engine, requests, truth_engine.generate(requests), truth_engine, near_ties,
                          tolerance)


def _eos_holds_under_pressure(engine, requests_greedy, truth, truth_engine, near_ties, tolerance):
    """EOS on a checkpoint of the session's model with EOS moved onto a token its greedy outputs reach
    mid-output (:mod:`kvbench.models.eos_checkpoint`): the requests that reach it stop there, known in advance."""
    from kvbench.engines.hf.generate import eos_token_ids
    from kvbench.models.eos_checkpoint import eos_checkpoint, pick_eos

    old_eos = min(eos_token_ids(truth_engine.model), default=None)
    eos = pick_eos([o.token_ids for o in truth.outputs], old_eos)
    if eos is None:
        undecided("no token appears inside any ground-truth output: no EOS position can be made known")
    positions = eos_positions(truth, eos)
    model_dir = str(eos_checkpoint(engine.model_dir, eos))
    requests = eos_requests(requests_greedy)
    with engine_on(engine, model_dir) as other, engine_on(truth_engine, model_dir) as other_truth:
        if other is None:
            undecided(f"{engine.name} runs the checkpoint it was started with, so it cannot run one whose EOS is "
                      "known to be reached (let kvbench start the server: --engine server:...)")
        want = other_truth.generate(requests)
        stops = {o.request_id: len(o.token_ids) - 1 for o in want.outputs if o.finish_reason == "stop"}
        if stops != positions:  # kvbench's own premise, not the engine's doing: an error, not a verdict
            raise RuntimeError(f"the ground truth on {model_dir} stops at {stops}, not where EOS id {eos} first "
                               f"appears in its outputs with EOS ignored ({positions})")
        record_evidence("eos_stops_known", len(positions))
        _holds_under_pressure("eos", other, requests, want, other_truth, near_ties, tolerance)


def _holds_under_pressure(condition, engine, requests, want, truth_engine, near_ties, tolerance):
    """Outputs and finish reasons of an unpressured and a pressured run equal the ground truth ``want``; then
    recompute preemption is proven to have fired under the pressured one."""
    reason = "length" if condition == "max_tokens" else "stop"
    fired = sum(o.finish_reason == reason for o in want.outputs)
    if fired == 0:
        undecided(f"no ground-truth request ended by {condition}: nothing would prove the engine honours it")
    for factor, by_real_lengths in POOLS:
        stormy = engine.generate(requests, pressured_knobs(engine, requests, factor, outputs=want if by_real_lengths
                                                           else None, preemption_mode="recompute"))
        if stormy.counters.get("preemptions_recompute", 0) > 0:
            break
    # the unpressured run after the pressured one: a server started afresh per pool (vLLM) then serves it in waves
    # on the pool just used; run first, it started a roomy server of its own (one start more)
    calm = engine.generate(requests, roomy_knobs(engine, requests))
    problems = _same_finish("unpressured vs ground truth", calm, want) + \
        _same_finish("pressured vs ground truth", stormy, want) + _same_finish("pressured vs unpressured", stormy, calm)
    claim(not problems, f"{condition}: finish reasons differ:\n" + "\n".join(problems[:10]))
    margins = truth_engine.top2_margins
    for label, result in (("unpressured", calm), ("pressured", stormy)):
        assert_conforms(compare_outputs(engine, result, want, requests, margins, f"{engine.name} {condition} {label}",
                                        tolerance, gap_of=truth_engine.logit_gap), near_ties)
    record_evidence(f"{condition}_stops", sum(o.finish_reason == reason for o in stormy.outputs))
    prove(stormy, engine, "preemptions_recompute", "recompute preemption")
