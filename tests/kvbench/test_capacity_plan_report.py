"""``kvbench simulate --report DIR``: the capacity plan as data, as text, as plan.json and as plan.html.

One small sweep runs once for the module (200 requests of the evening surge on Llama-3-8B/H200,
max_num_seqs 4 and 16, a pool of 300 blocks that preempts and one of 3,000, swap and recompute:
eight runs of about a second each on a busy 2-core machine).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from kvbench.cli import main
from kvbench.report.plan_report import render_plan, write_plan_report
from kvbench.sim.capacity_plan import (
    CapacityPlan,
    Claim,
    CostCrossover,
    Knee,
    ModeComparison,
    ModeFigures,
    PlanDocument,
    PoolForBudget,
    SimulationSetup,
    capacity_plan,
)
from kvbench.sim.simulate import SimRun
from tests.kvbench.chromium import INSTALL_HINT, find_chromium, load_page

ENGINE = "sim:hardware=h200,model=llama-3-8b"
SWEEP = "max_num_seqs=4,16,num_gpu_blocks=300,3000,preemption_mode=swap,recompute"
EVIL = "<script>alert(1)</script>"
EVIL_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
URL_RE = re.compile(r"https?:|//cdn|<link\b|@import|\bsrc\s*=|url\((?!#)", re.IGNORECASE)


def _simulate(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["simulate", *argv], out=out)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory) -> tuple[Path, str]:
    """The report folder of the module's sweep, and what the command printed."""
    folder = tmp_path_factory.mktemp("plan") / "nested" / "report"  # created by the command
    old = os.umask(0o077)  # the files must come out 0644 whatever the umask
    try:
        code, out = _simulate("--requests", "200", "--engine", ENGINE, "--sweep", SWEEP, "--report", str(folder))
    finally:
        os.umask(old)
    assert code == 0, out
    return folder, out


