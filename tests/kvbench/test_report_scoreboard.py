"""The report's first screen and diagnosis, judged against what scenarios declare: scoreboard with noise,
conformance matrix, preemption cost, expectation-aware diagnosis with advice for the engine's mode
only, and the charts' readability rules (integer ticks, named log axes, labels never covered)."""

from __future__ import annotations

import os
import re
import stat

import pytest

from kvbench.bench.results import Results
from kvbench.bench.scenarios.declare import plural, relative_spread
from kvbench.cli import main as cli
from kvbench.report import charts as rc
from kvbench.report import diagnosis, scoreboard
from kvbench.report.render import render_report, write_report

STORM, CHUNKED, CROSS = "preemption_storm", "chunked_prefill_stalls", "swap_vs_recompute"


def _results(engines: dict[str, dict] | None = None) -> Results:
    res = Results(device="cpu (test)")
    for name, opts in (engines or {"reference": {}, "other": {}}).items():
        res.add_engine({"name": name, "kind": "reference" if name.startswith("reference") else name,
                        "options": opts})
    return res


# --------------------------------------------------------------------------------------------
# scoreboard and headlines


def test_scoreboard_names_the_leader_the_ratio_and_single_run():
    res = _results()
    res.add_scenario_result(STORM, "reference", {"output_throughput": 100.0})
    res.add_scenario_result(STORM, "other", {"output_throughput": 250.0})
    (row,) = scoreboard.scoreboard(res, "reference")
    assert row["leader"] == "other" and row["by"] == "2.50× over reference" and row["noise"] == "single run"
    assert not row["within_noise"]


def test_scoreboard_uses_the_spread_of_repeats_and_says_within_noise():
    res = _results()
    res.add_scenario_result(STORM, "reference", {"output_throughput": 100.0})
    res.add_scenario_result(STORM, "other", {"output_throughput": 104.0})
    for r in res.scenario(STORM)["results"]:  # the runner's layout: every repeat's figures and a spread
        v = r["metrics"]["output_throughput"]
        r["repeats"] = [{"output_throughput": v * f} for f in (0.95, 1.0, 1.05)]
        r["spread"] = {"output_throughput": v * 0.05}
    assert relative_spread(res.scenario(STORM)["results"][0], "output_throughput") == pytest.approx(0.05)
    (row,) = scoreboard.scoreboard(res, "reference")
    assert row["within_noise"] and row["leader"] == "" and row["by"].startswith("within noise")
    assert row["noise"] == "±20% (spread of repeats)"
    # the same 4% gap without repeats is named, as a single run
    for r in res.scenario(STORM)["results"]:
        r["repeats"], r["spread"] = [], {}
    (row,) = scoreboard.scoreboard(res, "reference")
    assert row["leader"] == "other" and row["noise"] == "single run"


def test_times_under_the_noise_floor_are_within_noise():
    res = _results()
    res.add_scenario_result(CHUNKED, "reference", {"tbt_p99": 0.0010}, mode="chunked")
    res.add_scenario_result(CHUNKED, "other", {"tbt_p99": 0.0015}, mode="chunked")
    res.add_scenario_result(CHUNKED, "reference", {"tbt_p99": 0.0012}, mode="unchunked")
    (row,) = scoreboard.scoreboard(res, "reference")
    assert row["within_noise"] and "both <" in row["by"]
    (h,) = scoreboard.headlines(res, "reference")
    assert h["value"] == "within noise" and h["within_noise"]


def _crossover(res: Results, engine: str, costs: dict[int, tuple[float, float]]) -> None:
    for x, (rec, swap) in costs.items():
        res.add_sweep_point(CROSS, "seq_len", x, engine, {"cost_s": rec}, mode="recompute", x_label="L")
        res.add_sweep_point(CROSS, "seq_len", x, engine, {"cost_s": swap}, mode="swap", x_label="L")


