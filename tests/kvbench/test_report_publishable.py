"""What the published example report needs from the first screen and the page (issue 34 point 5): no engine is
crowned on a run of a scenario that failed or decided nothing, an engine without the scored figure is named
"not exposed" rather than left out, and every skipped scenario is on the page with its reason. Each rule is
shown holding and, with its trigger removed, not firing."""

from __future__ import annotations

from kvbench.bench.results import Results
from kvbench.report import first_screen
from kvbench.report.render import render_report

WAVE = "ttft_p99_wave"  # the evening surge's score (lower is better)
FINISHED = "every request finished"
WAVE_PREEMPTED = "the wave preempted running requests"


def _surge(rows: list[tuple[str, float | None, dict, dict]]) -> Results:
    """An evening-surge results file of one repeat per engine: (engine, p99 wave TTFT or None, checks,
    undecided)."""
    res = Results()
    for engine, ttft, checks, undecided in rows:
        metrics = {"preemptions": 5, "ttft_p99": ttft or 1.0, **({WAVE: ttft} if ttft is not None else {})}
        res.add_scenario_result("evening_surge", engine, metrics, checks=checks, undecided=undecided,
                                clock={"clock": "wall"})
    return res


def _row(res: Results) -> dict:
    return next(v for v in first_screen.verdicts(res) if v["scenario"] == "evening_surge")


HELD = {FINISHED: True, WAVE_PREEMPTED: True}


def test_an_engine_whose_run_failed_is_not_crowned_however_good_its_figure():
    """The S38 run's flash crowd: llama.cpp "won" on the p99 TTFT of the requests that finished, while not every
    request finished."""
    failed = _surge([("llamacpp", 0.1, {FINISHED: False}, {}), ("vllm", 1.0, HELD, {}), ("ref", 2.0, HELD, {})])
    row = _row(failed)
    assert row["winner"] != "llamacpp"
    assert row["winner"] == "vllm" and row["crowned"]  # the two that did the workload are still ranked
    assert "llamacpp: not ranked: its run failed (every request finished)" in row["standings"]
    assert not any(s.startswith("llamacpp: 100 ms") for s in row["standings"])
    # the same figures, its run passing: it is crowned (the rule fires on the failure, not on the engine)
    passed = _surge([("llamacpp", 0.1, HELD, {}), ("vllm", 1.0, HELD, {}), ("ref", 2.0, HELD, {})])
    assert _row(passed)["winner"] == "llamacpp"


def test_a_scenario_that_decided_nothing_on_every_engine_crowns_nobody():
    """The issue's priority row (78x on runs where every mechanism claim was undecided)."""
    undecided = {WAVE_PREEMPTED: "not exposed: a client sees no preemption per request"}
    row = _row(_surge([("ref", 0.01, {FINISHED: True}, undecided), ("vllm", 0.78, {FINISHED: True}, undecided)]))
    assert not row["crowned"] and not row["winner"]
    assert row["action"].startswith("Nothing to decide") and len(row["standings"]) == 2
    assert all("nothing decided on it (undecided: 1 of its claim about the scenario)" in s for s in row["standings"])
    # one mechanism claim decided on each: ranked again
    decided = _row(_surge([("ref", 0.01, HELD, {}), ("vllm", 0.78, HELD, {})]))
    assert decided["winner"] == "ref" and decided["crowned"]


def test_one_engine_left_to_rank_is_alone_and_the_other_is_named_with_its_reason():
    undecided = {WAVE_PREEMPTED: "did not fire"}
    row = _row(_surge([("ref", 0.01, {FINISHED: True}, undecided), ("vllm", 0.78, HELD, {})]))
    assert row["status"] == "one engine" and not row["crowned"]
    assert row["standings"][0].startswith("vllm: ") and row["standings"][1].startswith("ref: not ranked")
    assert "only one engine's run of it can be ranked" in row["action"]


