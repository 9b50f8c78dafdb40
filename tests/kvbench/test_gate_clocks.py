"""The gate and clocks: figures measured on two clocks are set aside (neither a pass nor a fail) and named,
and a gate that could compare nothing fails instead of passing silently."""

from __future__ import annotations

import io

import pytest

from kvbench.bench import gate
from kvbench.bench.repeats import aggregate
from kvbench.bench.results import Results

STEP = {"clock": "step", "step_seconds": 0.01, "exact_counts": True}
WALL = {"clock": "wall", "step_seconds": None, "exact_counts": False}


def run(results: dict[tuple[str, str], tuple[dict, list[dict]]]) -> Results:
    """Results keyed (scenario, engine) -> (clock, per-repeat metrics), recorded as the runner does."""
    res = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    for (scenario, engine), (clock, reps) in results.items():
        medians, spreads = aggregate(reps)
        res.add_scenario_result(scenario, {"name": engine, "kind": "reference" if engine == "reference" else "hf-cb"},
                                medians, repeats=reps, spread=spreads, clock=clock)
    return res


def preempting(n: int, tput: float = 100.0) -> list[dict]:
    return [{"preemptions": n, "output_throughput": tput}] * 3


def test_a_result_on_another_clock_is_set_aside_not_failed_and_the_same_change_on_one_clock_fails():
    base = run({("storm", "reference"): (STEP, preempting(17))})
    walled = run({("storm", "reference"): (WALL, preempting(40))})
    verdict = gate.gate(walled, base, ["preemptions:+0"])
    assert not verdict.regressions and not verdict.deltas  # 17 -> 40 across clocks is not a regression...
    [aside] = verdict.set_aside
    assert aside.describe() == ("not compared: storm / reference: the baseline measured it on the step clock "
                                "(0.01 s a step), this run on the wall clock")
    assert any("neither a pass nor a fail" in n and "storm / reference" in n for n in verdict.notes)
    # ... and the gate does not pass either: it compared nothing, so it fails and says why
    assert verdict.failed and verdict.nothing_compared
    assert verdict.summary() == "regression gate failed: nothing compared"
    [line] = verdict.failure_lines()
    assert line.startswith("NOTHING COMPARED") and "different clocks" in line and "--engine" in line
    # the same 17 -> 40 measured on one clock is a regression: setting aside is what kept it out above
    assert gate.gate(run({("storm", "reference"): (STEP, preempting(40))}), base, ["preemptions:+0"]).regressions


def test_results_on_the_same_clock_are_still_compared_beside_those_set_aside():
    base = run({("storm", "reference"): (STEP, preempting(17)), ("surge", "reference"): (WALL, preempting(5))})
    cur = run({("storm", "reference"): (WALL, preempting(17)), ("surge", "reference"): (WALL, preempting(30))})
    verdict = gate.gate(cur, base, ["preemptions:+0"], absolute=True)
    assert [(s.scenario, s.metric) for s in verdict.set_aside] == [("storm", None)]
    [r] = verdict.regressions
    assert r.scenario == "surge" and (r.baseline, r.current) == (5, 30)
    assert verdict.failure_lines() == [f"REGRESSION {r.describe()}"]  # something was compared: no NOTHING line
    calm = run({("storm", "reference"): (WALL, preempting(17)), ("surge", "reference"): (WALL, preempting(5))})
    passed = gate.gate(calm, base, ["preemptions:+0"], absolute=True)
    assert not passed.failed and "1 set aside, measured on different clocks" in passed.summary()


def test_two_step_clocks_of_different_step_seconds_are_different_clocks():
    base = run({("storm", "reference"): (STEP, preempting(17))})
    finer = run({("storm", "reference"): ({**STEP, "step_seconds": 0.005}, preempting(17))})
    verdict = gate.gate(finer, base, ["preemptions:+0"])
    assert not verdict.deltas and "(0.005 s a step)" in verdict.set_aside[0].why
    assert not gate.gate(run({("storm", "reference"): (STEP, preempting(17))}), base, ["preemptions:+0"]).failed


def test_a_same_run_ratio_across_two_clocks_inside_one_run_is_set_aside():
    """A file from before the one-clock rule: the reference on the step clock, hf-cb on the wall. hf-cb's time
    as a ratio to the reference would divide a wall figure by a step one; its own count (wall in both) is compared."""
    base = run({("crowd", "reference"): (STEP, preempting(3, 1000.0)), ("crowd", "hf-cb"): (WALL, preempting(9, 50.0))})
    cur = run({("crowd", "reference"): (WALL, preempting(3, 100.0)), ("crowd", "hf-cb"): (WALL, preempting(9, 50.0))})
    verdict = gate.gate(cur, base, ["throughput:-10%", "preemptions:+0"])
    # hf-cb's ratio went 0.05 -> 0.5 only because the reference changed clocks: not a comparison at all
    assert [(d.engine, d.metric) for d in verdict.deltas] == [("hf-cb", "preemptions")]
    by_where = {s.where: s.why for s in verdict.set_aside}
    assert set(by_where) == {"crowd / reference", "crowd / hf-cb: output_throughput"}
    assert by_where["crowd / hf-cb: output_throughput"] == (
        "as a ratio to reference: in the baseline it ran on the wall clock and the reference engine on the step "
        "clock (0.01 s a step), so the ratio would divide figures of two clocks")
    assert not verdict.failed
    # the same drop with both runs on the wall clock is compared (and here a tenfold rise is no regression)
    same_clock = run({("crowd", "reference"): (WALL, preempting(3, 100.0)),
                      ("crowd", "hf-cb"): (WALL, preempting(9, 5.0))})
    [r] = gate.gate(same_clock, cur, ["throughput:-10%"]).regressions
    assert r.basis == "ratio to reference" and r.engine == "hf-cb"


def test_a_gate_with_nothing_to_compare_on_one_clock_fails_and_says_why():
    base = run({("storm", "reference"): (STEP, preempting(17))})
    verdict = gate.gate(base, base, ["p99_tbt:+25%"])  # no result has a p99 TBT
    assert verdict.failed and verdict.nothing_compared and not verdict.set_aside
    [line] = verdict.failure_lines()
    assert line.startswith("NOTHING COMPARED no thresholded figure has a value in both runs")


def test_kvbench_compare_across_clocks_exits_1_naming_what_was_set_aside(tmp_path):
    from kvbench.cli import main

    base = run({("storm", "reference"): (STEP, preempting(17))}).save(tmp_path / "step.json")
    cur = run({("storm", "reference"): (WALL, preempting(17))}).save(tmp_path / "wall.json")
    out = io.StringIO()
    assert main(["compare", str(base), str(cur)], out=out) == 1
    text = out.getvalue()
    assert "NOTHING COMPARED" in text and "not compared, neither a pass nor a fail" in text
    assert "no regressions" not in text
    out = io.StringIO()
    assert main(["compare", str(base), str(base)], out=out) == 0, out.getvalue()


@pytest.mark.parametrize("result, expected", [
    ({}, ("wall", None)),  # a file from before clocks were recorded: the wall clock, as the report reads it
    ({"clock": None}, ("wall", None)),
    ({"clock": {"clock": "step", "step_seconds": 0.01}}, ("step", 0.01)),
    ({"clock": {"clock": "wall", "step_seconds": None}}, ("wall", None)),
])
def test_clock_of(result, expected):
    assert gate.clock_of(result) == expected
