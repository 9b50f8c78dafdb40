"""Check 12: admission control keeps the headroom its knobs promise.

``admission_policy="watermark"`` admits a request into a running batch only while the projected KV use
stays under ``1 - admission_headroom`` of the device pool. What is projected includes the admitted
request's own blocks, so the pool in use right after any admission into a non-empty batch can never be
above that line. (An empty batch takes any request: a gate that refused the only request would stall.)

The engine's own ``admitted`` events say how full the pool was right after each admission and how many
requests it joined. The same requests are run twice on the same pressured pool: with admission off, to
show that this workload does cross the line (else nothing is decided and the check skips saying so), and
with the watermark, where every request must be admitted (an event each), some into a running batch (a gate
that runs everything alone keeps no headroom, it wastes the pool), and none of those may cross the line.
"""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import pressured_knobs, require_events
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: the headroom the check asks for: wide enough that a pressured pool crosses its line without the gate
HEADROOM = 0.3


def admissions_over(events, line: float) -> list[str]:
    """``admitted`` events into a running batch that left the device pool fuller than ``line`` (0..1)."""
    return [f"{e.request_id} (step {e.step}: pool {e.data['kv_usage']:.0%} in use after joining "
            f"{e.data['num_running']} running)"
            for e in events
            if e.kind == "admitted" and e.data.get("num_running", 0) > 0 and e.data["kv_usage"] > line + 1e-9]


def test_watermark_admission_keeps_its_headroom(engine, requests_greedy):
    require(engine, "admission_control")
    line = 1.0 - HEADROOM

    def admissions(policy: str):
        knobs = pressured_knobs(engine, requests_greedy, preemption_mode="recompute", admission_policy=policy,
                                admission_headroom=HEADROOM)
        result = engine.generate(requests_greedy, knobs)
        events = [e for e in require_events(result, engine, "how full the pool was at each admission")
                  if e.kind == "admitted"]
        if events and any("kv_usage" not in e.data or "num_running" not in e.data for e in events):
            pytest.skip(f"{engine.name}'s admitted events do not say the pool's use and the batch they joined "
                        "(not exposed)")
        unfinished = [o.request_id for o in result.outputs if o.finish_reason not in ("length", "stop")]
        assert not unfinished, f"admission_policy={policy}: requests did not finish: {unfinished[:10]}"
        unseen = {r.request_id for r in requests_greedy} - {e.request_id for e in events}
        assert not unseen, f"admission_policy={policy}: served requests without an admitted event: {sorted(unseen)}"
        return events

    ungated = admissions_over(admissions("none"), line)
    if not ungated:
        pytest.skip(f"with admission off no admission into a running batch filled the pool past {line:.0%}: "
                    "this workload cannot tell a gate that keeps its headroom from one that does not (undecided)")
    gated = admissions("watermark")
    assert any(e.data["num_running"] > 0 for e in gated), (
        "admission_policy=watermark admitted no request into a running batch: it ran every request alone, "
        "not up to the headroom its knobs set")
    crossed = admissions_over(gated, line)
    assert not crossed, (f"admission_policy=watermark, admission_headroom={HEADROOM}: {len(crossed)} admissions "
                         f"into a running batch filled the pool past {line:.0%} (the headroom it must keep): "
                         + "; ".join(crossed[:8]))
