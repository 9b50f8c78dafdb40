"""The report's "Simulator vs measured" section: errors, medians, the goal, counts by clock, escaping."""

from __future__ import annotations

import re

import pytest

from kvbench.bench.results import Results
from kvbench.report import sim_validation as sv
from kvbench.report.render import render_report, write_report

SIM = "sim:clock=step,hardware=fit.json"
SIM_COST = "sim:hardware=fit.json"
EVIL = "<script>alert(1)</script>"

#: measured figures of two scenarios (one with two modes)
MEASURED = {
    ("storm", "recompute"): {"output_throughput": 100.0, "ttft_p50": 0.2, "ttft_p99": 1.0, "tbt_p99": 0.05,
                             "preemptions_recompute": 7, "preemptions_swap": 0, "recomputed_tokens": 300},
    ("storm", "swap"): {"output_throughput": 80.0, "ttft_p50": 0.4, "ttft_p99": 2.0, "tbt_p99": 0.10,
                        "preemptions_recompute": 0, "preemptions_swap": 5, "recomputed_tokens": 0},
    ("surge", None): {"output_throughput": 50.0, "ttft_p50": 0.1, "ttft_p99": 0.5, "tbt_p99": 0.02,
                      "preemptions_recompute": 0, "preemptions_swap": 0, "recomputed_tokens": 0},
}
TIMES = sv.TIMING_METRICS


def sim_engine(name: str = SIM, clock: str | None = "step") -> dict:
    desc = {"name": name, "kind": "sim", "simulated": True}
    return desc if clock is None else {**desc, "clock": clock}


def results_with(factors: dict[str, float], *, sim: dict | None = None, measured: str | dict = "reference",
                 counts: dict[str, float] | None = None, measured_clock: str = "step") -> Results:
    """A measured engine with :data:`MEASURED` and a simulated one whose timing metric ``k`` is the
    measured value times ``factors[k]`` (1 when absent) and whose counts are ``counts`` where given."""
    res = Results(device="cpu")
    sim = sim or sim_engine()
    for (scenario, mode), figures in MEASURED.items():
        res.add_scenario_result(scenario, measured, figures, mode=mode,
                                clock={"clock": measured_clock, "step_seconds": 0.01})
        simulated = {k: v * factors.get(k, 1.0) if k in TIMES else (counts or {}).get(k, v)
                     for k, v in figures.items()}
        res.add_scenario_result(scenario, sim, simulated, mode=mode, clock={"clock": "step", "step_seconds": 0.01})
    return res


def test_relative_errors_and_medians_are_computed_per_metric_and_pooled():
    res = Results(device="cpu")
    for i, (meas, sim) in enumerate([(100.0, 110.0), (100.0, 80.0), (200.0, 202.0)]):
        res.add_scenario_result(f"s{i}", "reference", {"output_throughput": meas, "ttft_p50": 1.0})
        res.add_scenario_result(f"s{i}", sim_engine(), {"output_throughput": sim, "ttft_p50": 1.5})
    [g] = sv.compare_sim_to_measured(res)
    assert (g.simulated, g.measured, g.step_clock) == (SIM, "reference", True)
    errors = [t.error for p in g.pairs for t in p.timings if t.metric == "output_throughput"]
    assert errors == pytest.approx([0.10, 0.20, 0.01])
    assert g.median_error("output_throughput") == pytest.approx(0.10)
    assert g.median_error("ttft_p50") == pytest.approx(0.5)
    assert g.median_error("ttft_p99") is None  # neither side recorded it
    # pooled over every timing error: 0.01, 0.10, 0.20, 0.5, 0.5, 0.5 -> (0.20 + 0.5) / 2
    assert g.median_error() == pytest.approx(0.35)
    assert g.goal_met is False


