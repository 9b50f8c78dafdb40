"""Check 10: stop conditions under pressure. EOS (when not ignored), ``stop_token_ids`` and
``max_tokens`` each end every request at the same token, with the same finish reason, as an
unpressured run and as the ground truth, while recompute preemptions provably happen."""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import (
    assert_conforms,
    compare_outputs,
    pressured_knobs,
    prove,
    roomy_knobs,
)
from kvbench.conformance.stops import CONDITIONS, eos_prompts, eos_requests, stop_token_requests
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: pools to try, tightest last, until recompute preemption fires: requests that stop early leave less
#: pressure behind than their max_tokens promise, and engines admit differently (a tighter pool can mean fewer
#: requests admitted at once and so no preemption at all), so no single size fires on every engine. Each is
#: (factor, by the ground truth's real lengths?): 1.35x the largest max_tokens need (reference engine: 16
#: blocks of 16), then 1.35x and 1.1x the largest real need. The largest request always fits.
POOLS = ((1.35, False), (1.35, True), (1.1, True))


def _requests_for(condition, requests_greedy, truth, truth_engine):
    if condition == "max_tokens":
        return list(requests_greedy)
    if condition == "stop_token_ids":
        return stop_token_requests(requests_greedy, truth)
    from kvbench.engines.hf.generate import eos_token_ids

    model = truth_engine.model
    eos = eos_token_ids(model)
    if not eos:
        pytest.skip("the model has no EOS token")
    return eos_requests(requests_greedy, eos_prompts(model, requests_greedy, eos))


def _same_finish(label, got, want) -> list[str]:
    return [f"{label}: {g.request_id} finished with {g.finish_reason!r} after {len(g.token_ids)} tokens, expected "
            f"{w.finish_reason!r} after {len(w.token_ids)}"
            for g, w in zip(got.outputs, want.outputs, strict=True)
            if g.finish_reason != w.finish_reason and g.token_ids[:len(w.token_ids)] == w.token_ids[:len(g.token_ids)]]


@pytest.mark.parametrize("condition", CONDITIONS)
def test_stop_condition_holds_under_pressure(condition, engine, requests_greedy, truth, truth_engine, near_ties,
                                            tolerance):
    require(engine, "recompute", *(("stop_token_ids",) if condition == "stop_token_ids" else ()))
    requests = _requests_for(condition, requests_greedy, truth, truth_engine)
    want = truth_engine.generate(requests)
    reason = "length" if condition == "max_tokens" else "stop"
    fired = sum(o.finish_reason == reason for o in want.outputs)
    if fired == 0:
        pytest.skip(f"no ground-truth request ended by {condition}: nothing would prove the engine honours it")
    calm = engine.generate(requests, roomy_knobs(engine, requests))
    for factor, by_real_lengths in POOLS:
        stormy = engine.generate(requests, pressured_knobs(engine, requests, factor, outputs=want if by_real_lengths
                                                           else None, preemption_mode="recompute"))
        if stormy.counters.get("preemptions_recompute", 0) > 0:
            break
    prove(stormy, engine, "preemptions_recompute", "recompute preemption")
    problems = _same_finish("unpressured vs ground truth", calm, want) + \
        _same_finish("pressured vs ground truth", stormy, want) + _same_finish("pressured vs unpressured", stormy, calm)
    assert not problems, f"{condition}: finish reasons differ:\n" + "\n".join(problems[:10])
    margins = truth_engine.top2_margins
    for label, result in (("unpressured", calm), ("pressured", stormy)):
        assert_conforms(compare_outputs(engine, result, want, requests, margins, f"{engine.name} {condition} {label}",
                                        tolerance, gap_of=truth_engine.logit_gap), near_ties)
