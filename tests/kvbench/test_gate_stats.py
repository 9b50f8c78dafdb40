"""The gate's statistics on synthetic data: per-repeat ratios cancel load drift, the noise floor
never claims ~0, and a real slowdown is still caught and named."""

from __future__ import annotations

import pytest

from kvbench.bench import gate
from kvbench.bench.repeats import aggregate
from kvbench.bench.results import Results

REF, ENGINE = "reference", "reference:preemption_mode=swap"


def two_engines(ref: list[float], engine: list[float], metric: str = "output_throughput") -> Results:
    """One scenario, the reference engine and another, with per-repeat values of ``metric``
    (repeat i of both taken in the same round, as the interleaved runner serves them)."""
    res = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    for name, values in ((REF, ref), (ENGINE, engine)):
        reps = [{metric: v} for v in values]
        medians, spreads = aggregate(reps)
        res.add_scenario_result("storm", {"name": name, "kind": "reference"}, medians, repeats=reps, spread=spreads,
                                clock={"clock": "step", "step_seconds": 0.01, "exact_counts": True,
                                       "interleaved": [REF, ENGINE]})
    return res


def test_load_drift_across_repeats_cancels_in_per_repeat_ratios():
    # the machine slows by 40% over the baseline's three rounds and swings the other way in the
    # current run; the engine is always exactly half as fast as the reference in the same round
    base = two_engines([100, 80, 60], [50, 40, 30])
    cur = two_engines([60, 90, 75], [30, 45, 37.5])
    verdict = gate.gate(cur, base, ["throughput:-10%"])
    [d] = verdict.deltas
    assert not verdict.failed
    assert d.basis == "ratio to reference" and d.baseline == pytest.approx(0.5) and d.current == pytest.approx(0.5)
    # identical ratios in every repeat: the spread is 0, the floor is the minimum, never 0
    assert d.noise == pytest.approx(gate.MIN_NOISE * 0.5)


def test_a_2x_slowdown_under_drift_is_caught_and_named():
    base = two_engines([100, 80, 60], [50, 40, 30])
    slower = two_engines([60, 90, 75], [15, 22.5, 18.75])  # the engine alone got 2x slower
    verdict = gate.gate(slower, base, ["throughput:-10%"])
    [r] = verdict.regressions
    assert (r.engine, r.baseline, r.current) == (ENGINE, pytest.approx(0.5), pytest.approx(0.25))
    assert "storm / reference:preemption_mode=swap: output_throughput (ratio to reference) 0.5 -> 0.25 (-50.0%" \
        in verdict.failure_lines()[0]


def test_unpaired_repeats_would_hide_the_same_slowdown():
    """Why repeats must be paired in time: the same values with the engine's repeats not taken next to
    the reference's (here: in another order) scatter the ratios, and the noise floor swallows a 2x slowdown."""
    base = two_engines([100, 80, 60], [30, 50, 40])
    slower = two_engines([60, 90, 75], [22.5, 15, 18.75])
    [d] = gate.gate(slower, base, ["throughput:-10%"]).deltas
    assert d.threshold.violated(d.baseline, d.current) and not d.regressed and d.within_noise


def test_the_noise_floor_is_never_below_the_minimum_share_of_the_baseline():
    base = two_engines([100, 100, 100], [80, 80, 80])  # three repeats that agree exactly
    nudged = two_engines([100, 100, 100], [73, 73, 73])  # -8.75%: over a 5% threshold, under the 10% floor
    [d] = gate.gate(nudged, base, ["throughput:-5%"]).deltas
    assert d.noise == pytest.approx(0.08) and d.within_noise and not d.regressed
    assert gate.gate(nudged, base, ["throughput:-5%"], min_noise=0).failed  # a floor of 0 would fail it
    dropped = two_engines([100, 100, 100], [68, 68, 68])  # -15%: beyond both
    assert gate.gate(dropped, base, ["throughput:-10%"]).failed
    with pytest.raises(ValueError, match="min_noise"):
        gate.gate(dropped, base, [], min_noise=-0.1)


