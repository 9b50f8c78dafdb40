"""Runs over time (docs/benchmarks.md#runs-over-time): ``reports/index.html`` as small multiples of every run's headline
metrics, each point a link to its run, and ``kvbench compare A B --html`` drawing two runs side by side."""

from __future__ import annotations

import copy
import html as html_lib
import io
import re

import pytest

from kvbench.bench.formatting import fmt_metric
from kvbench.bench.results import Results
from kvbench.cli import main
from kvbench.report import trend
from kvbench.report.render import write_index
from tests.kvbench.test_report import URL_RE
from tests.kvbench.trace_factory import relabel, scaled, synthetic_results

SPEEDS = (1.0, 0.5, 1.5)  # oldest first


def save_runs(root, base: Results, speeds=SPEEDS, *, without_report: int | None = None,
              scale: str | None = None, start: int = 1) -> list[str]:
    names = []
    for i, speed in enumerate(speeds):
        res = scaled(base, speed)
        res.data["created"] = f"2026-01-{start + i:02d}T00:00:00+00:00"
        if scale is not None:
            for sc in res.scenarios:
                sc["parameters"]["scale"] = scale
        name = f"run-{start + i:02d}"
        res.save(root / name / "results.json")
        if i != without_report:
            (root / name / "report.html").write_text("<html></html>")
        names.append(name)
    return names


def storm_panel_svg(index: str, title: str = "output throughput") -> str:
    """The SVG of the storm's throughput small multiple."""
    start = index.index("Preemption storm</div>")  # the scenario as titled
    fig = index.index(title, start)
    return index[index.index("<svg", fig):index.index("</svg>", fig)]


@pytest.fixture(scope="module")
def base() -> Results:
    return synthetic_results()


def test_every_run_is_a_point_linking_to_its_report(tmp_path, base):
    names = save_runs(tmp_path, base, without_report=1)
    index = write_index(tmp_path).read_text()
    svg = storm_panel_svg(index)
    # the oldest and the newest runs have reports: their points are links; the middle one has none
    assert svg.count(f'href="./{names[0]}/report.html"') == 2  # one point per engine
    assert svg.count(f'href="./{names[2]}/report.html"') == 2
    assert f"./{names[1]}/report.html" not in svg and svg.count("<circle") == 6
    # the reference engine's throughput at each run, in the order made, in its tooltips
    ref = next(r for sc in base.scenarios if sc["name"] == "preemption_storm" for r in sc["results"]
               if r["engine"] == "reference")
    tips = re.findall(r"<title>(run-\d+) · reference: ([^<·]+) ·", html_lib.unescape(svg))
    expected = [(n, fmt_metric("output_throughput", ref["metrics"]["output_throughput"] * s).strip())
                for n, s in zip(names, SPEEDS, strict=True)]
    assert [(n, v.strip()) for n, v in tips] == expected


def test_points_sit_left_to_right_in_run_order_and_higher_for_more(tmp_path, base):
    save_runs(tmp_path, base)
    svg = storm_panel_svg(write_index(tmp_path).read_text())
    ref = [(float(x), float(y)) for x, y in re.findall(
        r'<circle cx="([\d.]+)" cy="([\d.]+)"[^>]*><title>run-\d+ · reference:', svg)]
    assert len(ref) == 3
    xs, ys = zip(*ref, strict=True)
    assert xs[0] < xs[1] < xs[2]
    assert ys[1] > ys[0] > ys[2]  # SVG y grows downward: the slowest run (0.5x) lowest, the fastest highest


def test_each_scale_is_its_own_set_of_small_multiples(tmp_path, base):
    save_runs(tmp_path, base, speeds=(1.0, 1.1), scale="quick")
    save_runs(tmp_path, base, speeds=(1.0,), scale="full", start=10)
    view = trend.trend_view([trend.Run(p.parent.name, Results.load(p).data["created"], "", True, Results.load(p))
                             for p in sorted(tmp_path.glob("*/results.json"))])
    assert [(s["scale"], s["runs"]) for s in view["scales"]] == [("quick", 2), ("full", 1)]
    index = write_index(tmp_path).read_text()
    assert "Scale: quick" in index and "Scale: full" in index


def test_every_scenario_draws_its_own_headline_metric():
    mode, metrics = trend.scenario_metrics("chunked_prefill_stalls")
    assert mode == "chunked" and [m for m, _ in metrics] == ["tbt_p99", "preemptions"]
    mode, metrics = trend.scenario_metrics("a scenario nobody declared")
    assert mode is None and [m for m, _ in metrics] == ["output_throughput", "tbt_p99", "preemptions"]


def test_the_trend_page_escapes_names_and_references_no_url(tmp_path, base):
    save_runs(tmp_path, relabel(base, "<script>alert(1)</script>"), speeds=(1.0, 1.2))
    index = write_index(tmp_path).read_text()
    assert "<script>alert(1)" not in index and "&lt;script&gt;alert(1)" in index
    assert not URL_RE.search(index)


# --------------------------------------------------------------------------------------------
# kvbench compare --html


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory, base):
    d = tmp_path_factory.mktemp("compare")
    more = Results(copy.deepcopy(base.to_dict()))
    storm = next(sc for sc in more.scenarios if sc["name"] == "preemption_storm")
    for r in storm["results"]:
        r["metrics"]["preemptions"] *= 2  # a count that regresses beyond its noise floor (10% on the wall clock)
    return d, base.save(d / "a.json"), more.save(d / "b.json")


