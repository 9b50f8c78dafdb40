"""The end of a session: results.json, the report and the index written, the regression gate against
``--baseline`` (a failing gate is a failed item), and the terminal summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbench.plugin.conformance_records import (
    add_conformance_to_results,
    conformance_summary,
    undecided_engines,
    undecided_message,
)
from kvbench.plugin.session import SESSION_KEY, KvbenchSession, is_xdist_worker


def claim_run_dir(report_dir: Path, run_name: str) -> str:
    """Create ``report_dir/run_name`` for this session alone and return the name used: two sessions
    started in the same second (a conformance run beside a benchmark run) would otherwise write
    into one folder, the later one overwriting the other's results. ``-2``, ``-3``... are appended."""
    report_dir.mkdir(parents=True, exist_ok=True)
    name, n = run_name, 1
    while True:
        try:
            (report_dir / name).mkdir()
            return name
        except FileExistsError:
            n += 1
            name = f"{run_name}-{n}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    ks = config.stash.get(SESSION_KEY, None)
    if ks is None or is_xdist_worker(config):
        return
    add_conformance_to_results(ks)
    for engine, records in undecided_engines(ks).items():
        add_failed_item(session, f"kvbench::undecided[{engine}]", f"kvbench: nothing decided for {engine}",
                         undecided_message(engine, records))
    if ks.results is None:
        return
    ks.run_name = claim_run_dir(ks.report_dir, ks.run_name)
    if not ks.results.scenarios:  # conformance only: results.json, no report to draw
        ks.results_path = ks.results.save(ks.report_dir / ks.run_name / "results.json")
        return
    from kvbench.bench.results import Results
    from kvbench.report.render import write_index, write_report

    baseline = None
    if ks.baseline is not None:
        try:
            baseline = Results.load(ks.baseline)
        except Exception as e:  # a bad baseline must not lose this run's results
            ks.gate_error = f"could not read --baseline {ks.baseline}: {e}"
    run_dir = ks.report_dir / ks.run_name
    ks.report_path = write_report(ks.results, run_dir, baseline=baseline)
    ks.results_path = run_dir / "results.json"
    write_index(ks.report_dir)
    if baseline is not None:
        from kvbench.bench import gate

        ks.verdict = gate.gate(ks.results, baseline, ks.thresholds or list(gate.DEFAULT_THRESHOLDS),
                               absolute=ks.gate_absolute, noise_k=ks.gate_noise_k)
        ks.regressions = ks.verdict.regressions
        if not gate.common_keys(ks.results, baseline):
            ks.gate_error = f"--baseline {ks.baseline} shares no (scenario, engine) with this run: nothing compared"
    failed = ks.gate_error is not None or (ks.verdict is not None and ks.verdict.failed)
    if failed:
        _count_gate_as_failure(session, ks)


#: the node id of the synthetic failed item a failing gate adds to the session
GATE_NODEID = "kvbench::regression-gate"


def _count_gate_as_failure(session: pytest.Session, ks: KvbenchSession) -> None:
    """Make a failing gate a failed item: exit status 1, a FAILURES entry naming every regression and
    missing result, and pytest's last line "... 1 failed ..." in red instead of "N passed" in green."""
    lines = [f"GATE ERROR: {ks.gate_error}"] if ks.gate_error else []
    if ks.verdict is not None and ks.verdict.failed:
        lines += [ks.verdict.summary() + f" against --baseline {ks.baseline}", *ks.verdict.failure_lines()]
    add_failed_item(session, GATE_NODEID, "kvbench regression gate", "\n".join(lines), str(ks.baseline))


def add_failed_item(session: pytest.Session, nodeid: str, title: str, longrepr: str, path: str = "kvbench") -> None:
    """A synthetic failed item: exit status 1, a FAILURES entry with ``longrepr``, and pytest's last line
    "... 1 failed ..." in red instead of "N passed" in green."""
    report = pytest.TestReport(nodeid=nodeid, location=(path, None, title),
                               keywords={}, outcome="failed", longrepr=longrepr, when="call")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.stats.setdefault("failed", []).append(report)
    session.testsfailed += 1
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def undecided_claims(results: Any) -> list[str]:
    """One line per benchmark claim that could not be decided (``scenario [engine]: claim: why``); empty
    without results. These benchmarks passed on their decided claims only: the lines say what was not shown."""
    if results is None:
        return []
    # a scenario's claims are judged once per engine and stored on each of its results (one per mode)
    lines = (f"{sc['name']} [{res['engine']}]: {claim}: {why}"
             for sc, res in results.iter_results() for claim, why in (res.get("undecided") or {}).items())
    return list(dict.fromkeys(lines))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    ks = config.stash.get(SESSION_KEY, None)
    if ks is None:
        return
    tr = terminalreporter
    if ks.near_ties:
        tr.section("kvbench near-ties (not failures: divergence where the ground truth's top-2 margin is tiny)")
        for line in ks.near_ties:
            tr.write_line(line)
    if ks.conformance:
        conformance_summary(tr, ks)
    if ks.findings:
        tr.section("kvbench expected failures (findings listed in --kvbench-expectations)")
        for line in ks.findings:
            bad = line.startswith(("NOW PASSES", "UNEXPECTED FAILURE"))
            tr.write_line(line, red=bad, yellow=not bad)
    undecided = undecided_claims(ks.results)
    if undecided:
        tr.section("kvbench undecided claims (not passed: the benchmark could not tell)")
        for line in undecided:
            tr.write_line(line, yellow=True)
    if ks.report_path is None:
        return
    tr.section("kvbench")
    tr.write_line(f"results: {ks.report_path.parent / 'results.json'}")
    tr.write_line(f"report:  {ks.report_path}")
    if ks.gate_error:
        tr.write_line(f"GATE ERROR: {ks.gate_error}", red=True)
    if ks.verdict is not None:
        for line in ks.verdict.failure_lines():
            tr.write_line(line, red=True)
        for note in ks.verdict.notes:
            tr.write_line(f"note: {note}")
        if not ks.verdict.failed and not ks.gate_error:
            tr.write_line(f"{ks.verdict.summary()} against {ks.baseline}", green=True)