def test_crossover_headline_says_within_noise_below_the_floor():
    res = _results({"reference": {}})
    # the curves cross between 16 and 32 tokens, where both cost well under 2 ms: jitter, not a result
    _crossover(res, "reference", {16: (0.0005, 0.0008), 32: (0.0009, 0.0007), 512: (0.02, 0.004)})
    (h,) = scoreboard.headlines(res, "reference")
    assert h["value"] == "within noise" and "2 ms" in h["caption"]
    # a crossover where the costs are large is a number
    res2 = _results({"reference": {}})
    _crossover(res2, "reference", {64: (0.004, 0.008), 256: (0.012, 0.009), 1024: (0.05, 0.012)})
    (h2,) = scoreboard.headlines(res2, "reference")
    assert h2["value"].replace(",", "").isdigit() and not h2["within_noise"]
    assert "below ~" not in h2["detail"]


def test_priority_headline_shows_priority_against_fcfs():
    res = _results({"reference": {}})
    res.add_scenario_result("priority_online_offline", "reference", {"ttft_p50_high": 0.0155, "ttft_p99_high": 0.05},
                            mode="priority")
    res.add_scenario_result("priority_online_offline", "reference", {"ttft_p50_high": 0.552, "ttft_p99_high": 1.2},
                            mode="fcfs")
    (h,) = scoreboard.headlines(res, "reference")
    assert h["value"] == "15.5 ms vs 552 ms" and "FCFS" in h["caption"]
    page = render_report(res)
    assert "Each class, priority policy vs FCFS" in page and "online (priority 0)" in page


def test_storm_knee_reads_none_within_the_sweep():
    res = _results({"reference": {}})
    for x, tp in ((2, 100.0), (4, 200.0), (8, 400.0)):
        res.add_sweep_point(STORM, "concurrency", x, "reference", {"output_throughput": tp, "preemptions": 0.0},
                            x_label="concurrent requests")
    res.add_scenario_result(STORM, "reference", {"output_throughput": 400.0})
    page = render_report(res)
    assert "none within the sweep (2–8)" in page
    assert "knee 8" not in page  # the top of the sweep is not a knee


# --------------------------------------------------------------------------------------------
# conformance matrix and preemption cost


def test_conformance_matrix_from_results_and_its_empty_state():
    res = _results()
    assert scoreboard.conformance_matrix(res) is None
    page = render_report(res)
    assert "<h3>Conformance</h3>" not in page and "No conformance results" not in page  # no empty card
    res.data["conformance"] = [
        {"engine": "reference", "kind": "reference", "check": "recompute_equivalence", "nodeid": "t::a",
         "outcome": "passed", "evidence": {"preemptions_recompute": 7}, "near_ties": 0, "reason": None,
         "knob_overrides": {}},
        {"engine": "other", "kind": "other", "check": "recompute_equivalence", "nodeid": "t::a[o]",
         "outcome": "failed", "evidence": {}, "near_ties": 0, "reason": "token 3 differs", "knob_overrides": {}},
        {"engine": "other", "kind": "other", "check": "swap_equivalence", "nodeid": "t::b[o]",
         "outcome": "skipped", "evidence": {}, "near_ties": 0, "reason": "lacks capability swap",
         "knob_overrides": {"preemption_mode": ["swap", "recompute"]}},
    ]
    m = scoreboard.conformance_matrix(res)
    assert m["engines"] == ["reference", "other"]
    rec, swap = m["rows"]
    assert [c["cls"] for c in rec["cells"]] == ["passed", "failed"]
    assert "preemptions_recompute=7" in rec["cells"][0]["tip"] and "token 3 differs" in rec["cells"][1]["tip"]
    assert swap["cells"][0]["text"] == "–" and "lacks capability swap" in swap["cells"][1]["tip"]
    assert "preemption_mode swap→recompute" in swap["cells"][1]["tip"]
    page = render_report(res)
    assert 'class="outcome failed"' in page and "No conformance results" not in page


def test_preemption_cost_names_the_scenario_and_metric_per_engine():
    res = _results()
    res.add_scenario_result(STORM, "reference", {"preemptions": 5.0, "recomputed_share": 0.3,
                                                 "starvation_max_s": 0.4})
    res.add_scenario_result("flash_crowd", "reference", {"preemptions": 2.0, "recomputed_share": 0.05})
    res.add_scenario_result(STORM, "other", {"preemptions": 0.0})
    costs = {c["engine"]: c["text"] for c in scoreboard.preemption_costs(res)}
    assert costs["reference"].startswith("preemption_storm: 30.0% of computed tokens were recomputed")
    assert "400 ms" in costs["reference"] and costs["other"].startswith("never preempted")