def test_a_wide_spread_of_ratios_raises_the_floor_above_the_minimum():
    base = two_engines([100, 100, 100], [70, 80, 90])  # ratios 0.7..0.9: half-range 0.1
    cur = two_engines([100, 100, 100], [60, 70, 80])
    [d] = gate.gate(cur, base, ["throughput:-10%"]).deltas
    assert d.noise == pytest.approx(3 * 0.1) and not d.regressed  # -12.5% is inside 3 spreads
    assert gate.noise_floor(0.8, 0.1, 0.1) == pytest.approx(0.3)
    assert gate.noise_floor(0.8, 0.0, 0.0) == pytest.approx(0.08)


def test_paired_ratios_need_the_same_number_of_repeats():
    res = {"repeats": [{"m": 2.0}, {"m": 4.0}, {"m": None}]}
    ref = {"repeats": [{"m": 1.0}, {"m": 2.0}, {"m": 5.0}]}
    assert gate.paired_ratios(res, ref, "m") == [2.0, 2.0]  # a repeat without a value is left out
    assert gate.paired_ratios(res, {"repeats": ref["repeats"][:2]}, "m") is None
    assert gate.paired_ratios({"repeats": [{"m": 1.0}]}, {"repeats": [{"m": 1.0}]}, "m") is None  # one repeat
    # without pairs, the ratio of medians with its propagated spread (older results files)
    base = two_engines([100, 80, 60], [50, 40, 30])
    lone = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    for name, value in ((REF, 80.0), (ENGINE, 40.0)):  # on the baseline's clock: another clock is set aside
        lone.add_scenario_result("storm", {"name": name, "kind": "reference"}, {"output_throughput": value},
                                 clock={"clock": "step", "step_seconds": 0.01})
    [d] = gate.gate(lone, base, ["throughput:-10%"]).deltas
    assert d.current == pytest.approx(0.5) and not d.regressed


def test_exact_counts_get_no_floor():
    res = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    res.add_scenario_result("storm", {"name": REF, "kind": "reference"}, {"preemptions": 100},
                            repeats=[{"preemptions": 100}] * 3,
                            clock={"clock": "step", "step_seconds": 0.01, "exact_counts": True})
    more = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    more.add_scenario_result("storm", {"name": REF, "kind": "reference"}, {"preemptions": 101},
                             repeats=[{"preemptions": 101}] * 3,
                             clock={"clock": "step", "step_seconds": 0.01, "exact_counts": True})
    [r] = gate.gate(more, res, ["preemptions:+0"]).regressions
    assert r.basis == "exact" and r.noise == 0


def test_tails_get_a_wider_floor_than_rates():
    # the same +15% move with repeats that agree exactly: a rate's floor is 10%, a tail's 20%
    base = two_engines([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "tbt_p99")
    cur = two_engines([1.0, 1.0, 1.0], [1.15, 1.15, 1.15], "tbt_p99")
    [d] = gate.gate(cur, base, ["p99_tbt:+10%"]).deltas
    assert d.noise == pytest.approx(gate.MIN_NOISE_TAIL) and d.within_noise
    base = two_engines([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "tbt_p50")
    cur = two_engines([1.0, 1.0, 1.0], [1.15, 1.15, 1.15], "tbt_p50")
    [d] = gate.gate(cur, base, ["p50_tbt:+10%"]).deltas
    assert d.noise == pytest.approx(gate.MIN_NOISE) and d.regressed


def test_a_results_spread_is_the_stored_one_else_its_repeats():
    from kvbench.bench.repeats import result_spread, spread

    repeats = [{"ttft_p50": v} for v in (1.0, 1.2, 1.6)]
    # the stored spread is what the run reported: the gate and the report read that one
    assert result_spread({"repeats": repeats, "spread": {"ttft_p50": 9.0}}, "ttft_p50") == 9.0
    # none stored: the spread of the repeats
    assert result_spread({"repeats": repeats}, "ttft_p50") == pytest.approx(spread([1.0, 1.2, 1.6]))
    assert spread([1.0, 1.2, 1.6]) == pytest.approx(0.3)
    assert result_spread({"repeats": repeats, "spread": {"ttft_p50": None}}, "ttft_p50") == pytest.approx(0.3)
    # one value, or none, and nothing stored: 0
    assert result_spread({"repeats": repeats[:1]}, "ttft_p50") == 0.0
    assert result_spread({}, "ttft_p50") == 0.0
