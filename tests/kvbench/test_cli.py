"""``kvbench report`` and ``kvbench compare`` (called in-process; one real ``python -m kvbench``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from kvbench.cli import main
from tests.kvbench.trace_factory import scaled, synthetic_results


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    res = synthetic_results()
    fast = res.save(d / "fast.json")
    slow = scaled(res, 0.8).save(d / "slow.json")
    return d, fast, slow


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_compare_without_regression_exits_0(files):
    _, fast, _ = files
    code, out = run("compare", str(fast), str(fast))
    assert code == 0 and "no regressions" in out
    assert "throughput:-10%" in out  # the default thresholds are printed


def test_compare_names_each_regression_and_exits_1(files):
    _, fast, slow = files
    code, out = run("compare", str(fast), str(slow), "--threshold", "throughput:-10%", "-t", "p99_tbt:+20%",
                    "--gate-absolute")
    assert code == 1
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("REGRESSION ")]
    assert lines and all("threshold" in ln for ln in lines)
    assert any("preemption_storm / reference: output_throughput" in ln for ln in lines)
    assert "scenario" in out and "baseline" in out and "change" in out  # the table header


def test_a_uniformly_slower_machine_is_not_a_regression_of_same_run_ratios(files):
    """Every engine 20% slower: absolute times regress, the engines' ratios to the reference do not."""
    _, fast, slow = files
    code, out = run("compare", str(fast), str(slow), "-t", "throughput:-10%", "-t", "p99_tbt:+20%")
    assert code == 0 and "ratio to reference" in out and "times of reference are not gated" in out


def test_a_result_missing_from_current_exits_1_naming_it(files, tmp_path):
    from kvbench.bench.results import Results

    _, fast, _ = files
    partial = Results.load(fast)
    partial.data["scenarios"][0]["results"] = [r for r in partial.data["scenarios"][0]["results"]
                                               if r["engine"] != "other"]
    path = partial.save(tmp_path / "partial.json")
    code, out = run("compare", str(fast), str(path))
    assert code == 1 and "MISSING missing from the current run:" in out and "/ other" in out


def test_compare_the_other_way_round_is_an_improvement(files):
    _, fast, slow = files
    assert run("compare", str(slow), str(fast), "-t", "throughput:-10%")[0] == 0


@pytest.mark.parametrize("threshold", ["throughput", "nope:+1%", "throughput:-x%"])
def test_bad_threshold_exits_2(files, threshold, capsys):
    _, fast, _ = files
    assert run("compare", str(fast), str(fast), "-t", threshold)[0] == 2
    assert "kvbench: error:" in capsys.readouterr().err


def test_missing_or_invalid_files_exit_2(files, capsys, tmp_path):
    _, fast, _ = files
    assert run("compare", str(fast), str(tmp_path / "missing.json"))[0] == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 7, "engines": [], "scenarios": []}))
    assert run("report", str(bad))[0] == 2
    assert "schema_version 7 is not supported" in capsys.readouterr().err


def test_nothing_in_common_exits_2(files, tmp_path, capsys):
    _, fast, _ = files
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema_version": 1, "engines": [], "scenarios": []}))
    assert run("compare", str(fast), str(other))[0] == 2
    assert "nothing to compare" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert run()[0] == 2
    assert run("frobnicate")[0] == 2
    assert run("compare", "only-one.json")[0] == 2
    assert "usage:" in capsys.readouterr().err
    assert run("--help")[0] == 0


def test_no_command_exits_2_naming_every_command_in_the_help_order(capsys):
    """The message is built from the parser, so a new command module is named without editing it."""
    from kvbench.cli import build_parser, command_names

    assert run()[0] == 2
    err = capsys.readouterr().err
    names = command_names(build_parser())
    assert names[:7] == ["report", "compare", "merge", "engines", "demo", "calibrate", "simulate"], names
    assert names[-1] == "measure-gpu" and {"head-to-head", "ratios", "predict"} <= set(names), names
    assert f"kvbench: error: a command is required ({', '.join(names)})\n" in err, err


def test_report_writes_html_next_to_results_or_to_output(files, tmp_path):
    d, fast, slow = files
    code, out = run("report", str(fast))
    assert code == 0 and (d / "report.html").exists() and "report written to" in out
    target = tmp_path / "sub" / "r.html"
    assert run("report", str(slow), "--baseline", str(fast), "-o", str(target))[0] == 0
    assert "Against baseline" in target.read_text()


def test_python_dash_m_kvbench(files):
    _, fast, slow = files
    done = subprocess.run([sys.executable, "-m", "kvbench", "compare", str(fast), str(slow), "--gate-absolute"],
                          capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1 and "REGRESSION" in done.stdout
