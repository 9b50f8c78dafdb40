"""Metrics on hand-built traces whose every figure is known."""

from __future__ import annotations

import json

import pytest

from kvbench.bench import metrics
from kvbench.bench.metrics import SLOError, crossover, knee, parse_slos, summarize
from tests.kvbench.trace_factory import make_trace, req, simulate, step

approx = pytest.approx


@pytest.fixture
def storm():
    """Three requests over 4 s.

    a: arrives 0, tokens 1.0 1.1 1.2 1.3 (TTFT 1.0, gaps 0.1 x3)
    b: arrives 0.5, tokens 1.0 1.1 | preempted (recompute) at 1.5, resumed 2.0 | 2.1 2.2
    c: arrives 1.0, never served
    """
    a = req("a", 0.0, [1.0, 1.1, 1.2, 1.3], prompt_len=10)
    b = req("b", 0.5, [1.0, 1.1, 2.1, 2.2], prompt_len=20, preemptions=[(1.5, "recompute")], resumes=[2.0],
            recomputed=22)
    c = req("c", 1.0, [], prompt_len=5, max_tokens=4)
    steps = [step(1.0, 1.0, running=2, waiting=1, kv=0.5, prefill=30, decode=0),
             step(2.0, 1.0, running=1, waiting=1, kv=1.0, prefill=22, decode=1, preempted=1),
             step(3.0, 2.0, running=1, waiting=0, kv=0.96, prefill=0, decode=1)]
    return make_trace(a, b, c, steps=steps, duration=4.0)


def test_throughput_and_counts(storm):
    m = summarize(storm)
    assert m["requests"] == 3 and m["requests_finished"] == 2
    assert m["output_tokens"] == 8 and m["prompt_tokens"] == 35
    assert m["output_throughput"] == approx(8 / 4)
    assert m["total_throughput"] == approx((8 + 10 + 20) / 4)  # c produced nothing: its prompt is not served
    assert m["request_throughput"] == approx(2 / 4)


def test_latency_percentiles(storm):
    m = summarize(storm)
    assert m["ttft_p50"] == approx(0.75) and m["ttft_max"] == approx(1.0) and m["ttft_mean"] == approx(0.75)
    assert m["tbt_p50"] == approx(0.1) and m["tbt_max"] == approx(1.0) and m["tbt_mean"] == approx(1.5 / 6)
    assert m["tbt_p99"] == approx(0.1 + 0.95 * 0.9)  # numpy linear interpolation between the two top gaps
    assert m["tpot_max"] == approx(1.2 / 3) and m["tpot_p50"] == approx((0.1 + 0.4) / 2)
    assert m["e2e_p50"] == approx(1.5) and m["e2e_max"] == approx(1.7)


def test_preemptions_starvation_and_recompute(storm):
    m = summarize(storm)
    assert m["preemptions"] == 1 and m["preemptions_recompute"] == 1 and m["preemptions_swap"] == 0
    assert m["preemptions_per_s"] == approx(0.25)
    assert m["preempted_request_share"] == approx(1 / 3) and m["max_preemptions_per_request"] == 1
    assert m["preemption_active_share"] == approx(0.1)  # one of ten windows
    assert m["starvation_max_s"] == approx(0.5) and m["starvation_mean_s"] == approx(0.5)
    assert m["recomputed_tokens"] == 22
    assert m["computed_tokens"] == 54  # from the steps: 30 + 22 + 1 + 1
    assert m["recomputed_share"] == approx(22 / 54)


def test_spikes_attributed_to_preemption(storm):
    m = summarize(storm)
    assert m["tbt_spike_threshold_s"] == approx(0.5)  # 5 x median positive gap
    assert m["tbt_spikes"] == 1 and m["tbt_spike_share"] == approx(1 / 6)
    assert m["tbt_spikes_preemption_share"] == 1.0
    assert m["tbt_spikes_prefill_share"] == 0.0 and m["tbt_spikes_other_share"] == 0.0


def test_spike_attributed_to_coscheduled_prefill():
    a = req("a", 0.0, [0.1, 0.2, 0.3, 1.3, 1.4])
    steps = [step(0.1), step(0.2), step(0.3), step(1.3, 1.0, prefill=500), step(1.4)]
    m = summarize(make_trace(a, steps=steps))
    assert m["tbt_spikes"] == 1
    assert m["tbt_spikes_prefill_share"] == 1.0 and m["tbt_spikes_preemption_share"] == 0.0


