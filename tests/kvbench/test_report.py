"""The HTML report: escaping, self-containment, content, and a real render in headless Chromium."""

from __future__ import annotations

import json
import re

import pytest

from kvbench.bench.results import Results
from kvbench.report import render as report
from kvbench.report.render import headline_ratios, render_report, write_index, write_report
from tests.kvbench.chromium import INSTALL_HINT, find_chromium, load_page, png_size, screenshot
from tests.kvbench.trace_factory import relabel, scaled, synthetic_results

EVIL = "<script>alert(1)</script>"
EVIL_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
URL_RE = re.compile(r"https?:|//cdn|<link\b|@import|\bsrc\s*=|url\((?!#)", re.IGNORECASE)


@pytest.fixture(scope="module")
def results() -> Results:
    return synthetic_results()


@pytest.fixture(scope="module")
def html(results) -> str:
    return render_report(results, baseline=scaled(results, 1.25))


def evil_results() -> Results:
    """Markup injected everywhere a name or label reaches the page."""
    res = relabel(synthetic_results(), EVIL)
    sc = res.scenarios[0]
    sc["parameters"][EVIL] = EVIL
    res.add_scenario_result(sc["name"], {"name": "x" + EVIL, "kind": EVIL, "options": {EVIL: EVIL},
                                         "capabilities": [EVIL]},
                            {"output_throughput": 1.0}, checks={EVIL: False}, notes=[EVIL], mode=EVIL)
    res.data["machine"]["hostname"] = EVIL
    res.data["commit"] = {"id": EVIL, "branch": EVIL, "dirty": True}
    return res


def test_markup_in_names_and_labels_is_escaped_everywhere():
    res = evil_results()
    page = render_report(res, baseline=evil_results())
    assert EVIL not in page
    assert "alert(1)</script>" not in page and "<script>alert" not in page
    assert page.count(EVIL_ESCAPED) > 20  # engine, scenario, mode, sweep labels, charts, tables, notes...
    # exactly two script elements: the JSON data island and the sorting script
    assert len(re.findall(r"<script\b", page)) == 2
    data = re.search(r'<script type="application/json" id="kvbench-results">(.*?)</script>', page, re.S).group(1)
    assert "<" not in data and ">" not in data  # |tojson escaped them
    assert json.loads(data)["engines"][0]["name"] == "reference" + EVIL


def test_page_references_no_url(html):
    assert not URL_RE.search(html), URL_RE.search(html)
    assert "xmlns" not in html  # not even the SVG namespace URI


def test_page_has_every_section(html, results):
    for title in ("Headlines", "Diagnosis", "Engines side by side", "Summary", "Against baseline", "Scenarios",
                  "Run details"):
        assert f">{title}</h2>" in html
    for name in results.scenario_names():
        assert name in html
    assert 'aria-label="other ÷ reference"' in html  # ratio bars above the side-by-side table, both engines named
    for chart in ("Longest token gap — Preemption storm", "KV usage — Preemption storm",
                  "Waiting requests — Preemption storm", "Output throughput — Preemption storm",
                  "Throughput vs max_num_seqs", "p99 inter-token gap vs max_num_seqs",
                  "Preempt-and-resume cost by sequence length", "TTFT distribution", "Inter-token gap distribution"):
        assert chart in html, chart
    assert "knee " in html and "crossover " in html
    assert "Absolute times were measured on" in html and "cpu (synthetic)" in html
    assert html.count('class="check"') == 10  # five checks for each of the two engines


def test_headlines_from_the_synthetic_run(results):
    storm, swap, chunk, prefix = headline_ratios(results)
    for h in (storm, swap, chunk, prefix):
        assert h["measured"], h
    ref_tp = results.result("preemption_storm", "reference")["metrics"]["output_throughput"]
    other_tp = results.result("preemption_storm", "other")["metrics"]["output_throughput"]
    assert storm["value"] == f"{other_tp / ref_tp:.2f}×"
    assert swap["value"].replace(",", "").isdigit()  # the crossover length
    c = results.result("chunked_prefill_stalls", "reference", "chunked")["metrics"]["tbt_p99"]
    u = results.result("chunked_prefill_stalls", "reference", "unchunked")["metrics"]["tbt_p99"]
    assert chunk["value"] == f"{c / u:.2f}×"
    on = results.result("prefix_caching_recompute", "reference", "prefix_caching")["metrics"]["recomputed_tokens"]
    off = results.result("prefix_caching_recompute", "reference", "no_prefix_caching")["metrics"]["recomputed_tokens"]
    assert prefix["value"] == f"{(1 - on / off) * 100:.0f}%"


def test_headlines_say_not_measured_without_their_inputs():
    res = Results(device="cpu")
    for name in ("preemption_storm", "swap_vs_recompute", "chunked_prefill_stalls", "prefix_caching_recompute"):
        res.add_scenario_result(name, "reference", {"output_throughput": 10.0})
    assert [h["value"] for h in headline_ratios(res)] == ["not measured"] * 4
    page = render_report(res)
    assert page.count("not measured") >= 4
    assert "Engines side by side" not in page  # one engine: nothing to put side by side


def test_empty_results_render():
    page = render_report(Results(device="cpu"))
    assert "No scenarios." in page and "No results." in page


def test_minimal_hand_written_file_renders(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": 1, "commit": {}, "engines": [{"name": "e"}], "scenarios": [
        {"name": "s", "results": [{"engine": "e", "metrics": {"output_throughput": 5.0}}],
         "sweeps": [{"name": "concurrency", "points": [{"x": 1, "engine": "e", "metrics": {}}]}]}]}))
    page = render_report(Results.load(path))
    assert "No timelines recorded for this scenario." in page and "5.0 tok/s" in page