# --------------------------------------------------------------------------------------------
# diagnosis against expectation


def _diag(res: Results, engine: str) -> dict:
    return next(d for d in diagnosis.diagnose(res) if d["engine"] == engine)


def test_preemptions_a_scenario_creates_on_purpose_are_not_a_problem():
    res = _results({"reference": {}})
    res.add_scenario_result(STORM, "reference", {"preemptions": 40.0, "preemptions_recompute": 40.0,
                                                 "max_preemptions_per_request": 1.0,
                                                 "preemption_active_share": 0.9})
    check = _diag(res, "reference")["checks"][0]
    assert check["status"] == "ok" and check["knob"] == ""
    assert "preempted 1 time" in check["finding"] and "1 times" not in check["finding"]


def test_preemptions_where_none_is_declared_are_a_problem_with_advice():
    res = _results({"reference": {}})
    res.add_scenario_result(CHUNKED, "reference", {"preemptions": 3.0}, mode="chunked")
    check = _diag(res, "reference")["checks"][0]
    assert check["status"] == "problem" and "declares no preemption" in check["finding"]
    # a knob, but not "toward the knee": this engine ran no concurrency sweep, so it has no knee
    assert "KV pool more blocks" in check["knob"] and "knee" not in check["knob"]


def test_a_storm_without_preemptions_is_better_than_expected_and_worse_peers_are_watched():
    res = _results()
    res.add_scenario_result(STORM, "reference", {"preemptions": 0.0})
    res.add_scenario_result(STORM, "other", {"preemptions": 12.0})
    assert _diag(res, "reference")["checks"][0]["status"] == "better than expected"
    res2 = _results()
    res2.add_scenario_result(STORM, "reference", {"preemptions": 4.0})
    res2.add_scenario_result(STORM, "other", {"preemptions": 20.0})
    other = _diag(res2, "other")["checks"][0]
    assert other["status"] == "watch" and "worse than reference" in other["finding"] and other["knob"]
    assert _diag(res2, "reference")["checks"][0]["status"] == "ok"


def test_the_diagnosis_never_sets_one_clocks_figure_against_anothers():
    """The issue's "hf-cb's 343 ms wait against the swap engine's 37.2 ms" across clocks: the same figures on
    one clock are compared, on two they are not."""
    for clocks, compared in ((("wall", "wall"), True), (("step", "wall"), False)):
        res = _results()
        for engine, clock, n in (("reference", clocks[0], 4.0), ("other", clocks[1], 20.0)):
            res.add_scenario_result(STORM, engine, {"preemptions": n}, clock={"clock": clock})
        other = _diag(res, "other")["checks"][0]
        assert ("worse than reference" in other["finding"]) is compared, other


def test_swap_advice_goes_only_to_a_swap_engine():
    engines = {"reference": {}, "reference:preemption_mode=swap": {"preemption_mode": "swap"}}
    res = _results(engines)
    metrics = {"preemptions": 5.0, "swap_fallbacks": 3.0, "swap_bandwidth": 1e9, "swapped_out_bytes": 1e6}
    for engine in engines:
        res.add_scenario_result(STORM, engine, metrics)
    rec, swap = _diag(res, "reference"), _diag(res, "reference:preemption_mode=swap")
    assert rec["mode"] == "recompute" and swap["mode"] == "swap"
    assert rec["checks"][4]["knob"] == "" and "preempts by recompute" in rec["checks"][4]["finding"]
    assert swap["checks"][4]["status"] == "problem" and "swap_space" in swap["checks"][4]["knob"]
    assert "fell back to recompute 3 times" in swap["checks"][4]["finding"]
    # a scenario that declares the fallback (swap-space exhaustion) is not a problem, even for a swap engine
    res2 = _results(engines)
    res2.add_scenario_result("swap_space_exhaustion", "reference:preemption_mode=swap", metrics,
                             mode="exhausted_swap_space")
    assert _diag(res2, "reference:preemption_mode=swap")["checks"][4]["status"] == "ok"