def test_compare_html_shows_both_runs_side_by_side(files, base):
    d, a, b = files
    out_html = d / "side.html"
    code, out = run("compare", str(a), str(b), "--html", str(out_html))
    assert code == 1  # the exit status is the gate's, --html or not
    assert f"side by side written to {out_html}" in out
    page = out_html.read_text()
    assert str(a) in page and str(b) in page
    assert "▼ regression gate failed: " in page and "REGRESSION preemption_storm / reference: preemptions" in page
    storm = next(sc for sc in base.scenarios if sc["name"] == "preemption_storm")
    ref = next(r for r in storm["results"] if r["engine"] == "reference")
    # both runs' own values in one cell: B's, then A's with the change
    before = ref["metrics"]["preemptions"]
    cell = re.search(r"<td class=\"delta bad regressed\"><span class=\"b\">([^<]+)</span><small>A ([^ ]+) ·", page)
    assert cell and cell.groups() == (fmt_metric("preemptions", before * 2), fmt_metric("preemptions", before))
    # absolute values, not same-run ratios dressed in the metric's unit
    assert fmt_metric("output_throughput", ref["metrics"]["output_throughput"]) in page
    assert not URL_RE.search(page)


def test_compare_html_without_regression_and_escaped(tmp_path, base):
    marked = relabel(base, "<img onerror=x>").save(tmp_path / "m.json")
    code, _ = run("compare", str(marked), str(marked), "--html", str(tmp_path / "same.html"))
    page = (tmp_path / "same.html").read_text()
    assert code == 0 and "✓ no regression" in page
    assert "<img onerror" not in page and "&lt;img onerror=x&gt;" in page


def test_compare_html_to_an_unwritable_place_is_a_usage_error(files, tmp_path):
    _, a, _ = files
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _ = run("compare", str(a), str(a), "--html", str(blocker / "x.html"))
    assert code == 2


# --------------------------------------------------------------------------------------------
# one clock per line


def on_clock(results: Results, clock: str, engines: tuple[str, ...] | None = None) -> Results:
    """``results`` with every result (or those of ``engines``) recorded on ``clock``."""
    for _, r in results.iter_results():
        if engines is None or r["engine"] in engines:
            r["clock"] = {"clock": clock, "step_seconds": 0.01 if clock == "step" else None}
    return results


def test_runs_on_two_clocks_get_a_row_per_clock_and_no_line_joins_them(tmp_path, base):
    names = save_runs(tmp_path, base, speeds=(1.0, 1.0, 1.0))
    for name, clock in zip(names, ("step", "step", "wall"), strict=True):  # the third run: another session's clock
        path = tmp_path / name / "results.json"
        on_clock(Results.load(path), clock).save(path)
    runs = [trend.Run(n, Results.load(tmp_path / n / "results.json").data["created"], "", True,
                      Results.load(tmp_path / n / "results.json")) for n in names]
    [scale] = trend.trend_view(runs)["scales"]
    storm = [r for r in scale["rows"] if r["scenario"].startswith("Preemption storm")]
    assert [r["scenario"] for r in storm] == ["Preemption storm (step clock, 0.01 s a step)",
                                              "Preemption storm (wall clock)"]
    step_svg, wall_svg = (str(r["charts"][0]["svg"]) for r in storm)
    # the step row joins the two step runs; the wall row holds the third run alone: a point, no line to the others
    assert step_svg.count("<polyline") == 2 and step_svg.count("<circle") == 4  # two engines x two runs
    assert wall_svg.count("<polyline") == 0 and wall_svg.count("<circle") == 2
    assert "run-03" not in step_svg and "run-01" not in wall_svg
    assert "2 clocks (step clock, 0.01 s a step; wall clock)" in scale["clock_note"]
    index = write_index(tmp_path).read_text()
    assert "no line joins two clocks" in index and "Preemption storm (wall clock)" in index


def test_a_run_mixing_clocks_puts_each_engine_in_its_own_clock_row(tmp_path, base):
    """A file from before the one-clock rule: the reference on the step clock, the other engine on the wall."""
    run_ = on_clock(on_clock(scaled(base, 1.0), "wall"), "step", engines=("reference",))
    run_.data["created"] = "2026-01-01T00:00:00+00:00"
    rows = trend.panels([trend.Run("r", run_.data["created"], "", True, run_)])
    step = {e for (name, clock), row in rows.items() if name == "preemption_storm" and clock[0] == "step"
            for p in row for e in p.series}
    wall = {e for (name, clock), row in rows.items() if name == "preemption_storm" and clock[0] == "wall"
            for p in row for e in p.series}
    assert step == {"reference"} and wall == {"other"}


def test_runs_on_one_clock_keep_one_row_per_scenario_and_no_clock_note(tmp_path, base):
    names = save_runs(tmp_path, base, speeds=(1.0, 1.2))
    runs = [trend.Run(n, f"2026-01-0{i + 1}", "", True, Results.load(tmp_path / n / "results.json"))
            for i, n in enumerate(names)]
    [scale] = trend.trend_view(runs)["scales"]
    assert scale["clock_note"] == "" and [r["scenario"] for r in scale["rows"]].count("Preemption storm") == 1