@pytest.fixture(scope="module")
def plan_data(sweep_report) -> dict:
    return json.loads((sweep_report[0] / "plan.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def plan_html(sweep_report) -> str:
    return (sweep_report[0] / "plan.html").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------ the CLI writes both files


def test_report_files_exist_mode_0644_and_stdout_keeps_the_plan(sweep_report, plan_data):
    folder, out = sweep_report
    for name in ("plan.html", "plan.json"):
        assert (folder / name).stat().st_mode & 0o777 == 0o644, name
    assert f"capacity plan written to {folder / 'plan.html'} and {folder / 'plan.json'}" in out
    # stdout is what it was without --report: the runs table, then the plan in words
    assert CapacityPlan.from_json(plan_data["plan"]).text() in out
    assert out.index("knobs ") < out.index("Knee concurrency") < out.index("capacity plan written")


def test_plan_json_is_plain_and_round_trips(plan_data, plan_html):
    def no_constants(name: str) -> None:
        raise AssertionError(f"plan.json holds {name}")

    text = json.dumps(plan_data)
    assert json.loads(text, parse_constant=no_constants) == plan_data
    assert plan_data["schema_version"] == 1 and plan_data["times"] == "simulated seconds"
    doc = PlanDocument.from_json(plan_data)
    assert doc.to_json() == plan_data
    assert len(doc.runs) == 8 and all(r.requests == 200 for r in doc.runs)
    assert doc.setup.sweep == {"max_num_seqs": [4, 16], "num_gpu_blocks": [300, 3000],
                               "preemption_mode": ["swap", "recompute"]}
    assert (doc.setup.workload, doc.setup.requests, doc.setup.engine_spec) == ("evening_surge_at_scale", 200, ENGINE)
    assert doc.setup.arrival_rate and doc.setup.arrival_rate == doc.plan.arrival_rate
    # the small pool preempts in both modes: the sweep exercises what the plan reads
    small = [r for r in doc.runs if r.knobs["num_gpu_blocks"] == 300]
    assert all((r.figures["preemptions_swap"] or 0) + (r.figures["preemptions_recompute"] or 0) > 0 for r in small)
    # the page is a function of the document alone
    assert render_plan(doc) == plan_html


def test_page_states_simulated_hardware_model_and_setup(plan_html, plan_data):
    setup = plan_data["setup"]
    assert "Every time on this page is simulated seconds" in plan_html
    assert "<b>h200</b> hardware profile" in plan_html and "uncalibrated public specs" in plan_html
    assert "llama-3-8b" in plan_html and ENGINE in plan_html
    assert "evening_surge_at_scale: 200 requests" in plan_html
    assert f"{setup['arrival_rate']:,.1f} requests/s on average" in plan_html
    assert "max_num_seqs = 4, 16; num_gpu_blocks = 300, 3000; preemption_mode = swap, recompute" in plan_html
    assert "0.01 preemptions per request" in plan_html  # the budget
    rows = re.search(r'<section id="runs">.*?</section>', plan_html, re.S).group(0)
    assert rows.count("<tr>") == 1 + 8  # header + one row per run


def test_page_holds_knee_pool_crossover_and_charts(plan_html, plan_data):
    plan = CapacityPlan.from_json(plan_data["plan"])
    assert plan.knees and plan.pools and plan.modes
    knee_rows = re.findall(r'<tr class="knee"><td class="l wrap">(.*?)</td><td><b>(\d+)</b></td>', plan_html)
    assert knee_rows == [(k_label(k.group), str(k.max_num_seqs)) for k in plan.knees]
    pool_rows = re.findall(r'<tr class="pool">.*?</tr>', plan_html, re.S)
    assert len(pool_rows) == len(plan.pools)
    for row, pool in zip(pool_rows, plan.pools, strict=True):
        if pool.num_gpu_blocks is None:
            assert "none of the pools tried stays within the budget" in row
        else:
            assert f"<b>{pool.num_gpu_blocks}</b>" in row
    assert "Pool size for at most 0.01 preemptions per request" in plan_html
    assert f"at this workload's arrival rate ({plan.arrival_rate:,.1f} requests/s" in flat(plan_html)
    statement = plan.crossover.statement
    assert statement.startswith(("swap is cheaper", "recompute is cheaper"))
    assert f"<b>{statement}</b>" in plan_html
    # three charts against each swept number, the knees and the budget marked
    assert plan_html.count('<svg class="chart"') == 6
    for knob in ("max_num_seqs", "num_gpu_blocks"):
        for title in ("Throughput", "p99 inter-token gap", "Preemptions per request"):
            assert f"<title>{title} vs {knob}</title>" in plan_html
    assert f"knee {plan.knees[0].max_num_seqs}" in plan_html and "budget 0.01" in plan_html
    assert not URL_RE.search(plan_html)


def flat(html: str) -> str:
    """``html`` with every run of whitespace as one space: assertions need not know the template's lines."""
    return re.sub(r"\s+", " ", html)


def k_label(group: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(group.items()))


CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason=f"Chromium not found; {INSTALL_HINT}")
@pytest.mark.slow
def test_chromium_loads_the_page_offline_without_errors(sweep_report):
    page_file = sweep_report[0] / "plan.html"
    page = load_page(CHROMIUM, page_file.as_uri(), expressions={
        "charts": "document.querySelectorAll('svg.chart').length",
        "svg_bad": "Array.from(document.querySelectorAll('svg.chart')).filter(s => s.getBBox().width < 50).length",
    })
    assert page.console_errors == [] and page.exceptions == [] and page.log_errors == []
    assert page.requests == [page_file.as_uri()]
    assert page.evaluated == {"charts": 6, "svg_bad": 0}


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_report_folder_that_cannot_be_made_exits_2_before_simulating(tmp_path, capsys, where):
    blocker = tmp_path / "plan.txt"
    blocker.write_text("not a folder")
    target = blocker if where == "a file" else blocker / "sub"
    code, out = _simulate("--requests", "20", "--report", str(target))
    assert code == 2
    err = capsys.readouterr().err
    assert f"kvbench: error: --report {str(target)!r}: cannot create the folder" in err
    assert "simulating" not in out  # refused before minutes of simulating, not after


def test_report_file_that_cannot_be_written_exits_2(tmp_path, capsys):
    (tmp_path / "plan.html").mkdir()  # a folder where the page should go
    code, out = _simulate("--requests", "20", "--report", str(tmp_path))
    assert code == 2
    assert f"kvbench: error: cannot write the capacity plan into --report {str(tmp_path)!r}" in capsys.readouterr().err
    assert "Cost model" in out  # the plan itself was still printed


# ------------------------------------------------------------------------------ escaping


def test_markup_in_a_hardware_profile_name_is_escaped_and_calibrated_is_said(tmp_path):
    """A profile file's name and source reach the page only escaped; a profile with a fit reads calibrated."""
    from reference_engine.costs import load_profile

    profile = {**load_profile("h200").to_dict(), "name": EVIL, "source": EVIL, "fit": {"median_error": 0.05}}
    path = tmp_path / "evil-profile.json"
    path.write_text(json.dumps(profile))
    code, out = _simulate("--requests", "20", "--engine", f"sim:hardware={path},model=llama-3-8b",
                          "--report", str(tmp_path / "r"))
    assert code == 0, out
    html = (tmp_path / "r" / "plan.html").read_text(encoding="utf-8")
    assert EVIL not in html and EVIL_ESCAPED in html
    assert "a <b>calibrated</b> profile" in html and "uncalibrated" not in html
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["setup"]["hardware"] == EVIL


def _evil_document() -> PlanDocument:
    """Markup everywhere a name or a knob value reaches the page."""
    figures = {"output_throughput": 100.0, "ttft_p50": 0.1, "ttft_p99": 0.2, "tbt_p99": 0.01,
               "preemptions_recompute": 1, "preemptions_swap": 0, "recomputed_tokens": 10, "swapped_out_bytes": 0,
               "preemptions_per_request": 0.5}
    runs = [SimRun({"max_num_seqs": n, "num_gpu_blocks": 100, "preemption_mode": EVIL, "scheduling_policy": EVIL},
                   dict(figures), 2, 0.1) for n in (4, 8)]
    group = {"num_gpu_blocks": 100, "preemption_mode": EVIL, "scheduling_policy": EVIL}
    plan = CapacityPlan(
        preemption_budget=0.01,
        crossover=CostCrossover(EVIL, EVIL, EVIL, 64, 8192, EVIL),
        knees=[Knee(group, 4, 100.0, 100.0, 0.01, 0.5)],
        pools=[PoolForBudget({"max_num_seqs": 4, "preemption_mode": EVIL}, None, None, [100])],
        modes=[ModeComparison({"max_num_seqs": 4}, [ModeFigures(EVIL, 100.0, 0.01, 1, 0, 0.5)], [Claim(EVIL, None)])],
        arrival_rate=2.0)
    setup = SimulationSetup(engine_spec=EVIL, engine_name=EVIL, hardware=EVIL, hardware_source=EVIL, calibrated=False,
                            model=EVIL, clock=EVIL, workload=EVIL, requests=2, arrival_rate=2.0, arrival_span_s=1.0,
                            sweep={"max_num_seqs": [4, 8], "preemption_mode": [EVIL]},
                            base_knobs={"scheduling_policy": EVIL})
    return PlanDocument(setup, runs, plan)


def test_renderer_escapes_every_name_and_value(tmp_path):
    doc = _evil_document()
    html = render_plan(doc)
    assert EVIL not in html
    assert html.count(EVIL_ESCAPED) > 15  # header, setup, knee, pool, modes, claims, runs, chart legends, text
    assert "|safe" not in (Path(__file__).parents[2] / "kvbench/report/templates/plan.html").read_text()
    page, data = write_plan_report(doc, tmp_path / "out")
    assert page.read_text(encoding="utf-8") == html
    assert PlanDocument.from_json(json.loads(data.read_text(encoding="utf-8"))) == doc


# ------------------------------------------------------------------------------ the plan as data and as text


def _figures(tp, tbt, rec, swap, ppr):
    return {"output_throughput": tp, "ttft_p50": 0.5, "ttft_p99": 2.0, "tbt_p99": tbt, "preemptions_recompute": rec,
            "preemptions_swap": swap, "recomputed_tokens": rec * 100, "swapped_out_bytes": swap * 1e6,
            "preemptions_per_request": ppr}


#: (num_gpu_blocks, max_num_seqs, preemption_mode, tok/s, p99 TBT, recompute, swap, preemptions/request)
GRID = [(300, 4, "swap", 224.6, 0.0056, 0, 9, 0.045), (300, 4, "recompute", 224.2, 0.0056, 9, 0, 0.045),
        (300, 4, "auto", 230.0, 0.0050, 4, 5, 0.045),
        (300, 16, "swap", 224.6, 0.0124, 0, 97, 0.485), (300, 16, "recompute", 224.2, 0.0155, 97, 0, 0.485),
        (300, 16, "auto", 240.0, 0.0150, 50, 47, 0.485),
        (3000, 4, "swap", 369.2, 0.0059, 0, 0, 0.0), (3000, 4, "recompute", 369.2, 0.0059, 0, 0, 0.0),
        (3000, 4, "auto", None, None, 0, 0, None),
        (3000, 16, "swap", 444.2, 0.0131, 0, 3, 0.015), (3000, 16, "recompute", 443.7, 0.013, 3, 0, 0.015),
        (3000, 16, "auto", 420.0, 0.013, 1, 2, 0.015)]


def _runs(modes: tuple[str, ...]) -> list[SimRun]:
    return [SimRun({"num_gpu_blocks": b, "max_num_seqs": s, "preemption_mode": m, "enable_prefix_caching": True},
                   _figures(tp, tbt, rec, swap, ppr), 200, 0.5)
            for b, s, m, tp, tbt, rec, swap, ppr in GRID if m in modes]


@pytest.fixture(scope="module")
def adapter():
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint

    return make_adapter(parse_engine_spec(ENGINE), str(builtin_checkpoint("tiny")))


#: what ``capacity_plan(...).text()`` printed for the swap and recompute runs of GRID at a budget of 0.02
#: before the plan became data (captured from the earlier implementation)
TEXT_BEFORE = """\
Knee concurrency (smallest max_num_seqs within 5% of the best throughput):
  enable_prefix_caching=True, num_gpu_blocks=300, preemption_mode=swap: knee at max_num_seqs=4 (224.6 tok/s of best 224.6; p99 TBT 5.6 ms, 0.045 preemptions/request)
  enable_prefix_caching=True, num_gpu_blocks=300, preemption_mode=recompute: knee at max_num_seqs=4 (224.2 tok/s of best 224.2; p99 TBT 5.6 ms, 0.045 preemptions/request)
  enable_prefix_caching=True, num_gpu_blocks=3000, preemption_mode=swap: knee at max_num_seqs=16 (444.2 tok/s of best 444.2; p99 TBT 13.1 ms, 0.015 preemptions/request)
  enable_prefix_caching=True, num_gpu_blocks=3000, preemption_mode=recompute: knee at max_num_seqs=16 (443.7 tok/s of best 443.7; p99 TBT 13.0 ms, 0.015 preemptions/request)
Pool size for <= 0.02 preemptions per request at this workload's arrival rate:
  enable_prefix_caching=True, max_num_seqs=4, preemption_mode=swap: num_gpu_blocks=3000 (0.000 preemptions/request)
  enable_prefix_caching=True, max_num_seqs=4, preemption_mode=recompute: num_gpu_blocks=3000 (0.000 preemptions/request)
  enable_prefix_caching=True, max_num_seqs=16, preemption_mode=swap: num_gpu_blocks=3000 (0.015 preemptions/request)
  enable_prefix_caching=True, max_num_seqs=16, preemption_mode=recompute: num_gpu_blocks=3000 (0.015 preemptions/request)
Swap vs recompute (simulated runs):
  enable_prefix_caching=True, max_num_seqs=4, num_gpu_blocks=300: swap: 224.6 tok/s, p99 TBT 5.6 ms; recompute: 224.2 tok/s, p99 TBT 5.6 ms
  enable_prefix_caching=True, max_num_seqs=16, num_gpu_blocks=300: swap: 224.6 tok/s, p99 TBT 12.4 ms; recompute: 224.2 tok/s, p99 TBT 15.5 ms
  enable_prefix_caching=True, max_num_seqs=4, num_gpu_blocks=3000: swap: 369.2 tok/s, p99 TBT 5.9 ms; recompute: 369.2 tok/s, p99 TBT 5.9 ms
  enable_prefix_caching=True, max_num_seqs=16, num_gpu_blocks=3000: swap: 444.2 tok/s, p99 TBT 13.1 ms; recompute: 443.7 tok/s, p99 TBT 13.0 ms
Cost model (llama-3-8b on h200): swap is cheaper at every length up to 8192 tokens (a victim swapped out and back in vs its tokens prefilled again)."""  # noqa: E501


def test_structured_plan_text_is_what_was_printed_before(adapter):
    plan = capacity_plan(_runs(("swap", "recompute")), adapter, 0.02)
    assert plan.text() == TEXT_BEFORE
    assert CapacityPlan.from_json(json.loads(json.dumps(plan.to_json()))).text() == TEXT_BEFORE


def test_structured_plan_holds_the_findings(adapter):
    plan = capacity_plan(_runs(("swap", "recompute", "auto")), adapter, 0.01)
    knees = {(k.group["num_gpu_blocks"], k.group["preemption_mode"]): k.max_num_seqs for k in plan.knees}
    assert knees == {(300, "swap"): 4, (300, "recompute"): 4, (300, "auto"): 4,
                     (3000, "swap"): 16, (3000, "recompute"): 16, (3000, "auto"): 16}
    knee = plan.knees[2]  # 300 blocks, auto: 230 is within 5% of the best, 240
    assert (knee.throughput, knee.best_throughput, knee.tbt_p99) == (230.0, 240.0, 0.005)
    pools = {(p.group["max_num_seqs"], p.group["preemption_mode"]): p.num_gpu_blocks for p in plan.pools}
    assert pools == {(4, "swap"): 3000, (4, "recompute"): 3000, (4, "auto"): 3000,
                     (16, "swap"): None, (16, "recompute"): None, (16, "auto"): None}
    assert plan.pools[3].swept == [300, 3000] and plan.pools[3].preemptions_per_request is None
    assert plan.arrival_rate is None  # no workload given
    from kvbench.bench.scenarios.policies import auto_vs_fixed_claims

    first = plan.modes[0]
    assert [m.mode for m in first.modes] == ["swap", "recompute", "auto"]
    assert first.claims == [Claim(c, held) for c, held in auto_vs_fixed_claims(230.0, 224.2, 224.6, True).items()]
    assert all(c.held is None for c in plan.modes[2].claims)  # auto's throughput unknown: undecided
    assert plan.crossover.model == "llama-3-8b" and plan.crossover.hardware == "h200"
    assert plan.crossover.statement in plan.text()


def test_findings_of_knobs_no_run_has_are_absent(adapter):
    runs = [r for r in _runs(("swap",)) if r.knobs["num_gpu_blocks"] == 300]
    for r in runs:
        del r.knobs["num_gpu_blocks"], r.knobs["preemption_mode"]
    plan = capacity_plan(runs, adapter)
    assert plan.knees is not None and plan.pools is None and plan.modes is None
    assert plan.text().splitlines()[0].startswith("Knee concurrency") and "Pool size" not in plan.text()