def test_an_engine_without_the_scored_figure_reads_not_exposed_never_left_out():
    row = _row(_surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {}), ("llamacpp", None, HELD, {})]))
    assert row["winner"] == "ref"
    assert any(s.startswith("llamacpp: ") and "not exposed" in s for s in row["standings"])
    # with the figure it is ranked among the others, not called "not exposed"
    row = _row(_surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {}), ("llamacpp", 2.0, HELD, {})]))
    assert not any("not exposed" in s for s in row["standings"])


LONG = ("evening_surge: nothing decided on this engine: the wave preempted running requests (not exposed: a client "
        "sees no preemption per request, and the engine publishes no preemption counter (the engine counted 9 "
        "preemptions in all))")


def _with_skips() -> Results:
    res = _surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {})])
    res.data["skipped_scenarios"] = [
        {"scenario": "swap_vs_recompute", "engine": "vllm", "reason": "vllm lacks capability swap, events"},
        {"scenario": "swap_vs_recompute", "engine": "vllm", "reason": "vllm lacks capability swap, events"},
        {"scenario": "chunked_prefill_stalls", "engine": "ref", "reason": "hf cannot set knobs: chunked prefill"},
        {"scenario": "chunked_prefill_stalls", "engine": "vllm", "reason": "hf cannot set knobs: chunked prefill"},
        {"scenario": "chunked_prefill_stalls", "engine": "hf", "reason": "hf lacks capability priority"},
        {"scenario": "evening_surge", "engine": "llamacpp", "reason": LONG}]
    return res


def test_every_skipped_scenario_is_listed_with_its_reason_even_one_no_engine_ran():
    from kvbench.report import skipped

    swap, chunked, surge = skipped.section(_with_skips())
    assert [(e["engine"], e["reason"]) for e in chunked["engines"]] == [
        ("ref, vllm", "hf cannot set knobs: chunked prefill"), ("hf", "lacks capability priority")]
    assert swap["title"] != "swap_vs_recompute" and not swap["measured"]  # titled in words, and said not run
    assert swap["engines"] == [{"engine": "vllm", "reason": "lacks capability swap, events",
                                "short": "lacks capability swap, events", "full": ""}]  # said once
    assert surge["measured"]
    (long,) = surge["engines"]
    assert long["short"] == "nothing decided on this engine" and long["full"] == LONG  # folded, never cut
    assert skipped.section(_surge([("ref", 0.5, HELD, {})])) == []


def test_the_page_shows_the_not_measured_list_only_when_something_was_skipped():
    html = render_report(_with_skips())
    first = html[html.index('id="verdict"'):html.index('id="headlines"')]
    assert 'id="not-measured"' in first and "vllm: lacks capability swap, events" in first
    assert "(the engine counted 9 preemptions in all)" in first and "(not run on any engine)" in first
    plain = render_report(_surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {})]))
    assert 'id="not-measured"' not in plain


def test_the_diagnosis_does_not_guess_how_an_engine_that_counts_no_preemption_preempts():
    """llama.cpp publishes no preemption counter: "preempts by recompute" would be kvbench's default, not a fact."""
    from kvbench.report.diagnosis import mode_label

    res = Results()
    res.add_scenario_result("evening_surge", "llamacpp", {"ttft_p99": 1.0}, clock={"clock": "wall"})
    res.add_scenario_result("evening_surge", "vllm", {"ttft_p99": 1.0, "preemptions": 6, "preemptions_recompute": 6},
                            clock={"clock": "wall"})
    assert mode_label(res, "llamacpp") == "preemption not exposed"
    assert mode_label(res, "vllm") == "preempts by recompute"  # counted: said
    html = render_report(res)
    assert "preemption not exposed" in html and "preempts by recompute" in html