def test_spike_with_no_cause_is_other():
    a = req("a", 0.0, [0.1, 0.2, 0.3, 1.3, 1.4])
    m = summarize(make_trace(a, steps=[step(0.1), step(1.3, 1.0)]))
    assert m["tbt_spikes_other_share"] == 1.0


def test_kv_and_queue_stats_are_time_weighted(storm):
    m = summarize(storm)
    assert m["kv_usage_mean"] == approx((0.5 * 1 + 1.0 * 1 + 0.96 * 2) / 4)
    assert m["kv_usage_max"] == 1.0
    assert m["kv_usage_time_over_95"] == approx(3 / 4)
    assert m["running_mean"] == approx((2 + 1 + 2) / 4) and m["running_max"] == 2
    assert m["waiting_mean"] == approx(0.5) and m["waiting_max"] == 1
    assert m["steps"] == 3 and m["step_duration_mean"] == approx(4 / 3)
    assert m["cpu_kv_usage_mean"] is None  # never reported


def test_goodput(storm):
    share, rps = metrics.goodput(storm, "ttft<=1.0")
    assert share == approx(2 / 3) and rps == approx(0.5)
    assert metrics.goodput(storm, "ttft<=1.0,tbt<=0.5")[0] == approx(1 / 3)  # b's 1 s gap fails
    assert metrics.goodput(storm, "e2e<=1500ms")[0] == approx(1 / 3)
    m = summarize(storm, slos={"ttft": 1.0})
    assert m["goodput"] == approx(2 / 3)
    assert "goodput" not in summarize(storm)


def test_goodput_leaves_out_deliberate_aborts():
    ok = req("ok", 0.0, [0.1, 0.2])
    aborted = req("x", 0.0, [0.1], reason="abort")
    assert metrics.goodput(make_trace(ok, aborted, duration=1.0), "ttft<=1")[0] == 1.0


@pytest.mark.parametrize("bad", ["ttft<0.5", "ttft<=abc", "latency<=1", "ttft<=0", "ttft"])
def test_bad_slos_are_rejected_with_a_clear_error(bad):
    with pytest.raises(SLOError, match="SLO"):
        parse_slos(bad)


def test_parse_slos_units():
    assert parse_slos("ttft<=0.5, tbt<=100ms") == {"ttft": 0.5, "tbt": approx(0.1)}
    assert parse_slos(None) == {} and parse_slos("") == {}


def test_engine_counters_win_over_request_records(storm):
    storm.counters = {"preemptions_recompute": 3, "preemptions_swap": 2, "recomputed_tokens": 100,
                      "computed_tokens": 1000}
    m = summarize(storm)
    assert m["preemptions"] == 5 and m["preemptions_swap"] == 2
    assert m["recomputed_share"] == approx(0.1)


def test_counted_but_unrecorded_preemptions_leave_per_request_figures_unknown():
    a = req("a", 0.0, [0.1, 0.2, 0.3])
    m = summarize(make_trace(a, counters={"preemptions_recompute": 4}, duration=1.0))
    assert m["preemptions"] == 4
    assert m["preempted_request_share"] is None and m["starvation_max_s"] is None


def test_not_exposed_gives_none_not_zero():
    a = req("a", 0.0, [0.1, 0.2])
    m = summarize(make_trace(a, not_exposed={"preemptions": "no events", "recomputed_tokens": "n/a",
                                             "prefix_cache": "n/a"}, duration=1.0))
    for key in ("preemptions", "preemptions_per_s", "preempted_request_share", "starvation_max_s",
                "recomputed_tokens", "recomputed_share", "prefix_hit_rate", "swap_bandwidth", "kv_usage_mean"):
        assert m[key] is None, key


def test_swap_and_prefix_from_counters():
    a = req("a", 0.0, [0.1, 0.2])
    m = summarize(make_trace(a, counters={"swapped_out_bytes": 1000, "swapped_in_bytes": 3000, "swap_seconds": 2,
                                          "prefix_cache_hits": 30, "prefix_cache_queries": 120,
                                          "swap_fallbacks": 1}, duration=1.0))
    assert m["swap_bandwidth"] == approx(2000) and m["swap_fallbacks"] == 1
    assert m["prefix_hit_rate"] == approx(0.25)


