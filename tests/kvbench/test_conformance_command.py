"""``kvbench conformance``: a run's verdicts as a Markdown table, through the command's entry point."""

from __future__ import annotations

import io
from pathlib import Path

from kvbench.bench.results import Results
from kvbench.cli import main


def _results(tmp_path: Path, records: list[dict]) -> str:
    results = Results(device="cpu (test)")
    for i, record in enumerate(records):
        results.add_conformance({"nodeid": f"suites/conformance/test_x.py::test_{i}", **record})
    path = tmp_path / "results.json"
    results.save(path)
    return str(path)


RECORDS = [
    {"engine": "reference", "check": "recompute_equivalence", "outcome": "passed"},
    {"engine": "server:preset=vllm", "check": "recompute_equivalence", "outcome": "xfailed",
     "reason": "kvbench.core.evidence.KnobsNotSettable: server:preset=vllm pins its pool | by start-up\nmore"},
    {"engine": "reference", "check": "swap_equivalence", "outcome": "failed", "reason": "outputs differ at token 7"},
    {"engine": "server:preset=vllm", "check": "swap_equivalence", "outcome": "skipped",
     "reason": "server:preset=vllm preempts by recompute only"},
    {"engine": "reference", "check": "prefix_caching", "outcome": "xpassed", "reason": "stale"},
]


def test_one_row_per_check_one_column_per_engine_with_reasons(tmp_path: Path) -> None:
    out = io.StringIO()
    assert main(["conformance", _results(tmp_path, RECORDS)], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "| check | reference | server:preset=vllm |"
    # the engine's name becomes "the engine", the exception's name goes, only the first line stays, and a
    # "|" inside a reason cannot split the cell
    assert lines[2] == ("| `recompute_equivalence` | passed | expected failure: the engine pins its pool / by "
                        "start-up |")
    assert lines[3] == ("| `swap_equivalence` | **FAILED**: outputs differ at token 7 | skipped: the engine preempts "
                        "by recompute only |")
    assert lines[4] == "| `prefix_caching` | **now passes (stale expectation)**: stale | - |"


def test_footnotes_keep_the_table_narrow(tmp_path: Path) -> None:
    out = io.StringIO()
    assert main(["conformance", _results(tmp_path, RECORDS), "--footnotes"], out=out) == 0
    text = out.getvalue()
    assert "| `swap_equivalence` | **FAILED** [2] | skipped [3] |" in text
    assert "[2] outputs differ at token 7" in text.splitlines()


def test_a_run_without_conformance_records_is_an_error_not_an_empty_table(tmp_path: Path, capsys) -> None:
    out = io.StringIO()
    assert main(["conformance", _results(tmp_path, [])], out=out) == 2
    assert out.getvalue() == ""
    assert "no conformance records" in capsys.readouterr().err
    assert main(["conformance", str(tmp_path / "missing.json")], out=out) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_pin_not_exercised_is_said_beside_the_verdict() -> None:
    """A pass whose pinned finding could not show (its precondition did not hold) is not read as the finding fixed."""
    from kvbench.report.conformance_table import conformance_table

    pin = {"state": "not_exercised", "needs": "greedy_reaches_eos"}
    table = conformance_table([
        {"engine": "llamacpp", "check": "unpressured", "outcome": "passed", "reason": None, "pin": pin},
        {"engine": "llamacpp", "check": "chunked", "outcome": "undecided", "reason": "no counter", "pin": pin},
        {"engine": "llamacpp", "check": "plain", "outcome": "passed", "reason": None},
    ])
    assert "| `unpressured` | passed: pinned finding not exercised (needs greedy_reaches_eos) |" in table
    assert "undecided: no counter; pinned finding not exercised (needs greedy_reaches_eos)" in table
    assert "| `plain` | passed |" in table


def test_a_shipped_expectations_file_is_named_by_its_place_in_the_package() -> None:
    """A run from another checkout (a worktree, a CI clone) names the same shipped file: the table says it once."""
    from kvbench.report.conformance_table import short_reason

    said = short_reason("expected failure (/tmp/ci/clone/kvbench/conformance/expectations/vllm.toml): why", "zz")
    assert said == "expected failure (kvbench/conformance/expectations/vllm.toml): why"