def test_a_missing_or_zero_measurement_has_no_error():
    assert sv.TimingError("ttft_p50", None, 1.0).error is None
    assert sv.TimingError("ttft_p50", 0.0, 1.0).error is None
    assert sv.TimingError("ttft_p50", 2.0, None).error is None
    assert sv.CountMatch("preemptions_swap", 3, None).equal is None
    assert sv.CountMatch("preemptions_swap", 3, 3.0).equal is True


def test_goal_met_within_ten_percent():
    [g] = sv.compare_sim_to_measured(results_with({k: 1.05 for k in TIMES}))
    assert len(g.pairs) == 3 and {(p.scenario, p.mode) for p in g.pairs} == set(MEASURED)
    assert g.median_error() == pytest.approx(0.05)
    assert g.goal_met is True
    assert g.counts_equal is True and g.counts_differing == []


def test_simulator_thirty_percent_off_fails_the_goal_and_the_section_says_so():
    res = results_with({k: 0.7 for k in TIMES})
    [g] = sv.compare_sim_to_measured(res)
    assert g.median_error() == pytest.approx(0.30)
    assert all(g.median_error(k) == pytest.approx(0.30) for k in TIMES)
    assert g.goal_met is False
    [view] = sv.section(res)
    assert view["banner"] == "bad" and view["median"] == "30.0%"
    html = _section_html(render_report(res))
    assert "Median error 30.0%" in html and "not met" in html
    assert html.count('class="delta bad"') == 3 * len(TIMES) + len(TIMES)  # every cell and every median


def test_counts_that_differ_on_the_step_clock_are_flagged():
    res = results_with({}, counts={"preemptions_recompute": 9})
    [g] = sv.compare_sim_to_measured(res)
    assert g.goal_met is True
    assert g.counts_equal is False
    assert [(p.scenario, p.mode, c.metric) for p, c in g.counts_differing] == [
        ("storm", "recompute", "preemptions_recompute"), ("storm", "swap", "preemptions_recompute"),
        ("surge", None, "preemptions_recompute")]
    [view] = sv.section(res)
    assert view["banner"] == "bad"
    html = _section_html(render_report(res))
    assert "3 counts differ on the step clock" in html
    assert "7 ≠ 9" in html and "storm [recompute]: preemptions recompute" in html


def test_counts_off_the_step_clock_are_shown_not_judged():
    res = results_with({}, sim=sim_engine(SIM_COST, clock="cost"), counts={"preemptions_recompute": 9})
    [g] = sv.compare_sim_to_measured(res)
    assert g.sim_clock == "cost" and not g.step_clock
    assert g.counts_equal is None and g.counts_differing == []
    [view] = sv.section(res)
    assert view["banner"] == "good"  # timing goal met; counts not judged
    assert "only expected to be equal on the step clock" in view["counts_note"]
    html = _section_html(render_report(res))
    assert "Counts not judged" in html and 'class="bad"' not in html


def test_measured_on_the_wall_clock_leaves_counts_unjudged():
    res = results_with({}, counts={"preemptions_swap": 1}, measured_clock="wall")
    [g] = sv.compare_sim_to_measured(res)
    assert g.step_clock and not any(p.counts_expected_equal for p in g.pairs)
    assert g.counts_equal is None
    assert "wall clock" in sv.section(res)[0]["counts_note"]


@pytest.mark.parametrize(("engine", "clock"), [
    ({"name": "sim:clock=step,hardware=x.json"}, "step"),
    ({"name": "sim:hardware=x.json", "options": {"clock": "cost"}}, "cost"),
    ({"name": "sim:clock=cost", "clock": "step"}, "step"),  # the description wins over the name
    ({"name": "sim"}, None),
])
def test_engine_clock_from_description_options_or_name(engine, clock):
    assert sv.engine_clock(engine) == clock


