"""The first screen answers "did it regress": a run compares with the newest earlier run in the report
directory with the same engines and scale, names what regressed in a banner, links that run and the run
index, and colours each headline card by its scenario's verdict."""

from __future__ import annotations

import re

from kvbench.bench.results import Results
from kvbench.report.render import previous_run, render_report, write_report
from tests.kvbench.trace_factory import synthetic_results


def run(created: str, speed: float = 1.0, engines: tuple[str, ...] = ("reference", "other"),
        scale: str = "quick") -> Results:
    """A run whose engine "other" serves at ``speed`` times its usual throughput (the gate compares same-run
    ratios to the reference engine, so only one engine's change is a regression)."""
    res = synthetic_results(engines=engines)
    for _, r in res.iter_results():
        if r["engine"] == "other":
            r["metrics"]["output_throughput"] *= speed
    res.data["created"] = created
    for sc in res.scenarios:
        sc["parameters"]["scale"] = scale
    return res


def test_the_newest_earlier_run_with_the_same_engines_and_scale_is_found(tmp_path):
    for name, res in (("a", run("2026-01-01")), ("b", run("2026-01-02")), ("c", run("2026-01-03", scale="full")),
                      ("d", run("2026-01-04", engines=("reference",))), ("e", run("2026-01-09"))):
        write_report(res, tmp_path / name, compare_previous=False)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    current = run("2026-01-05")
    assert previous_run(tmp_path, current) == tmp_path / "b" / "results.json"  # not c (scale), d (engines), e (later)
    assert previous_run(tmp_path, run("2025-12-31")) is None


def test_a_run_reports_its_regressions_against_the_previous_run(tmp_path):
    write_report(run("2026-01-01"), tmp_path / "before")
    page = write_report(run("2026-01-02", speed=0.5), tmp_path / "after").read_text()
    first = page[:page.index('id="headlines"')]
    assert re.search(r"▼ \d+\s+regressions? against\s+the previous run <a href=\"../before/report.html\">before</a>",
                     first)
    assert "output_throughput" in first  # the banner names what regressed
    assert '<a class="runs" href="../index.html">every run</a>' in first
    assert 'class="card headline' in page and " regressed\"" in page and ">regressed</span>" in page
    # the same speed again: no regression, cards say so
    page = write_report(run("2026-01-03", speed=0.5), tmp_path / "again").read_text()
    assert "✓ No regression against" in page and "../after/report.html" in page and ">no regression</span>" in page


def test_without_an_earlier_run_the_banner_says_so_and_no_card_is_coloured(tmp_path):
    page = write_report(run("2026-01-01"), tmp_path / "only").read_text()
    assert "No earlier run with the same engines and scale to compare with" in page
    assert ">regressed</span>" not in page and ">no regression</span>" not in page
    assert "every run" not in page  # no other run: no index to link
    # rendering without a directory: an explicit baseline still works, and nothing links a run
    page = render_report(run("2026-01-02", speed=0.5), baseline=run("2026-01-01"))
    assert re.search(r"regressions? against\s+the baseline", page) and "../" not in page
