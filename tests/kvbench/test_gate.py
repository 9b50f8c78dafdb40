"""Threshold expressions and the regression gate."""

from __future__ import annotations

import math

import pytest

from kvbench.bench import gate
from kvbench.bench.gate import Regression, ThresholdError, compare, parse_threshold
from kvbench.bench.results import Results


def run(**by_key: dict) -> Results:
    """Results with one result per ``scenario__engine`` keyword (``__mode`` optional)."""
    res = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    for key, metrics in by_key.items():
        scenario, engine, *mode = key.split("__")
        res.add_scenario_result(scenario, engine, metrics, mode=mode[0] if mode else None)
    return res


@pytest.mark.parametrize("expr, metric, direction, limit, relative", [
    ("throughput:-10%", "output_throughput", -1, 10.0, True),
    ("p99_tbt:+20%", "tbt_p99", 1, 20.0, True),
    ("preemptions:+0", "preemptions", 1, 0.0, False),
    ("throughput:10%", "output_throughput", -1, 10.0, True),  # no sign: the bad direction
    ("ttft:5%", "ttft_p99", 1, 5.0, True),
    ("p50_e2e:+0.5", "e2e_p50", 1, 0.5, False),
    ("tbt_p90:+1.5%", "tbt_p90", 1, 1.5, True),
    (" hit_rate : -.5% ", "prefix_hit_rate", -1, 0.5, True),
    ("goodput:-1%", "goodput", -1, 1.0, True),
])
def test_parse(expr, metric, direction, limit, relative):
    th = parse_threshold(expr)
    assert (th.metric, th.direction, th.limit, th.relative) == (metric, direction, limit, relative)


@pytest.mark.parametrize("expr, message", [
    ("throughput", "expected \\[abs:\\]NAME:"),
    ("throughput:-ten%", "expected \\[abs:\\]NAME:"),
    ("throughput:--10%", "expected \\[abs:\\]NAME:"),
    ("latency:+10%", "unknown metric 'latency'"),
    ("p42_foo:+1", "unknown metric"),
])
def test_parse_errors_are_clear(expr, message):
    with pytest.raises(ThresholdError, match=message):
        parse_threshold(expr)


def test_relative_drop_and_rise():
    base = run(storm__ref={"output_throughput": 100.0, "tbt_p99": 0.100})
    cur = run(storm__ref={"output_throughput": 89.0, "tbt_p99": 0.119})
    regs = compare(cur, base, ["throughput:-10%", "p99_tbt:+20%"], absolute=True)
    assert [(r.metric, r.baseline, r.current) for r in regs] == [("output_throughput", 100.0, 89.0)]
    r = regs[0]
    assert isinstance(r, Regression) and r.scenario == "storm" and r.engine == "ref"
    assert r.change == pytest.approx(-0.11) and str(r.threshold) == "throughput:-10%"
    # one run, no repeats: no spread, so the noise floor is its minimum share of the baseline (10%)
    assert r.describe() == ("storm / ref: output_throughput 100 -> 89 (-11.0%; threshold throughput:-10%, "
                            "noise floor 10)")
    assert compare(run(storm__ref={"output_throughput": 90.0}), base, ["throughput:-10%"], absolute=True) == []


def test_improvements_never_fail():  # absolute: no reference engine to divide by
    base = run(s__e={"output_throughput": 100.0, "tbt_p99": 0.1, "preemptions": 5})
    cur = run(s__e={"output_throughput": 200.0, "tbt_p99": 0.01, "preemptions": 0})
    assert compare(cur, base, ["throughput:-1%", "p99_tbt:+1%", "preemptions:+0"], absolute=True) == []


def test_absolute_threshold_and_zero_baseline():
    base = run(s__e={"preemptions": 0.0})
    cur = run(s__e={"preemptions": 3.0})
    [r] = compare(cur, base, ["preemptions:+0"])
    assert r.change == 3.0
    [r] = compare(cur, base, ["preemptions:+50%"])
    assert math.isinf(r.change) and gate.format_change(r) == "new"
    assert compare(cur, base, ["preemptions:+3"]) == []


def test_matched_per_scenario_engine_and_mode_and_missing_values_skipped():
    base = run(storm__a={"output_throughput": 100.0}, storm__b={"output_throughput": 100.0},
               chunk__a__chunked={"output_throughput": 100.0}, chunk__a__unchunked={"output_throughput": 100.0})
    cur = run(storm__a={"output_throughput": 50.0}, storm__b={"output_throughput": None},
              chunk__a__chunked={"output_throughput": 100.0}, chunk__a__unchunked={"output_throughput": 10.0},
              storm__c={"output_throughput": 1.0})
    regs = compare(cur, base, ["throughput:-10%"], absolute=True)
    assert [(r.scenario, r.engine, r.mode) for r in regs] == [("storm", "a", None), ("chunk", "a", "unchunked")]
    only_cur, only_base = gate.unmatched(cur, base)
    assert only_cur == [("storm", "c", None)] and only_base == []
    assert len(gate.common_keys(cur, base)) == 4