def test_prefix_hit_rate_from_requests_without_counters():
    m = summarize(make_trace(req("a", 0, [1], prompt_len=40, prefix_hits=30), req("b", 0, [1], prompt_len=60),
                             duration=1.0))
    assert m["prefix_hit_rate"] == approx(30 / 100)


def test_starvation_without_resume_records_ends_at_next_token():
    a = req("a", 0.0, [0.1, 0.2, 1.2], preemptions=[(0.25, "swap")])
    assert summarize(make_trace(a, duration=2.0))["starvation_max_s"] == approx(0.95)


def test_starvation_of_a_request_never_resumed_lasts_to_the_end():
    a = req("a", 0.0, [0.1], preemptions=[(0.5, "recompute")], finished=None)
    assert metrics.preemption_waits(make_trace(a, duration=3.0)) == [approx(2.5)]


def test_empty_trace_is_all_none_or_zero_and_json_friendly():
    m = summarize(make_trace())
    assert set(m) == set(metrics.METRIC_KEYS)
    assert m["output_throughput"] is None and m["ttft_p99"] is None and m["tbt_spikes"] is None
    json.dumps(m, allow_nan=False)


def test_summary_of_a_simulated_storm_is_consistent():
    tr = simulate(30, seed=1, rate=100, capacity_tokens=1500, max_num_seqs=16, max_tokens=(32, 64))
    m = summarize(tr, "ttft<=1")
    json.dumps(m, allow_nan=False)
    assert m["preemptions"] == tr.counters["preemptions_recompute"] > 0
    assert m["output_tokens"] == sum(r.max_tokens for r in tr.requests.values())
    assert 0 <= m["goodput"] <= 1 and m["kv_usage_max"] <= 1.0


def test_series_shapes_and_downsampling():
    tr = simulate(30, seed=1, rate=100, capacity_tokens=1500, max_num_seqs=16, max_tokens=(32, 64))
    s = metrics.series(tr, max_points=40)
    assert len(s["t"]) <= 40 and len(s["t"]) == len(s["kv_usage"]) == len(s["num_waiting"])
    assert len(s["gap_t"]) == len(s["gap_max"]) <= 40
    assert max(s["gap_max"]) == approx(summarize(tr)["tbt_max"])  # downsampling keeps the worst gap
    assert len(s["preempt_t"]) == len(s["preempt_mode"]) == tr.counters["preemptions_recompute"]
    assert s["ttft_cdf_p"][-1] == 1.0 and s["tbt_cdf_x"] == sorted(s["tbt_cdf_x"])
    assert sum(s["throughput"]) * (tr.duration / len(s["throughput"])) == approx(
        sum(len(r.token_times) for r in tr.requests.values()))
    json.dumps(s, allow_nan=False)


def test_series_of_a_small_trace_keeps_every_step(storm):
    s = metrics.series(storm)
    assert s["t"] == [1.0, 2.0, 3.0] and s["kv_usage"] == [0.5, 1.0, 0.96]
    assert s["preempt_t"] == [1.5] and s["preempt_mode"] == ["recompute"]


def test_knee_rule():
    assert knee([1, 2, 4, 8, 16], [100, 190, 300, 310, 280]) == 4  # 300 -> 310 gains < 5%
    assert knee([16, 1, 4, 2, 8], [280, 100, 300, 190, 310]) == 4  # order does not matter
    assert knee([1, 2, 4], [10, 20, 40]) == 4  # still rising: the last point
    assert knee([1, 2, 4], [10, None, 9]) == 1
    assert knee([], []) is None


def test_crossover():
    assert crossover([128, 256, 512], [1, 2, 4], [2, 2.5, 3]) == approx(256 + 256 * 0.5 / 1.5)
    assert crossover([1, 2, 3], [1, 2, 3], [2, 3, 4]) is None
    assert crossover([1, 2, 3], [1, 5, 3], [2, 5, 4]) == 2  # equal at a point
    assert crossover([3, 1, 2], [3, 1, 2], [2.5, 2, 2.5]) == approx(2.5)  # unsorted input
