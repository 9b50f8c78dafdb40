"""Each engine on its clock: a scenario's timelines are one chart per metric with the engines overlaid on
one scale, never overlaying two clocks (each clock its own chart, same y scale, saying why), and the
scenario's event (a surge's start) marked where each run reached it."""

from __future__ import annotations

import re

from kvbench.report.render import _Charts, _event_time, render_report
from tests.kvbench.trace_factory import synthetic_results

STORM = "preemption_storm"
STORM_TITLE = "Preemption storm"  # how the report titles it (kvbench.report.words.scenario_title)


def storm(clocks: tuple[str, str], surge: float | None = None):
    res = synthetic_results()
    sc = res.scenario(STORM)
    for r, clock in zip(sc["results"], clocks, strict=True):
        r["clock"] = {"clock": clock}
    # the storm's workload released arrivals by time (the default parameters say nothing of a closed loop)
    sc["parameters"] = {"workload": "Poisson arrivals"}
    if surge is not None:
        sc["parameters"]["surge_start_s"] = surge
    return res, sc


def titles(charts) -> list[str]:
    return [re.search(r"<title>(.*?)</title>", str(c)).group(1) for c in charts]


def top_tick(chart) -> float:
    """The highest y tick label of a chart (right-aligned tick texts)."""
    ticks = re.findall(r'<text x="\d+" y="[\d.]+" class="c-tick" text-anchor="end">([\d,.]+)</text>', str(chart))
    return max(float(t.replace(",", "")) for t in ticks)


def test_one_chart_per_metric_with_every_engine_overlaid():
    res, sc = storm(("wall", "wall"))
    charts = _Charts(res).timelines(sc)
    assert titles(charts) == [f"{t} — {STORM_TITLE}" for t in ("Longest token gap", "Output throughput", "KV usage",
                                                          "Waiting requests")]
    for c in charts:  # both engines' lines in each, told apart in the legend
        assert "reference" in str(c) and "other" in str(c) and 'class="lg-key"' in str(c)


def test_two_clocks_are_never_overlaid_and_share_one_scale():
    res, sc = storm(("step", "wall"))
    charts = _Charts(res).timelines(sc)
    names = titles(charts)
    assert all(f"Output throughput ({c} clock) — {STORM_TITLE}" in names for c in ("step", "wall"))
    step_c, wall_c = (charts[names.index(f"Output throughput ({c} clock) — {STORM_TITLE}")] for c in ("step", "wall"))
    assert "not comparable" in str(step_c) and "not comparable" in str(wall_c)
    assert top_tick(step_c) == top_tick(wall_c)  # one scale per metric
    series = {c: set(re.findall(r'<polyline[^>]*><title>(.*?)</title>', str(ch))) for c, ch in (("step", step_c),
                                                                                          ("wall", wall_c))}
    assert series == {"step": {"reference"}, "wall": {"other"}}
    page = render_report(res)
    assert "TTFT distribution (step clock)" in page and "TTFT distribution (wall clock)" in page


def test_the_surge_start_is_marked_on_each_clock():
    res, sc = storm(("wall", "wall"), surge=0.5)
    gap = _Charts(res).timelines(sc)[0]
    assert "surge starts" in str(gap) and "at 0.5 s of the workload" in str(gap)
    # on the step clock, where the run's own timeline reached the workload's 0.5 s
    res, sc = storm(("step", "step"), surge=0.5)
    for r in sc["results"]:
        s = r["series"]
        s["workload_t"] = [t * 2 for t in s["t"]]  # the workload's clock ran twice as fast as the trace's
    ref = sc["results"][0]
    assert abs(_event_time(ref, 0.5) - min(t for t in ref["series"]["t"] if 2 * t >= 0.5)) < 1e-12
    gap = str(_Charts(res).timelines(sc)[0])
    assert "surge starts" in gap and 'class="c-vline"' in gap and "not on this axis" not in gap
    # an older step-clock result without workload_t: no mark at a wrong place
    for r in sc["results"]:
        del r["series"]["workload_t"]
    gap = str(_Charts(res).timelines(sc)[0])
    assert 'class="c-vline"' not in gap and "not on this axis" in gap