def test_deltas_list_every_compared_metric():
    base = run(s__e={"output_throughput": 100.0, "tbt_p99": 0.1})
    cur = run(s__e={"output_throughput": 95.0, "tbt_p99": 0.1})
    ds = gate.deltas(cur, base, gate.DEFAULT_THRESHOLDS, absolute=True)
    assert [(d.metric, d.regressed) for d in ds] == [("output_throughput", False), ("tbt_p99", False)]


def test_every_short_name_resolves_to_a_metric_key():
    from kvbench.bench.metrics import METRIC_KEYS

    for short, key in gate.SHORT_NAMES.items():
        assert gate.resolve_metric(short) == key and key in METRIC_KEYS


# ------------------------------------------------------------------------------------------------
# repeats, exact counts, ratios, missing results


def repeated(runs: dict[tuple, list[dict]], *, step: bool = True, kinds: dict[str, str] | None = None) -> Results:
    """Results from per-repeat metric dicts keyed (scenario, engine, mode), recorded as the runner does."""
    from kvbench.bench.repeats import aggregate

    res = Results(data={"schema_version": 1, "engines": [], "scenarios": []})
    for (scenario, engine, mode), reps in runs.items():
        medians, spreads = aggregate(reps)
        res.add_scenario_result(scenario, {"name": engine, "kind": (kinds or {}).get(engine, "reference")}, medians,
                                mode=mode, repeats=reps, spread=spreads,
                                clock={"clock": "step" if step else "wall", "step_seconds": 0.01 if step else None,
                                       "exact_counts": step})
    return res


def test_counts_from_step_clock_runs_are_compared_exactly():
    base = repeated({("storm", "reference", None): [{"preemptions": 17}] * 3})
    same = repeated({("storm", "reference", None): [{"preemptions": 17}] * 3})
    one_more = repeated({("storm", "reference", None): [{"preemptions": 18}] * 3})
    assert not gate.gate(same, base, ["preemptions:+0"]).failed
    verdict = gate.gate(one_more, base, ["preemptions:+0"])
    [d] = verdict.regressions
    assert d.basis == "exact" and d.noise == 0 and (d.baseline, d.current) == (17, 18)
    assert "storm / reference: preemptions 17 -> 18" in verdict.failure_lines()[0]


def test_wall_clock_counts_are_gated_with_statistics():
    """hf-cb style: counts vary with timing; a change inside the noise floor is not a regression."""
    base = repeated({("storm", "reference", None): [{"preemptions": p} for p in (17, 20, 18)]}, step=False)
    cur = repeated({("storm", "reference", None): [{"preemptions": p} for p in (19, 22, 20)]}, step=False)
    [d] = gate.gate(cur, base, ["preemptions:+0"]).deltas
    assert d.basis == "absolute" and d.noise == pytest.approx(3 * ((1.5**2 + 1.5**2) / 2) ** 0.5)
    assert not d.regressed and d.within_noise
    far = repeated({("storm", "reference", None): [{"preemptions": p} for p in (40, 42, 41)]}, step=False)
    assert gate.gate(far, base, ["preemptions:+0"]).failed


def test_noise_floor_and_threshold_must_both_be_exceeded():
    def run_(tputs: list[float]) -> Results:
        return repeated({("s", "reference", None): [{"output_throughput": t} for t in tputs]})

    noisy_base, noisy_cur = run_([100.0, 80.0, 120.0]), run_([85.0, 70.0, 100.0])  # -15%, spread 20 and 15
    [d] = gate.gate(noisy_cur, noisy_base, ["throughput:-10%"], absolute=True).deltas
    assert d.threshold.violated(d.baseline, d.current) and not d.regressed  # 15 < 3 x 17.7
    quiet_base, quiet_cur = run_([100.0, 99.0, 101.0]), run_([85.0, 84.0, 86.0])
    [d] = gate.gate(quiet_cur, quiet_base, ["throughput:-10%"], absolute=True).deltas
    assert d.regressed and d.noise == pytest.approx(10.0)  # 3 x 1 pooled spread, raised to 10% of 100
    assert not gate.gate(quiet_cur, quiet_base, ["throughput:-20%"], absolute=True).failed  # noise alone is not enough
    assert gate.gate(noisy_cur, noisy_base, ["throughput:-10%"], absolute=True, noise_k=0).failed
    with pytest.raises(ValueError, match="noise_k"):
        gate.gate(quiet_cur, quiet_base, [], noise_k=-1)