def test_diagnosis_names_numbers_and_gives_knobs_only_where_wrong(results):
    [ref, _other] = report.diagnose(results)
    assert ref["engine"] == "reference"
    titles = [c["title"] for c in ref["checks"]]
    assert [t.split()[0] for t in titles] == ["Is", "Is", "Concurrency", "Starvation:", "Swap"]
    first = ref["checks"][0]
    assert "preemption" in first["finding"] and any(ch.isdigit() for ch in first["finding"])
    for c in ref["checks"]:
        assert bool(c["knob"]) == (c["status"] in ("watch", "problem")), c
    assert "%" in ref["checks"][1]["finding"]  # KV usage with a number
    # a recompute engine: swap facts without swap advice
    assert ref["mode"] == "recompute" and ref["checks"][4]["knob"] == ""
    assert "crossover" in ref["checks"][4]["finding"] or "cost the same" in ref["checks"][4]["finding"]


def test_diagnosis_without_data_says_not_measured():
    res = Results(device="cpu")
    res.add_scenario_result("s", "e", {"output_throughput": 1.0})
    statuses = [c["status"] for c in report.diagnose(res)[0]["checks"]]
    assert statuses == ["not measured"] * 5


def test_baseline_section_flags_regressions(results):
    # one engine at half its throughput: a regression whether the gate compares absolute values or ratios
    current = Results(json.loads(json.dumps(results.to_dict())))
    for _, res in current.iter_results():
        if res["engine"] == "other":
            res["metrics"]["output_throughput"] *= 0.5
    section = report.baseline_section(current, results)
    assert section["regressions"] and any("output_throughput" in r for r in section["regressions"])
    assert any(c and c["regressed"] for row in section["rows"] for c in row["cells"])
    assert report.baseline_section(results, results)["regressions"] == []


def test_write_report_and_index(tmp_path, results):
    path = write_report(results, tmp_path / "run-b")
    assert path == tmp_path / "run-b" / "report.html" and (tmp_path / "run-b" / "results.json").exists()
    older = Results.load(tmp_path / "run-b" / "results.json")
    older.data["created"] = "2000-01-01T00:00:00+00:00"
    older.save(tmp_path / "run-a" / "results.json")  # no report.html in this one
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{")
    (tmp_path / "javascript:alert(1)").mkdir()
    older.save(tmp_path / "javascript:alert(1)" / "results.json")
    index = write_index(tmp_path).read_text()
    table = index[index.index("Runs, newest first"):]
    assert table.index("run-b") < table.index("2000-01-01")  # newest first
    assert 'href="./run-b/report.html"' in index and "(no report.html)" in index
    assert "unreadable" in index and "invalid JSON" in index
    assert 'href="javascript' not in index
    assert "Over time" in index and 'class="chart trend"' in index  # readable runs: the trend's small multiples
    assert not URL_RE.search(index)


# --------------------------------------------------------------------------------------------
# headless Chromium

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=f"Chromium not found; {INSTALL_HINT}")


@pytest.fixture(scope="module")
def report_file(tmp_path_factory, html):
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(html, encoding="utf-8")
    return path


@needs_chromium
@pytest.mark.slow
def test_chromium_screenshot_renders(report_file):
    png = report_file.with_name("report.png")
    done = screenshot(CHROMIUM, report_file.as_uri(), png, 1400, 2400)
    assert png.exists(), done.stderr[-2000:]
    data = png.read_bytes()
    assert png_size(data) == (1400, 2400)
    assert len(data) > 50_000  # a blank page compresses to a few KB; charts and text do not


@needs_chromium
@pytest.mark.slow
def test_chromium_no_console_errors_no_network(report_file):
    page = load_page(CHROMIUM, report_file.as_uri(), expressions={
        "charts": "document.querySelectorAll('svg.chart').length",
        "svg_bad": "Array.from(document.querySelectorAll('svg.chart')).filter(s => s.getBBox().width < 50).length",
        "headlines": "document.querySelectorAll('.headline').length",
        "sorted": "(() => { const th = document.querySelector('table.sortable thead th:nth-child(3)');"
                  " th.click(); th.click(); return th.className; })()",
        "data_ok": "JSON.parse(document.getElementById('kvbench-results').textContent).schema_version",
    })
    assert page.console_errors == [] and page.exceptions == [] and page.log_errors == []
    assert page.requests == [report_file.as_uri()]  # the page itself, nothing else
    assert page.evaluated["charts"] > 20 and page.evaluated["svg_bad"] == 0
    assert page.evaluated["headlines"] == 4  # one per scenario of the synthetic run
    assert "desc" in page.evaluated["sorted"]
    assert page.evaluated["data_ok"] == 1


@needs_chromium
@pytest.mark.slow
def test_chromium_harness_does_catch_errors_and_requests(tmp_path):
    """The negative control: a page that errs and fetches must be reported as such."""
    bad = tmp_path / "bad.html"
    bad.write_text('<img src="http://127.0.0.1:9/x.png"><script>console.error("boom"); undefinedFn();</script>')
    page = load_page(CHROMIUM, bad.as_uri(), settle=0.5)
    assert page.console_errors == ["boom"]
    assert any("undefinedFn" in e for e in page.exceptions)
    assert "http://127.0.0.1:9/x.png" in page.requests


def test_polylines_drop_redundant_points_but_keep_spikes():
    from kvbench.report.charts import _without_redundant_points

    # a flat run and a repeat collapse; a spike inside one pixel column (up to 50, back to 20) stays
    assert _without_redundant_points([(0, 10), (5, 10), (5, 10), (9, 10), (9, 50), (9, 20), (12, 20)]) == \
        [(0, 10), (9, 10), (9, 50), (9, 20), (12, 20)]
