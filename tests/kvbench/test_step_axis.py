"""A step-clock timeline is drawn on the workload's own seconds and says how long a step took: the surge
that the workload starts at 3 s is drawn at 3 s, not where the engine's fast steps reached it on the wall
(the issue's "traffic doubled at t=3s" drawn at 0.26 s)."""

from __future__ import annotations

import re

from kvbench.report.render import _Charts
from tests.kvbench.trace_factory import synthetic_results

STORM = "preemption_storm"


def _stepped(clock: str = "step"):
    res = synthetic_results()
    sc = res.scenario(STORM)
    sc["parameters"] = {"workload": "Poisson arrivals", "surge_start_s": 3.0}
    for r in sc["results"]:
        r["clock"] = {"clock": clock, "step_seconds": 0.01 if clock == "step" else None}
        r["metrics"]["step_duration_mean"] = 0.0011
        s = r["series"]
        # each step took about a tenth of the 10 ms of workload it stands for
        s["workload_t"] = [t * 10 for t in s["t"]]
    return res, sc


def _x_of_vline(chart: str) -> float:
    m = re.search(r'<line x1="([\d.]+)"[^>]*class="c-vline"', chart)
    assert m, "no event line drawn"
    return float(m.group(1))


def test_step_clock_timelines_are_on_workload_seconds_with_the_measured_step_time_beside():
    res, sc = _stepped()
    gap = str(_Charts(res).timelines(sc)[0])
    assert "workload time (s, by engine step)" in gap
    subtitle = " ".join(re.findall(r'class="c-sub">(.*?)</text>', gap))
    assert "1 step = 10 ms of workload, measured 1.1 ms" in subtitle
    # marks land on workload seconds: each preemption at ten times its trace time, as the steps' mapping says
    raw = sc["results"][0]["series"]["preempt_t"]
    shown = [float(x) for x in re.findall(r"reference: preempted \(\w+\) at ([\d.]+) s", gap)]
    assert shown and all(any(abs(x - 10 * t) < 2e-3 for t in raw) for x in shown)
    # and the surge line sits where the workload's 3 s is on that axis, as on a wall-clock chart stretched alike
    wall_res, wall_sc = _stepped("wall")
    for r in wall_sc["results"]:  # the wall clock's trace times are the workload's: stretch them as above
        s = r["series"]
        for key in ("t", "gap_t", "throughput_t", "preempt_t"):
            s[key] = [t * 10 for t in s.get(key, [])]
    wall_gap = str(_Charts(wall_res).timelines(wall_sc)[0])
    assert "time (s)" in wall_gap and "workload time" not in wall_gap
    assert abs(_x_of_vline(gap) - _x_of_vline(wall_gap)) < 1.0