def test_no_advice_is_rendered_under_an_ok_item():
    res = _results({"reference": {}})
    res.add_scenario_result(STORM, "reference", {"preemptions": 4.0, "kv_usage_time_over_95": 0.8})
    page = render_report(res)
    for block in re.findall(r'<div class="check">(.*?)</span>\s*</div>', page, re.S):
        if 'class="pill ok"' in block or "better-than-expected" in block:
            assert "Try:" not in block


def test_plural():
    assert plural(1, "time") == "1 time" and plural(3, "time") == "3 times" and plural(1024, "token") == "1,024 tokens"


# --------------------------------------------------------------------------------------------
# charts


def test_count_axes_tick_at_whole_numbers():
    assert all(t == int(t) for t in rc.nice_ticks(0, 5, 5, integer=True))
    assert 2.5 in rc.nice_ticks(0, 5, 2)  # times may tick at 2.5, counts never
    assert 2.5 not in rc.nice_ticks(0, 5, 2, integer=True)
    svg = rc.render(rc.Chart("q", "t", "requests", lines=[rc.Line("w", [0, 1, 2], [0, 1, 2])], y_integer=True))
    assert not re.search(r'class="c-tick" text-anchor="end">\d+\.\d', svg)  # y ticks only


def test_log_axis_is_named():
    svg = rc.render(rc.Chart("c", "concurrent requests", "tok/s", lines=[rc.Line("a", [2, 4, 8, 16], [1, 2, 3, 4])],
                             log_x=True))
    assert "concurrent requests (log scale)" in svg


def test_coinciding_lines_are_drawn_wider_underneath():
    lines = [rc.Line("a", [0, 1], [1, 1]), rc.Line("b", [0, 1], [1, 1], dash="7 4")]
    widths = re.findall(r'<polyline[^>]*stroke-width="([\d.]+)"', rc.render(rc.Chart("c", "x", "y", lines=lines)))
    assert float(widths[0]) > float(widths[1])


def test_ratio_bar_labels_fit_and_values_never_cover_them():
    long = "p99 inter-token gap · reference:preemption_mode=swap · chunked_large"
    svg = rc.ratio_bars("t", [rc.Bar(long, 0.0, False), rc.Bar("x", 2.0, True)])
    label_x = float(re.search(r'<text x="([\d.]+)"[^>]*class="c-legend"', svg).group(1))
    assert label_x >= rc.text_width(long)  # the label column holds the whole label (anchored at its end)
    value_x = float(re.search(r'<text x="([\d.]+)"[^>]*class="c-value"[^>]*>0.00×', svg).group(1))
    assert value_x > label_x + 10  # moved right of the 1× axis instead of over the label


def test_decimation_keeps_spikes_and_shrinks_long_lines():
    xs = list(range(5000))
    ys = [1.0] * 5000
    ys[2345] = 50.0
    pts = rc.decimate(list(zip(xs, ys, strict=True)), lambda x: x / 10, 80)
    assert len(pts) <= 2 * 80 + 2 and (2345, 50.0) in pts and pts[0] == (0, 1.0) and pts[-1] == (4999, 1.0)


# --------------------------------------------------------------------------------------------
# files


def test_report_files_are_written_0644(tmp_path):
    old = os.umask(0o077)  # even under a strict umask: the report is a document to share
    try:
        path = write_report(_results(), tmp_path / "run")
    finally:
        os.umask(old)
    for f in (path, tmp_path / "run" / "results.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_cli_report_says_what_it_wrote_re_renders_beside_its_results_and_asks_before_overwriting_elsewhere(
        tmp_path, capsys):
    src = tmp_path / "results.json"
    _results().save(src)
    assert cli(["report", str(src)]) == 0
    out = capsys.readouterr().out
    assert f"report written to {tmp_path / 'report.html'}" in out and "KiB" in out
    before = (tmp_path / "report.html").read_text()
    # the report beside RESULTS.json is a rendering of that file: `kvbench report RESULTS.json` renders it again
    (tmp_path / "report.html").write_text("an older rendering")
    assert cli(["report", str(src)]) == 0 and (tmp_path / "report.html").read_text() == before
    # another file named with -o may be anything: asked first
    other = tmp_path / "other.html"
    other.write_text("keep me")
    assert cli(["report", str(src), "-o", str(other)]) == 2
    assert "--force" in capsys.readouterr().err and other.read_text() == "keep me"
    assert cli(["report", str(src), "-o", str(other), "--force"]) == 0
    assert other.read_text() == before


