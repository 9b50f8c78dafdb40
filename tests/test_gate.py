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
    ("throughput", "expected NAME:"),
    ("throughput:-ten%", "expected NAME:"),
    ("throughput:--10%", "expected NAME:"),
    ("latency:+10%", "unknown metric 'latency'"),
    ("p42_foo:+1", "unknown metric"),
])
def test_parse_errors_are_clear(expr, message):
    with pytest.raises(ThresholdError, match=message):
        parse_threshold(expr)


def test_relative_drop_and_rise():
    base = run(storm__ref={"output_throughput": 100.0, "tbt_p99": 0.100})
    cur = run(storm__ref={"output_throughput": 89.0, "tbt_p99": 0.119})
    regs = compare(cur, base, ["throughput:-10%", "p99_tbt:+20%"])
    assert [(r.metric, r.baseline, r.current) for r in regs] == [("output_throughput", 100.0, 89.0)]
    r = regs[0]
    assert isinstance(r, Regression) and r.scenario == "storm" and r.engine == "ref"
    assert r.change == pytest.approx(-0.11) and str(r.threshold) == "throughput:-10%"
    assert r.describe() == "storm / ref: output_throughput 100 -> 89 (-11.0%; threshold throughput:-10%)"
    assert compare(run(storm__ref={"output_throughput": 90.0}), base, ["throughput:-10%"]) == []  # exactly 10%


def test_improvements_never_fail():
    base = run(s__e={"output_throughput": 100.0, "tbt_p99": 0.1, "preemptions": 5})
    cur = run(s__e={"output_throughput": 200.0, "tbt_p99": 0.01, "preemptions": 0})
    assert compare(cur, base, ["throughput:-1%", "p99_tbt:+1%", "preemptions:+0"]) == []


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
    regs = compare(cur, base, ["throughput:-10%"])
    assert [(r.scenario, r.engine, r.mode) for r in regs] == [("storm", "a", None), ("chunk", "a", "unchunked")]
    only_cur, only_base = gate.unmatched(cur, base)
    assert only_cur == [("storm", "c", None)] and only_base == []
    assert len(gate.common_keys(cur, base)) == 4


def test_deltas_list_every_compared_metric():
    base = run(s__e={"output_throughput": 100.0, "tbt_p99": 0.1})
    cur = run(s__e={"output_throughput": 95.0, "tbt_p99": 0.1})
    ds = gate.deltas(cur, base, gate.DEFAULT_THRESHOLDS)
    assert [(d.metric, d.regressed) for d in ds] == [("output_throughput", False), ("tbt_p99", False)]


def test_every_short_name_resolves_to_a_metric_key():
    from kvbench.bench.metrics import METRIC_KEYS

    for short, key in gate.SHORT_NAMES.items():
        assert gate.resolve_metric(short) == key and key in METRIC_KEYS
