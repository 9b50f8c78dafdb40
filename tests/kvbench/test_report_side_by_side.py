"""The report's "Engines side by side": every ratio names both engines and its direction, each metric once,
no trivial ratio (0 ÷ 0, a ratio to or from zero), noise shown only where the repeats measured it, and no
ratio across two clocks (kvbench/report/side_by_side.py)."""

from __future__ import annotations

import copy

from kvbench.bench.results import Results
from kvbench.report import side_by_side
from kvbench.report.render import render_report
from tests.kvbench.trace_factory import synthetic_results


def two_engines(base: dict, other: dict, *, clock: str = "wall", other_clock: str | None = None) -> Results:
    """One scenario run by "reference" and "hf-cb" with the given metrics (and optional per-repeat figures)."""
    res = Results()
    for name in ("reference", "hf-cb"):
        res.add_engine({"name": name, "kind": name, "options": {}})
    res.data["scenarios"].append({"name": "evening_surge", "parameters": {}, "sweeps": [], "results": [
        {"engine": "reference", "mode": None, "metrics": base, "clock": {"clock": clock}},
        {"engine": "hf-cb", "mode": None, "metrics": other, "clock": {"clock": other_clock or clock}}]})
    return res


def rows_of(res: Results) -> dict[str, dict]:
    (table,) = side_by_side.tables(res)
    (group,) = table["groups"]
    return {r["label"]: r for r in group["rows"]}


def test_every_ratio_names_both_engines_and_its_direction_is_the_engines_fate():
    res = two_engines({"output_throughput": 100.0, "ttft_p99": 1.0}, {"output_throughput": 50.0, "ttft_p99": 0.5})
    (table,) = side_by_side.tables(res)
    assert table["groups"][0]["ratio_heads"] == ["hf-cb ÷ reference"]
    rows = rows_of(res)
    # half the throughput is worse; half the TTFT is better: the word is for hf-cb, whichever way the metric points
    assert rows["output tok/s"]["ratios"][0]["word"] == "▼ worse"
    assert rows["p99 TTFT"]["ratios"][0]["word"] == "▲ better"
    assert table["gist"][0].startswith("hf-cb vs reference: ")
    page = render_report(res)
    assert "hf-cb ÷ reference" in page and "Each engine against <b>reference</b>" in page


def test_each_metric_once_and_no_count_beside_its_rate():
    res = synthetic_results()
    for table in side_by_side.tables(res):
        for group in table["groups"]:
            labels = [r["label"] for r in group["rows"]]
            assert len(labels) == len(set(labels)), labels
            assert "preemptions/s" not in labels and "recomputed share" not in labels


def test_trivial_ratios_are_dropped():
    res = two_engines({"output_throughput": 100.0, "recomputed_tokens": 0, "preemptions": 4, "swap_bandwidth": 0},
                      {"output_throughput": 90.0, "recomputed_tokens": 0, "preemptions": 0, "swap_bandwidth": 0})
    rows = rows_of(res)
    assert "recomputed tokens" not in rows  # 0 and 0: nothing to compare
    # 0 preemptions against 4: the values are shown, but no "0.00× ▲ better" ratio is formed or counted
    assert rows["preemptions"]["cells"] == ["4", "0"]
    assert rows["preemptions"]["ratios"][0]["text"] == "–" and not rows["preemptions"]["ratios"][0]["counts"]
    (table,) = side_by_side.tables(res)
    assert "preemptions" not in table["gist"][0]


def test_noise_is_shown_only_where_the_repeats_measured_it():
    single = rows_of(two_engines({"ttft_p99": 1.0, "preemptions": 5}, {"ttft_p99": 2.0, "preemptions": 10}))
    assert "±" not in single["p99 TTFT"]["ratios"][0]["text"] and "±" not in single["preemptions"]["ratios"][0]["text"]
    res = two_engines({"ttft_p99": 1.0, "preemptions": 5}, {"ttft_p99": 2.0, "preemptions": 10})
    for r, scale in zip(res.scenarios[0]["results"], (1.0, 2.0), strict=True):
        r["repeats"] = [{"ttft_p99": v * scale, "preemptions": 5 * scale} for v in (0.9, 1.0, 1.1)]
    repeated = rows_of(res)
    assert "±" in repeated["p99 TTFT"]["ratios"][0]["text"]
    assert "±" not in repeated["preemptions"]["ratios"][0]["text"]  # a count the repeats reproduced exactly


def test_two_clocks_are_listed_not_compared():
    res = two_engines({"ttft_p99": 1.0}, {"ttft_p99": 2.0}, clock="step", other_clock="wall")
    (table,) = side_by_side.tables(res)
    cells = [x for row in table["groups"][0]["rows"] for x in row["ratios"]]
    assert cells and all(x["text"] == "not compared" and not x["counts"] for x in cells)
    assert table["gist"] == ["hf-cb vs reference: not compared (different clocks)"]


def test_the_collapsed_line_stays_short():
    res = copy.deepcopy(synthetic_results())
    for table in side_by_side.tables(res):
        for line in table["gist"]:
            assert line.count("×") <= side_by_side.GIST_ITEMS


def test_kvbench_ratios_table_heads_its_columns_with_both_engines():
    from kvbench.bench.point_ratios import PointRatio, ratios_table

    table = ratios_table([PointRatio(2, None, "output_throughput", 100.0, 90.0, 0.9, (0.9, 0.91), 0.01, 0.02)],
                         "reference", "hf-cb")
    header = table.splitlines()[1]
    assert "| reference | hf-cb |" in header and "| baseline | engine |" not in header
    assert table.splitlines()[0].startswith("hf-cb against reference (> 1: hf-cb ahead")