def test_a_headline_card_about_an_engine_the_verdict_does_not_rank_is_marked_not_ranked():
    """The S38 run's priority card (7.44 ms vs 8.22 ms on the reference server) beside a verdict that decided
    nothing on that engine."""
    from kvbench.report import scoreboard

    card = {"scenario": "priority_online_offline", "title": "Online TTFT", "value": "7.44 ms vs 8.22 ms",
            "caption": "online p50 TTFT with priority vs under FCFS (server:preset=reference)", "measured": True,
            "within_noise": False, "detail": ""}
    ratio = {**card, "scenario": "evening_surge", "value": "0.38×", "caption": "vllm ÷ ref output throughput"}
    verdicts = [{"scenario": "priority_online_offline", "status": "not measured",
                 "unranked": ["server:preset=reference"]},
                {"scenario": "evening_surge", "status": "wins", "unranked": ["vllm"]}]
    one, two = scoreboard.agree_with_verdicts([card, ratio], verdicts)
    assert one["value"] == "not ranked" and "7.44 ms vs 8.22 ms" in one["caption"]
    assert two["value"] == "not ranked" and "does not rank vllm" in two["caption"]
    # the same cards beside verdicts that rank every engine are left as they are
    ranked = [{**v, "unranked": []} for v in verdicts]
    assert scoreboard.agree_with_verdicts([card, ratio], ranked) == [card, ratio]


def test_the_results_page_gives_no_ratio_to_a_run_that_failed():
    """docs/results.md's engine-against-engine table: llama.cpp's 0.1 s came from a run where not every request
    finished: shown with why, never as "better"."""
    from kvbench.report.results_tables import engine_rows

    res = _surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {}), ("llamacpp", 0.1, {FINISHED: False}, {})])
    res.data["engines"][0]["kind"] = "reference"
    engines, (row,) = engine_rows(res)
    cells = dict(zip(engines, row[2:], strict=True))
    assert "not ranked: its run failed" in cells["llamacpp"] and "better" not in cells["llamacpp"]
    assert "of the reference, worse" in cells["vllm"]
    ok = _surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {}), ("llamacpp", 0.1, HELD, {})])
    ok.data["engines"][0]["kind"] = "reference"
    engines, (row,) = engine_rows(ok)
    assert "better" in dict(zip(engines, row[2:], strict=True))["llamacpp"]


def test_engines_side_by_side_says_a_run_failed_before_its_ratios():
    """This run's flash crowd: llama.cpp's "p99 TTFT 0.11x better" came from a run where 8 requests errored."""
    from kvbench.report import side_by_side

    res = _surge([("ref", 1.0, HELD, {}), ("llamacpp", 0.1, {FINISHED: False}, {}), ("vllm", 2.0, HELD, {})])
    res.data["engines"][0]["kind"] = "reference"
    (table,) = side_by_side.tables(res)
    llama = next(g for g in table["gist"] if g.startswith("llamacpp vs ref"))
    assert "its run failed (every request finished), so these ratios are no result" in llama
    assert "failed" not in next(g for g in table["gist"] if g.startswith("vllm vs ref"))
    assert not any("failed" in n for n in table["not_compared"])
    # the reference's own run failing is said once, for every ratio against it
    res = _surge([("ref", 1.0, {FINISHED: False}, {}), ("vllm", 2.0, HELD, {})])
    res.data["engines"][0]["kind"] = "reference"
    (table,) = side_by_side.tables(res)
    assert any("ref's own run failed" in n for n in table["not_compared"])


def test_a_card_whose_figure_was_not_measured_says_what_the_verdict_ranked_the_scenario_on():
    from kvbench.report import scoreboard

    card = {"scenario": "evening_surge", "title": "Evening surge", "value": "not measured",
            "caption": "needs per-request preemption times before and after the wave", "measured": False,
            "within_noise": False, "detail": ""}
    wins = {"scenario": "evening_surge", "status": "wins", "metric": "p99 TTFT of the long-context wave"}
    (out,) = scoreboard.agree_with_verdicts([card], [wins])
    assert out["value"] == "not measured"
    assert out["caption"].endswith("the verdict ranks the scenario on p99 TTFT of the long-context wave")
    # a verdict that ranks nobody leaves the card as it is
    assert scoreboard.agree_with_verdicts([card], [{**wins, "status": "not measured"}]) == [card]


def test_a_win_from_single_runs_is_not_called_beyond_the_noise():
    row = _row(_surge([("ref", 0.5, HELD, {}), ("vllm", 1.0, HELD, {})]))
    assert row["winner"] == "ref" and row["noise"] == "single run: no noise measured"
    assert "beyond the noise" not in row["action"] and "single run" in row["action"]
