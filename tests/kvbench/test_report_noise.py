"""Noise-aware at a glance: every ratio with its ±, colour only beyond the noise, digits that follow the
noise, "–" for a ratio of nothing, counts that varied across repeats as a range, better/worse in words,
and no comparison across clocks."""

from __future__ import annotations

import re

from kvbench.bench.formatting import fmt_noisy_ratio
from kvbench.bench.results import Results
from kvbench.report import figures
from kvbench.report.render import render_report, side_by_side, summary_table

STORM = "preemption_storm"


def with_repeats(result: dict, factors: dict[str, list[float]]) -> None:
    """Give ``result`` the runner's layout of repeats: each metric's median times ``factors``."""
    n = len(next(iter(factors.values())))
    result["repeats"] = [{k: result["metrics"][k] * f[i] for k, f in factors.items()} for i in range(n)]
    result["spread"] = {k: (max(f) - min(f)) / 2 * result["metrics"][k] for k, f in factors.items()}


def two_engines(ref: dict, other: dict, clocks: tuple[str, str] = ("step", "step")) -> Results:
    res = Results(device="cpu (test)")
    for name, m, clock in (("reference", ref, clocks[0]), ("other", other, clocks[1])):
        res.add_engine({"name": name, "kind": name})
        res.add_scenario_result(STORM, name, m, clock={"clock": clock})
    res.scenario(STORM)["parameters"] = {"workload": "Poisson arrivals"}
    return res


def test_digits_follow_the_noise():
    assert fmt_noisy_ratio(20.95, 0.18) == "21× ±18%"
    assert fmt_noisy_ratio(1.01, 0.45) == "1.0× ±45%"
    assert fmt_noisy_ratio(1.234, None) == "1.23×"  # a single run: two decimals, no ±
    assert fmt_noisy_ratio(3.4567, 0.004) == "3.46× ±0%"
    assert fmt_noisy_ratio(None, 0.1) == "–" and fmt_noisy_ratio(float("inf"), None) == "–"


def test_colour_and_word_only_beyond_the_noise():
    a = {"metrics": {"output_throughput": 130.0}}
    b = {"metrics": {"output_throughput": 100.0}}
    with_repeats(a, {"output_throughput": [0.7, 1.0, 1.3]})
    with_repeats(b, {"output_throughput": [0.9, 1.0, 1.1]})
    c = figures.compare("output_throughput", a, b)
    assert c.noise is not None and c.noise > 0.3
    assert (c.verdict, c.cls, c.symbol) == ("within noise", "same", "≈")
    a["metrics"]["output_throughput"] = 300.0
    c = figures.compare("output_throughput", a, b)
    assert (c.verdict, c.cls, c.symbol) == ("better", "good", "▲ better")
    assert figures.compare("ttft_p99", {"metrics": {"ttft_p99": 0.3}}, {"metrics": {"ttft_p99": 0.1}}).symbol == \
        "▼ worse"
    # both under the noise floor of one step: never coloured
    assert figures.compare("ttft_p99", {"metrics": {"ttft_p99": 0.0015}},
                         {"metrics": {"ttft_p99": 0.0005}}).cls == "same"


def test_a_zero_denominator_has_no_ratio():
    c = figures.compare("recomputed_tokens", {"metrics": {"recomputed_tokens": 0}},
                        {"metrics": {"recomputed_tokens": 0}})
    assert c.ratio is None and c.text == "–" and c.cls == "na"
    c = figures.compare("recomputed_tokens", {"metrics": {"recomputed_tokens": 5}},
                        {"metrics": {"recomputed_tokens": 0}})
    assert c.text == "–"


def test_counts_that_varied_across_repeats_show_their_range():
    res = two_engines({"output_throughput": 100.0, "preemptions": 3.0}, {"output_throughput": 90.0,
                                                                          "preemptions": 5.0})
    ref, other = res.scenario(STORM)["results"]
    ref["repeats"] = [{"preemptions": v, "output_throughput": 100.0} for v in (2, 3, 4)]
    other["repeats"] = [{"preemptions": 5, "output_throughput": 90.0}] * 3
    assert figures.fmt_value("preemptions", ref) == "2–4" and figures.fmt_value("preemptions", other) == "5"
    # a time is a median whatever its repeats
    ref["repeats"][0]["ttft_p99"], ref["metrics"]["ttft_p99"] = 0.2, 0.1
    assert "–" not in figures.fmt_value("ttft_p99", ref)
    rows = summary_table(res)["rows"]
    assert "2–4" in rows[0]["cells"]
    [table] = side_by_side(res)
    row = next(r for r in table["rows"] if r["label"] == "preemptions")
    assert row["cells"] == ["2–4", "5"]


def test_side_by_side_cells_carry_noise_and_words_and_clocks_are_not_mixed():
    res = two_engines({"output_throughput": 100.0, "ttft_p99": 0.5}, {"output_throughput": 300.0, "ttft_p99": 0.1})
    for r, f in zip(res.scenario(STORM)["results"], ([0.9, 1.0, 1.1], [0.95, 1.0, 1.05]), strict=True):
        with_repeats(r, {"output_throughput": f, "ttft_p99": f})
    [table] = side_by_side(res)
    tp = next(r for r in table["rows"] if r["label"] == "output tok/s")["ratios"][0]
    assert tp["text"] == "3.0× ±30%" and tp["cls"] == "good" and tp["word"] == "▲ better"
    page = render_report(res)
    assert "3.0× ±30%" in page and "▲ better" in page
    assert table["not_compared"] == []
    # the same figures, one engine on the wall clock: shown side by side, never compared or coloured
    wall = two_engines({"output_throughput": 100.0}, {"output_throughput": 300.0}, clocks=("step", "wall"))
    [table] = side_by_side(wall)
    tp = table["rows"][0]["ratios"][0]
    assert tp["text"] == "not compared" and tp["cls"] == "na" and "clock" in tp["tip"]
    assert table["chart"] is None and table["not_compared"]
    page = render_report(wall)
    side = page[page.index('id="side-by-side"'):page.index('id="summary"')]
    assert "Not compared: different clocks" in side
    assert not re.search(r'class="ratio (good|bad)"', side)
