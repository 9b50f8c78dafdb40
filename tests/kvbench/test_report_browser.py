"""The report in headless Chromium at 800, 1400 and 1920 px: the page never scrolls sideways, no two pieces
of chart text overlap, no table cell clips its text, and screenshots are taken to look at."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvbench.bench.results import Results
from kvbench.report.render import render_report
from tests.kvbench.chromium import INSTALL_HINT, find_chromium, load_page, png_size
from tests.kvbench.trace_factory import synthetic_results

CHROMIUM = find_chromium()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason=f"Chromium not found; {INSTALL_HINT}")]

#: pairs of <text> boxes inside one chart that overlap by more than 2 px both ways
OVERLAPS = """(() => { const bad = [];
  document.querySelectorAll('details').forEach(d => d.open = true);
  document.querySelectorAll('svg.chart').forEach(svg => {
    const rs = Array.from(svg.querySelectorAll('text')).map(t => [t.textContent, t.getBoundingClientRect()])
      .filter(x => x[1].width > 0);
    for (let a = 0; a < rs.length; a++) for (let b = a + 1; b < rs.length; b++) {
      const A = rs[a][1], B = rs[b][1];
      const ox = Math.min(A.right, B.right) - Math.max(A.left, B.left);
      const oy = Math.min(A.bottom, B.bottom) - Math.max(A.top, B.top);
      if (ox > 2 && oy > 2) bad.push(svg.getAttribute('aria-label') + ': ' + rs[a][0] + ' / ' + rs[b][0]);
    } });
  return bad; })()"""
#: table cells whose text is wider than the cell (clipped), and tables wider than a box that does not scroll
CLIPPED = """(() => { const bad = [];
  document.querySelectorAll('td, th').forEach(c => { if (c.scrollWidth > c.clientWidth + 1) bad.push(c.textContent); });
  document.querySelectorAll('table').forEach(t => { const w = t.parentElement;
    if (t.scrollWidth > w.clientWidth + 1 && getComputedStyle(w).overflowX !== 'auto') {
      bad.push('table ' + t.className); } });
  return bad; })()"""
#: legends in which two series share colour and dash pattern (the reader could not tell them apart)
LEGENDS = """(() => { const bad = [];
  document.querySelectorAll('figcaption.legend').forEach(fc => { const seen = {};
    fc.querySelectorAll('svg.lg-key line').forEach(l => {
      const k = l.getAttribute('stroke') + '|' + (l.getAttribute('stroke-dasharray') || 'solid');
      if (seen[k]) bad.push(fc.textContent.trim().slice(0, 80) + ': ' + k); seen[k] = true; }); });
  return bad; })()"""
#: the page scrolls sideways when its content is wider than the window
OVERFLOW = "document.documentElement.scrollWidth - window.innerWidth"


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    res = synthetic_results()
    res.data["conformance"] = [{"engine": e, "kind": e, "check": c, "nodeid": f"suites/x.py::{c}[{e}]",
                                "outcome": o, "evidence": {"preemptions": 3}, "near_ties": 0, "reason": None,
                                "knob_overrides": {}}
                               for e in res.engine_names() for c, o in (("recompute_equivalence", "passed"),
                                                                        ("swap_equivalence", "skipped"))]
    path = tmp_path_factory.mktemp("browser") / "report.html"
    path.write_text(render_report(res), encoding="utf-8")
    return path


@pytest.mark.parametrize("width", [800, 1400, 1920])
def test_report_reads_at_common_widths(report_file, width):
    shots = {report_file.with_name(f"{name}-{width}.png"): sel for name, sel in
             (("top", "body"), ("diagnosis", "#diagnosis"), ("storm", "#scenario-1"), ("summary", "#summary"))}
    page = load_page(CHROMIUM, report_file.as_uri(), width=width, height=1100, shots=shots,
                     expressions={"overflow": OVERFLOW, "overlaps": OVERLAPS, "clipped": CLIPPED, "legends": LEGENDS,
                                  "keys": "document.querySelectorAll('svg.lg-key').length",
                                  "texts": "document.querySelectorAll('svg.chart text').length"})
    assert page.console_errors == [] and page.exceptions == []
    assert page.evaluated["texts"] > 100  # the checks below looked at real charts
    assert page.evaluated["overflow"] <= 0, f"the page scrolls sideways by {page.evaluated['overflow']} px"
    assert page.evaluated["overlaps"] == [], page.evaluated["overlaps"]
    assert page.evaluated["clipped"] == [], page.evaluated["clipped"]
    assert page.evaluated["keys"] > 20 and page.evaluated["legends"] == [], page.evaluated["legends"]
    assert report_file.stat().st_size <= 1_000_000
    for png in shots:
        assert png_size(png.read_bytes())[0] == width


def test_the_overlap_check_catches_overlapping_text(tmp_path):
    """The negative control: two labels drawn on top of each other are reported."""
    bad = tmp_path / "bad.html"
    bad.write_text('<svg class="chart" aria-label="c" width="300" height="100"><text x="10" y="50">label one</text>'
                   '<text x="14" y="52">label two</text></svg><table><tr><td style="max-width:20px;overflow:hidden">'
                   'a very long cell</td></tr></table><div style="width:5000px">wide</div>'
                   '<figcaption class="legend"><svg class="lg-key"><line stroke="#3b6fd4"/></svg>a'
                   '<svg class="lg-key"><line stroke="#3b6fd4"/></svg>b</figcaption>')
    page = load_page(CHROMIUM, bad.as_uri(), width=1400, height=600,
                     expressions={"overflow": OVERFLOW, "overlaps": OVERLAPS, "clipped": CLIPPED,
                                  "legends": LEGENDS})
    assert page.evaluated["overlaps"] == ["c: label one / label two"]
    assert page.evaluated["legends"] == ["ab: #3b6fd4|solid"]
    assert page.evaluated["clipped"] and page.evaluated["overflow"] > 0


#: a real main job's results (the README's main-job command on the 2-core development machine, 2026-12-02:
#: 25 benchmarks on reference, reference:preemption_mode=swap and hf-cb), kept to hold the report to its budget
MAIN_JOB_RESULTS = Path(__file__).parent / "data" / "main_job_results.json.gz"
#: the main job's page at 1400 px: at most half the 28,398 px it measured before the report's second pass
HEIGHT_BUDGET_1400 = 28_398 // 2


def test_the_main_jobs_report_keeps_its_height_and_size_budget(tmp_path):
    """Today's renderer on a real main job: at most 1 MB, at most half its former height at 1400 px, and no
    sideways scroll or clipped text at 800, 1400 and 1920 px."""
    results = Results.from_dict(json.loads(gzip.decompress(MAIN_JOB_RESULTS.read_bytes())))
    page_file = tmp_path / "report.html"
    page_file.write_text(render_report(results), encoding="utf-8")
    assert page_file.stat().st_size <= 1_000_000, page_file.stat().st_size
    for width in (800, 1400, 1920):
        page = load_page(CHROMIUM, page_file.as_uri(), width=width, height=1100,
                         expressions={"height": "document.documentElement.scrollHeight", "overflow": OVERFLOW,
                                      "clipped": CLIPPED})
        assert page.console_errors == [] and page.exceptions == []
        assert page.evaluated["overflow"] <= 0 and page.evaluated["clipped"] == [], (width, page.evaluated)
        if width == 1400:
            assert page.evaluated["height"] <= HEIGHT_BUDGET_1400, page.evaluated["height"]