def test_scoreboard_never_ranks_results_of_two_clocks():
    """A results file mixing clocks (shards of separate runs merged) is never ranked across them, open
    loop or closed: the row says so and names each engine's clock; the headline card does not compare."""
    for workload in ("72 requests, Poisson 8/s", "16 requests, outputs 192, closed loop"):
        r = Results()
        for engine, clock, ttft in (("reference", "step", 1.3), ("hf-cb", "wall", 0.1)):
            r.add_scenario_result("flash_crowd", engine, {"ttft_p99_after_surge": ttft, "output_throughput": 1 / ttft,
                                                          "preemptions_before_surge": 0.0,
                                                          "preemptions_after_surge": 3.0},
                                  parameters={"workload": workload}, clock={"clock": clock})
        row = next(x for x in scoreboard.scoreboard(r, "reference") if x["scenario"] == "flash_crowd")
        assert not row["leader"] and not row["by"], row
        assert "mixes clocks" in row["note"] and "step clock: reference" in row["note"]
        assert "wall clock: hf-cb" in row["note"]
        card = next(c for c in scoreboard.headlines(r, "reference") if c["scenario"] == "flash_crowd")
        assert card["value"] == "not compared" and "mixes clocks" in card["caption"]
    # one clock: ranked
    r = Results()
    for engine, ttft in (("reference", 1.3), ("hf-cb", 0.1)):
        r.add_scenario_result("flash_crowd", engine, {"ttft_p99_after_surge": ttft}, clock={"clock": "wall"})
    assert next(x for x in scoreboard.scoreboard(r, "reference"))["leader"] == "hf-cb"


def test_a_lead_on_a_preemption_cost_needs_the_cost_to_have_arisen():
    """An engine that never preempted recomputed nothing: that is no lead on recompute cost."""
    res = _results()
    mode = "prefix_caching"
    res.add_scenario_result("prefix_caching_recompute", "reference", {"recomputed_tokens": 728.0, "preemptions": 13.0},
                            mode=mode)
    res.add_scenario_result("prefix_caching_recompute", "other", {"recomputed_tokens": 0.0, "preemptions": 0.0},
                            mode=mode)
    row = next(x for x in scoreboard.scoreboard(res, "reference") if x["scenario"] == "prefix_caching_recompute")
    assert row["leader"] == "" and "never preempted" in row["note"] and row["idle"] == ["other"]
    assert "other: did not preempt" in row["standings"]
    # both preempted: ranked as before
    res.scenario("prefix_caching_recompute")["results"][1]["metrics"].update(recomputed_tokens=200.0, preemptions=4.0)
    row = next(x for x in scoreboard.scoreboard(res, "reference") if x["scenario"] == "prefix_caching_recompute")
    assert row["leader"] == "other"


def test_the_verdict_names_every_engines_standing():
    res = _results({"reference": {}, "other": {}, "third": {}})
    for engine, tp in (("reference", 100.0), ("other", 250.0), ("third", 248.0)):
        res.add_scenario_result(STORM, engine, {"output_throughput": tp})
    (row,) = scoreboard.scoreboard(res, "reference")
    assert [s.split(":")[0] for s in row["standings"]] == ["other", "third", "reference"]
    assert "level with the best" in row["standings"][1] and "behind by 2.50×" in row["standings"][2]
    page = render_report(res)  # the first screen's verdict names them too
    first = page[page.index('id="verdict"'):page.index('id="headlines"')]
    assert "third: 248.0 tok/s (level with the best)" in first
    assert "reference: 100.0 tok/s (behind by 2.50×)" in first