def test_no_section_without_a_simulated_and_a_measured_result_in_the_same_mode():
    res = Results(device="cpu")
    res.add_scenario_result("s", "reference", {"output_throughput": 1.0}, mode="swap")
    res.add_scenario_result("s", "other", {"output_throughput": 1.0}, mode="swap")
    assert sv.compare_sim_to_measured(res) is None
    res.add_scenario_result("s", sim_engine(), {"output_throughput": 1.0}, mode="recompute")  # other mode
    res.add_scenario_result("t", sim_engine(), {"output_throughput": 1.0}, mode="swap")  # other scenario
    assert sv.compare_sim_to_measured(res) is None and sv.section(res) is None
    page = render_report(res)
    assert 'id="sim-vs-measured"' not in page and "Simulator vs measured" not in page


def test_each_simulated_engine_is_paired_with_each_reference_engine_configured_alike():
    res = results_with({k: 1.2 for k in TIMES})
    on_cpu = {"name": "reference:device=cpu", "kind": "reference", "options": {"device": "cpu"}}
    swap = {"name": "reference:preemption_mode=swap", "kind": "reference", "options": {"preemption_mode": "swap"}}
    for (scenario, mode), figures in MEASURED.items():
        for engine in (on_cpu, swap, "vllm", sim_engine(SIM_COST, "cost")):
            res.add_scenario_result(scenario, engine, figures, mode=mode)
    pairings = sv.compare_sim_to_measured(res)
    # a placement option (device) leaves the schedule alike; another mode or another engine is not what the
    # simulator ran, so it is not judged against it
    assert [(g.simulated, g.measured) for g in pairings] == [
        (SIM, "reference"), (SIM, on_cpu["name"]), (SIM_COST, "reference"), (SIM_COST, on_cpu["name"])]
    assert [g.median_error() for g in pairings] == pytest.approx([0.2, 0.2, 0.0, 0.0])
    assert [g.step_clock for g in pairings] == [True, True, False, False]
    html = render_report(res)
    assert _section_html(html).count("<table") == 4


def test_a_simulator_of_another_configuration_is_paired_with_that_one():
    sim = {**sim_engine("sim:hardware=fit.json,preemption_mode=swap,clock=step"),
           "options": {"hardware": "fit.json", "preemption_mode": "swap", "clock": "step"}}
    swap = {"name": "reference:preemption_mode=swap", "kind": "reference", "options": {"preemption_mode": "swap"}}
    res = results_with({}, sim=sim)
    for (scenario, mode), figures in MEASURED.items():
        res.add_scenario_result(scenario, swap, figures, mode=mode)
    assert [g.measured for g in sv.compare_sim_to_measured(res)] == [swap["name"]]


def test_rendered_section_shows_figures_and_escapes_engine_names():
    res = results_with({k: 1.05 for k in TIMES}, sim=sim_engine(SIM + EVIL),
                       measured={"name": "ref" + EVIL, "kind": "reference"})
    page = render_report(res)
    assert EVIL not in page and "<script>alert" not in page
    assert len(re.findall(r"<script\b", page)) == 2  # the data island and the sorting script, as always
    html = _section_html(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert '<a href="#sim-vs-measured">Simulator vs measured</a>' in page
    assert "Median error 5.0%" in html and "goal (≤ 10.0%)" in html and "met" in html
    assert "Every count equal" in html and "7 = 7" in html
    assert "storm" in html and "[recompute]" in html and "surge" in html
    assert "Simulator clock: <b>step</b>" in html


def test_write_report_round_trips_the_section(tmp_path):
    path = write_report(results_with({k: 0.7 for k in TIMES}), tmp_path)
    reread = Results.load(tmp_path / "results.json")
    assert sv.compare_sim_to_measured(reread)[0].goal_met is False
    assert 'id="sim-vs-measured"' in path.read_text(encoding="utf-8")


def _section_html(page: str) -> str:
    match = re.search(r'<section id="sim-vs-measured">(.*?)</section>', page, re.S)
    assert match, "no 'Simulator vs measured' section in the report"
    return match.group(1)
