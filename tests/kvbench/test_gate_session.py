"""The gate as a pytest session meets it: a failing gate is a failed item and pytest's last line says so."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

#: a test that records one benchmark result into the session's results, as the storm benchmarks do
RECORDING_TEST = """
def test_records(kvbench_results):
    kvbench_results.add_scenario_result(
        "storm", {"name": "reference", "kind": "reference"}, {"preemptions": PREEMPTIONS},
        repeats=[{"preemptions": PREEMPTIONS}] * 3, clock={"clock": "step", "step_seconds": 0.01, "exact_counts": True})
"""


def baseline(path, results: dict[tuple[str, str], float], clock: str = "step") -> str:
    scenarios: dict[str, list] = {}
    for (scenario, engine), preemptions in results.items():
        scenarios.setdefault(scenario, []).append(
            {"engine": engine, "metrics": {"preemptions": preemptions}, "repeats": [{"preemptions": preemptions}] * 3,
             "clock": {"clock": clock, "step_seconds": 0.01 if clock == "step" else None,
                       "exact_counts": clock == "step"}})
    data = {"schema_version": 1, "engines": [{"name": "reference", "kind": "reference"}],
            "scenarios": [{"name": n, "results": r} for n, r in scenarios.items()]}
    path.write_text(json.dumps(data))
    return str(path)


def run(pytester: pytest.Pytester, preemptions: int, base: str) -> pytest.RunResult:
    pytester.makepyfile(RECORDING_TEST.replace("PREEMPTIONS", str(preemptions)))
    return pytester.runpytest_subprocess("--baseline", base, "--report-dir",
                                         str(pytester.path / "reports"), "-p", "no:cacheprovider")


def test_same_results_pass_and_the_last_line_is_green(pytester: pytest.Pytester):
    result = run(pytester, 17, baseline(pytester.path / "b.json", {("storm", "reference"): 17}))
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*no regression (1 comparisons, 1 exact counts) against*", "*1 passed*"])


def test_a_regression_and_a_missing_result_fail_the_session_named_and_counted(pytester: pytest.Pytester):
    base = baseline(pytester.path / "b.json", {("storm", "reference"): 17, ("flash_crowd", "reference"): 3})
    result = run(pytester, 18, base)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*REGRESSION storm / reference: preemptions 17 -> 18*",
                                 "*MISSING missing from the current run: flash_crowd / reference (in the baseline)*"])
    result.stdout.fnmatch_lines(["FAILED kvbench::regression-gate*"])
    assert "1 failed, 1 passed" in result.stdout.lines[-1]  # the gate counts; the last line is not "1 passed"


def test_a_baseline_on_another_clock_fails_the_session_as_nothing_compared(pytester: pytest.Pytester):
    """A wall-clock baseline (a session with a server or hf-cb) against a step-clock run: nothing may be compared,
    and a gate that compared nothing must not end green."""
    result = run(pytester, 17, baseline(pytester.path / "b.json", {("storm", "reference"): 17}, clock="wall"))
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*NOTHING COMPARED no figure of the baseline could be compared*",
                                 "*not compared, neither a pass nor a fail (the baseline measured it on the wall "
                                 "clock, this run on the step clock (0.01 s a step)): storm / reference*"])
    assert "1 failed, 1 passed" in result.stdout.lines[-1]