def test_step_clock_series_carry_the_workload_clock():
    from kvbench.bench import metrics
    from tests.kvbench.trace_factory import make_trace, req, step

    steps = [step(0.1 * (i + 1)) for i in range(5)]
    for i, st in enumerate(steps):
        st.virtual_t = 0.01 * i  # 0.01 s of the workload per engine step
    trace = make_trace(req("r1", 0.0, [0.1, 0.2, 0.3]), steps=steps, duration=0.5)
    assert "workload_t" not in metrics.series(trace)  # the wall clock: t is the workload's time
    trace.step_seconds = 0.01
    s = metrics.series(trace)
    assert s["workload_t"] == [0.0, 0.01, 0.02, 0.03, 0.04] and len(s["workload_t"]) == len(s["t"])


def test_a_servers_metrics_are_drawn_on_the_timeline_only_where_a_server_was_sampled():
    """/metrics samples (running, preemptions so far, the prefix-cache hit rate of each interval) become their
    own timelines for the engine reached over HTTP; an engine in process draws no such line."""
    from kvbench.bench.metrics import series
    from kvbench.core.trace import StepRecord, Trace

    samples = [StepRecord(t=0.5 * i, duration=0.5, num_running=i, num_waiting=0, kv_usage=0.1 * i, sampled=True,
                          server_preemptions=[0, 0, 2, 5][i], server_prefix_hits=[0, 32, 32, 96][i],
                          server_prefix_queries=[0, 64, 64, 128][i]) for i in range(4)]
    s = series(Trace("server", STORM, steps=samples))
    assert s["server_t"] == [0.0, 0.5, 1.0, 1.5] and s["server_running"] == [0, 1, 2, 3]
    assert s["server_preemptions"] == [0, 0, 2, 5]
    assert s["server_prefix_hit_rate"] == [None, 0.5, None, 1.0]  # nothing looked up in between: no rate
    assert "server_t" not in series(Trace("in-process", STORM, steps=[StepRecord(t=0.5, duration=0.5,
                                                                                 num_running=1, num_waiting=0)]))
    res, sc = storm(("wall", "wall"))
    sc["results"][1]["series"].update(s)
    charts = _Charts(res).timelines(sc)
    names = titles(charts)
    for title in ("Running requests", "Preemptions so far", "Prefix-cache hit rate"):
        chart = charts[names.index(f"{title} (server /metrics) — {STORM_TITLE}")]
        assert set(re.findall(r"<polyline[^>]*><title>(.*?)</title>", str(chart))) == {"other"}
    del sc["results"][1]["series"]["server_t"], sc["results"][1]["series"]["server_running"]
    for key in ("server_preemptions", "server_prefix_hit_rate"):
        del sc["results"][1]["series"][key]
    assert not any("server /metrics" in t for t in titles(_Charts(res).timelines(sc)))


def test_sampled_steps_carry_the_servers_counts_since_the_first_sample():
    from kvbench.drivers.server_metrics import MetricsSnapshot, sampled_step

    def snap(preemptions: int, hits: int, queries: int) -> MetricsSnapshot:
        return MetricsSnapshot.parse(
            "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"
            f"vllm:num_preemptions_total {preemptions}\nvllm:prefix_cache_hits_total {hits}\n"
            f"vllm:prefix_cache_queries_total {queries}\n")

    first = snap(7, 100, 400)
    record = sampled_step(snap(10, 164, 528), 1.0, 0.25, first)
    assert (record.server_preemptions, record.server_prefix_hits, record.server_prefix_queries) == (3, 64, 128)
    bare = sampled_step(snap(10, 164, 528), 1.0, 0.25)
    assert bare.server_preemptions is None and bare.sampled
