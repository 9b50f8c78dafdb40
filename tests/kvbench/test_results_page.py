"""``kvbench results-page``: docs/results.md generated from results files, each table naming the command,
commit and machine of its run, and no section written empty."""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path

import pytest

from kvbench.bench.results import Results, command_line
from kvbench.cli import main
from tests.kvbench.trace_factory import synthetic_results

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["pytester"]


def stamped(results: Results, *, command: str | None, commit: str, host: str, created: str) -> Results:
    """``results`` as a run on ``host`` at ``commit`` would have written them, with ``command`` (None: a file
    from before the command was recorded)."""
    results.data["command"] = command
    results.data["commit"] = {"id": commit, "branch": "main", "dirty": False}
    results.data["machine"] = {"hostname": host, "cpu_count": 8, "device": "cpu", "torch": "2.13.0",
                               "python": "3.11.7", "platform": "Linux"}
    results.data["created"] = created
    return results


def conformance_run(engine: str, outcomes: dict[str, str], **stamp) -> Results:
    res = stamped(Results(data={"schema_version": 1, "engines": [], "scenarios": []}), **stamp)
    for check, outcome in outcomes.items():
        res.add_conformance({"engine": engine, "check": check, "nodeid": f"suites/conformance/test_x.py::{check}",
                             "outcome": outcome, "reason": None if outcome == "passed" else f"why {check}"})
    return res


def page_of(tmp_path: Path, *runs: Results) -> tuple[int, str]:
    paths = [str(r.save(tmp_path / f"run{i}" / "results.json")) for i, r in enumerate(runs)]
    out = io.StringIO()
    target = tmp_path / "results.md"
    code = main(["results-page", *paths, "-o", str(target)], out=out)
    return code, (target.read_text() if target.exists() else out.getvalue())


