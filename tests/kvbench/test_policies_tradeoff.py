"""The preemption-policies scenario's admission trade-off curve: the goal judged per point, the sweep over
the watermark's headroom, and a claim that fails on an admission policy that preempts more than static."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.results import Results
from kvbench.bench.scenarios import policies
from kvbench.bench.scenarios.common import Served
from kvbench.report.render import render_report

TINY = sc.Model("tiny-ckpt", "tiny", vocab_size=512, max_model_len=1024)
STATIC = {"preemptions": 10.0, "tbt_p99": 0.020, "output_throughput": 100.0}


def test_goal_needs_all_three_parts():
    ok = policies.goal_check(STATIC, {"preemptions": 1.0, "tbt_p99": 0.009, "output_throughput": 96.0})
    assert ok.met and ok.fewer_preemptions == pytest.approx(10) and ok.lower_tbt == pytest.approx(20 / 9)
    # each part alone short of the goal fails it
    assert not policies.goal_check(STATIC, {"preemptions": 1.0, "tbt_p99": 0.011, "output_throughput": 96.0}).met
    assert not policies.goal_check(STATIC, {"preemptions": 3.0, "tbt_p99": 0.009, "output_throughput": 96.0}).met
    assert not policies.goal_check(STATIC, {"preemptions": 1.0, "tbt_p99": 0.009, "output_throughput": 94.0}).met
    # none left out of ten: infinitely fewer; a missing figure: undecided
    assert math.isinf(policies.goal_check(STATIC, {**STATIC, "preemptions": 0.0}).fewer_preemptions)
    assert policies.goal_check(STATIC, {"preemptions": 0.0, "output_throughput": 99.0}).met is None
    assert policies.goal_check({**STATIC, "preemptions": 0.0}, {**STATIC, "preemptions": 0.0}).fewer_preemptions == 1


def test_the_table_says_within_noise_when_the_spread_could_undo_the_goal():
    static = {"engine": "e", "mode": "evening_surge/static", "metrics": STATIC, "repeats": [STATIC, STATIC],
              "spread": {"tbt_p99": 0.008, "output_throughput": 5.0}}
    quiet = {"engine": "e", "mode": "evening_surge/watermark", "spread": {},
             "metrics": {"preemptions": 0.0, "tbt_p99": 0.009, "output_throughput": 99.0}}
    recorded = {"results": [static, quiet]}
    (row,) = policies.tradeoff_rows(recorded)
    assert row[1] == "evening_surge/watermark" and row[-1] == "within noise"  # 2.2x, but +-80% (2 x 40%)
    static["spread"] = {"tbt_p99": 0.001, "output_throughput": 1.0}
    assert policies.tradeoff_rows(recorded)[0][-1] == "yes"
    quiet["metrics"] = {**quiet["metrics"], "tbt_p99": 0.015}
    assert policies.tradeoff_rows(recorded)[0][-1] == "no"
    assert "all" in policies.tradeoff_rows(recorded)[0][2]  # 10 -> 0 preemptions


def _served(preemptions: dict[str, float]) -> list[Served]:
    """Every job of the quick plan, served as a trace that finished, with the given preemption counts."""
    out = []
    for job in sc.PREEMPTION_POLICIES.plan("quick", TINY):
        trace = SimpleNamespace(engine="reference", step_seconds=0.01,
                                requests={"r": SimpleNamespace(finished=1.0, finish_reason="length")})
        served = Served(job, trace)  # type: ignore[arg-type]
        count = preemptions.get(job.mode or "", 3.0)
        served._metrics = {"preemptions": count, "preemptions_recompute": count, "preemptions_swap": 0.0,
                           "swap_fallbacks": 0.0, "output_throughput": 100.0, "tbt_p99": 0.01}
        out.append(served)
    return out


def test_the_curve_is_a_sweep_over_the_headroom_and_its_claim_can_fail():
    jobs = sc.PREEMPTION_POLICIES.plan("quick", TINY)
    modes = [j.mode for j in jobs]
    for surge in sc.PREEMPTION_POLICIES.size("quick").surges:
        assert [f"{surge}/static", *policies.admission_modes(surge)] == [m for m in modes if m.startswith(surge)]
    by_mode = {j.mode: j for j in jobs}
    assert by_mode["evening_surge/watermark-headroom-0.4"].knobs.admission_headroom == 0.4
    assert by_mode["evening_surge/watermark+pacing"].knobs.prefill_pacing_tokens == policies.PACING_TOKENS
    assert by_mode["evening_surge/static"].knobs.admission_policy == "none"

    claim = "every admission-controlled run preempted no more often than static on evening_surge"
    good = sc.PREEMPTION_POLICIES.judge(_served({"evening_surge/static": 5.0, "evening_surge/watermark": 0.0}),
                                        "quick", TINY)
    assert good.claims[claim] is True
    assert [(p.sweep, p.x) for p in good.points] == [("admission_headroom", h) for h in policies.HEADROOMS]
    # an admission rule that made things worse at one setting (pacing spreading a wave over more steps)
    bad = sc.PREEMPTION_POLICIES.judge(_served({"evening_surge/static": 5.0, "evening_surge/watermark": 0.0,
                                                "evening_surge/watermark+pacing": 9.0}), "quick", TINY)
    assert bad.claims[claim] is False


def test_the_report_shows_the_trade_off_table_and_no_knee_on_the_headroom_axis():
    results = Results()
    outcome = sc.PREEMPTION_POLICIES.judge(_served({"evening_surge/static": 5.0}), "quick", TINY)
    outcome.repeats = [outcome]
    for entry in outcome.entries:  # traces are stand-ins: record the figures directly
        results.add_scenario_result(outcome.scenario.name, "reference",
                                    {"preemptions": 5.0 if entry.mode == "evening_surge/static" else 3.0,
                                     "tbt_p99": 0.01, "output_throughput": 100.0}, mode=entry.mode)
    for p in outcome.points:
        results.add_sweep_point(outcome.scenario.name, p.sweep, p.x, "reference", p.metrics, mode=p.mode,
                                x_label=p.x_label)
    page = render_report(results)
    assert "Admission control: the trade-off against static" in page
    assert "evening_surge/watermark-headroom-0.2" in page and "1.67x" in page
    assert "watermark headroom" in page and "knee" not in page.split("Throughput vs watermark headroom")[1][:2000]