def test_times_are_gated_as_ratios_to_the_reference_engine_by_default():
    kinds = {"reference": "reference", "hf-cb": "hf-cb"}
    # the whole machine got 30% slower: both engines' throughput dropped, their ratio did not
    base = repeated({("s", "reference", None): [{"output_throughput": v} for v in (100, 101, 99)],
                     ("s", "hf-cb", None): [{"output_throughput": v} for v in (50, 51, 49)]}, kinds=kinds)
    slow_machine = repeated({("s", "reference", None): [{"output_throughput": v} for v in (70, 71, 69)],
                             ("s", "hf-cb", None): [{"output_throughput": v} for v in (35, 35.5, 34.5)]}, kinds=kinds)
    verdict = gate.gate(slow_machine, base, ["throughput:-10%"])
    assert not verdict.failed
    [d] = verdict.deltas
    assert d.engine == "hf-cb" and d.basis == "ratio to reference" and d.baseline == pytest.approx(0.5)
    assert any("times of reference are not gated" in n for n in verdict.notes)
    assert gate.gate(slow_machine, base, ["throughput:-10%"], absolute=True).failed  # asked for absolute times
    assert gate.gate(slow_machine, base, ["abs:throughput:-10%"]).failed  # ... or per threshold
    # hf-cb alone got slower: the ratio drops and the gate names it
    hf_slower = repeated({("s", "reference", None): [{"output_throughput": v} for v in (100, 101, 99)],
                          ("s", "hf-cb", None): [{"output_throughput": v} for v in (40, 41, 39)]}, kinds=kinds)
    [r] = gate.gate(hf_slower, base, ["throughput:-10%"]).regressions
    assert "hf-cb: output_throughput (ratio to reference) 0.5 -> 0.4" in r.describe()


def test_threshold_in_the_metric_unit_is_absolute():
    assert parse_threshold("p50_e2e:+0.5").absolute and not parse_threshold("p50_e2e:+5%").absolute
    assert parse_threshold("abs: throughput:-10%").absolute


@pytest.mark.parametrize("drop, named", [
    (("flash_crowd", "reference", None), "missing from the current run: flash_crowd / reference (in the baseline)"),
    (("chunk", "reference", "chunked"), "missing from the current run: chunk / reference [chunked] (in the baseline)"),
])
def test_a_result_missing_from_the_current_run_fails_and_is_named(drop, named):
    runs = {("flash_crowd", "reference", None): [{"preemptions": 3}], ("chunk", "reference", "chunked"):
            [{"preemptions": 1}], ("chunk", "reference", "unchunked"): [{"preemptions": 0}]}
    base = repeated(runs)
    cur = repeated({k: v for k, v in runs.items() if k != drop})
    verdict = gate.gate(cur, base, ["preemptions:+0"])
    assert verdict.failed and not verdict.regressions
    assert [m.describe() for m in verdict.missing] == [named]
    assert verdict.summary() == "regression gate failed: 1 missing result"
    assert not gate.gate(base, cur, ["preemptions:+0"]).failed  # a new result is only a note
    assert gate.gate(base, cur, ["preemptions:+0"]).notes


def test_a_metric_missing_from_the_current_run_fails_and_is_named():
    base = repeated({("s", "reference", None): [{"preemptions": 3, "tbt_p99": 0.1}]})
    cur = repeated({("s", "reference", None): [{"preemptions": 3, "tbt_p99": None}]})
    verdict = gate.gate(cur, base, ["preemptions:+0", "p99_tbt:+20%"], absolute=True)
    assert [m.describe() for m in verdict.missing] == [
        "missing from the current run: s / reference: tbt_p99 (has a value in the baseline)"]


def test_the_same_results_gated_against_themselves_pass():
    runs = {("s", "reference", None): [{"preemptions": 3, "output_throughput": v, "tbt_p99": 0.1} for v in (9, 10, 11)],
            ("s", "reference:preemption_mode=swap", None): [{"preemptions": 2, "output_throughput": v,
                                                            "tbt_p99": 0.2} for v in (5, 6, 7)]}
    verdict = gate.gate(repeated(runs), repeated(runs), gate.DEFAULT_THRESHOLDS)
    assert not verdict.failed and verdict.deltas
    assert verdict.summary().startswith("no regression")