def sections(page: str) -> dict[str, str]:
    """{"## heading": its text up to the next "## " heading}."""
    parts = re.split(r"^(## .*)$", page, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.fixture(scope="module")
def bench() -> Results:
    return stamped(synthetic_results(), commit="b" * 40, host="bench-host", created="2026-12-06T10:44:06+00:00",
                   command="pytest suites/benchmarks --benchmark --engine reference --engine other")


def test_the_page_is_generated_from_the_files_given(tmp_path, bench):
    checks = conformance_run("reference", {"refcount_holds": "passed", "swap_survives": "failed"},
                             command="pytest suites/conformance --engine reference", commit="c" * 40,
                             host="check-host", created="2026-12-06T09:18:13+00:00")
    code, page = page_of(tmp_path, checks, bench)
    assert code == 0
    found = sections(page)
    assert list(found) == ["## Conformance", "## Storm headlines", "## Engine against engine", "## Not in these files"]
    assert "| `refcount_holds` | passed |" in found["## Conformance"]
    assert "| `swap_survives` | **FAILED** [1] |" in found["## Conformance"] and "[1] why swap_survives" in page
    # the storm's verdict and each engine's figure, from the file: the engine's own throughput median
    storm = next(r for sc in bench.scenarios if sc["name"] == "preemption_storm" for r in sc["results"]
                 if r["engine"] == "other")
    assert "| Preemption storm |" in found["## Storm headlines"]
    tput = f"{storm['metrics']['output_throughput']:,.1f} tok/s"
    assert tput in found["## Engine against engine"] and "of the reference" in found["## Engine against engine"]
    assert "simulator" in found["## Not in these files"]
    # the page says how to make it again, from these very files
    assert "python3 -m kvbench results-page " in page and str(tmp_path / "run1" / "results.json") in page


def test_every_table_names_its_command_commit_and_machine(tmp_path, bench):
    checks = conformance_run("reference", {"refcount_holds": "passed"},
                             command="pytest suites/conformance --engine reference", commit="c" * 40,
                             host="check-host", created="2026-12-06T09:18:13+00:00")
    _, page = page_of(tmp_path, checks, bench)
    found = sections(page)
    for heading, run in (("## Conformance", ("pytest suites/conformance --engine reference", "commit ccccccc",
                                             "check-host: 8 CPUs", "2026-12-06 09:18 UTC")),
                         ("## Storm headlines", ("pytest suites/benchmarks --benchmark", "commit bbbbbbb",
                                                 "bench-host: 8 CPUs", "2026-12-06 10:44 UTC")),
                         ("## Engine against engine", ("pytest suites/benchmarks --benchmark", "commit bbbbbbb",
                                                       "bench-host", "2026-12-06 10:44 UTC"))):
        text = found[heading]
        assert all(bit in text for bit in run), (heading, text)
        assert any(line.startswith("|---") for line in text.splitlines())  # ... and has its table
    assert "bench-host" not in found["## Conformance"] and "check-host" not in found["## Storm headlines"]


def test_a_file_without_a_section_gives_no_empty_table(tmp_path):
    checks = conformance_run("reference", {"refcount_holds": "passed"}, command="pytest suites/conformance",
                             commit="c" * 40, host="h", created="2026-12-06T09:18:13+00:00")
    code, page = page_of(tmp_path, checks)
    assert code == 0
    found = sections(page)
    assert list(found) == ["## Conformance", "## Not in these files"]
    assert sum(line.startswith("|---") for line in page.splitlines()) == 1  # the conformance matrix alone
    assert "benchmark results" in found["## Not in these files"]
    # and files that hold no table at all are an error, not an empty page
    empty = stamped(Results(data={"schema_version": 1, "engines": [], "scenarios": []}), command=None,
                    commit="d" * 40, host="h", created="2026-12-06T09:00:00+00:00")
    code, _ = page_of(tmp_path / "empty", empty)
    assert code == 2


def test_the_newest_run_of_a_check_is_the_one_shown(tmp_path):
    old = conformance_run("reference", {"refcount_holds": "failed", "swap_survives": "passed"}, command="pytest a",
                          commit="1" * 40, host="h", created="2026-12-05T09:00:00+00:00")
    new = conformance_run("reference", {"refcount_holds": "passed"}, command="pytest b", commit="2" * 40,
                          host="h", created="2026-12-06T09:00:00+00:00")
    for order in ((old, new), (new, old)):  # the order on the command line does not matter; the dates do
        _, page = page_of(tmp_path / str(id(order[0])), *order)
        assert "| `refcount_holds` | passed |" in page and "| `swap_survives` | passed |" in page
        assert "- `reference`, 1 check: `pytest b`" in page and "- `reference`, 1 check: `pytest a`" in page


def test_a_file_without_its_command_says_so_and_invents_none(tmp_path):
    checks = conformance_run("reference", {"refcount_holds": "passed"}, command=None, commit="c" * 40, host="h",
                             created="2026-12-06T09:18:13+00:00")
    _, page = page_of(tmp_path, checks)
    assert ("command not recorded (the file predates its record); it holds engines `reference`; conformance checks "
            "from `suites/conformance/test_x.py`") in page
    assert "`pytest" not in sections(page)["## Conformance"]  # no command is made up


def test_engines_on_two_clocks_are_not_set_side_by_side(tmp_path, bench):
    mixed = Results.from_dict(copy.deepcopy(bench.to_dict()))
    for _, r in mixed.iter_results():
        r["clock"] = {"clock": "step" if r["engine"] == "reference" else "wall", "step_seconds": 0.01}
    _, page = page_of(tmp_path, mixed)
    assert "## Engine against engine" not in page  # every scenario of this file mixes clocks
    assert "two engines or more on one scenario" in sections(page)["## Not in these files"]


def test_results_record_the_command_that_wrote_them():
    assert Results().data["command"] == command_line()
    assert command_line(["/venv/bin/pytest", "suites/benchmarks", "--engine", "server:preset=vllm,args=-x y"]) == \
        "pytest suites/benchmarks --engine 'server:preset=vllm,args=-x y'"
    assert command_line(["/usr/lib/python3/site-packages/pytest/__main__.py", "-k", "storm"]) == "pytest -k storm"
    assert command_line(["/src/kvbench/__main__.py", "report", "R.json"]) == "kvbench report R.json"
    # a file from before the record reads as "not recorded", never as an empty command
    old = Results.from_dict({"schema_version": 1, "engines": [], "scenarios": []})
    assert old.data["command"] is None


def test_docs_results_md_is_the_generated_page():
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert page.startswith("# Results\n") and "<!-- generated by `python3 -m kvbench results-page " in page
    assert "Run: " in page or "Runs:" in page  # its tables name their runs


def test_a_run_split_over_xdist_workers_records_the_command_typed(pytester: pytest.Pytester):
    """The workers' results are merged in the controller: the file keeps the controller's command, not a worker's."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.benchmark
        @pytest.mark.parametrize("n", [1, 2])
        def test_records(n, kvbench_results):
            kvbench_results.add_scenario_result(f"storm_{n}", "reference", {"preemptions": n})
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark", "--report-dir", "out",
                                           "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=2)
    [path] = (pytester.path / "out").glob("*/results.json")
    command = Results.load(path).data["command"]
    assert command.startswith("pytest ") and "-n 2 --dist loadgroup" in command, command
