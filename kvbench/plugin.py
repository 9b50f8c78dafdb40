"""The kvbench pytest plugin (entry point ``pytest11: kvbench``).

Options (group "kvbench")::

    --engine KIND[:KEY=VALUE,...]   engine under test, repeatable (default: reference)
    --benchmark                     also run the storm benchmarks and write a report
    --benchmark-scale quick|full    benchmark size (default quick)
    --report-dir DIR                where runs are written (default reports/)
    --baseline RESULTS.json         compare with a saved run; regressions fail the session
    --threshold EXPR                regression threshold, repeatable (default: see kvbench.bench.gate)
    --benchmark-repeats N           timed repeats of every benchmark run (default 3)
    --gate-absolute                 gate absolute times, not same-run ratios to the reference engine
    --gate-noise-k K                a time's change must exceed K pooled spreads of the repeats (default 3)
    --slo EXPR                      goodput SLOs, e.g. "ttft<=0.5,tbt<=0.1"
    --kvbench-model DIR             checkpoint to run engines on (default: the built-in tiny model)

Fixtures: ``kvbench_session``, ``engine_spec`` (parametrised over ``--engine``), ``engine`` (an
adapter, one per spec per session), ``model_dir``, ``kvbench_results``. Markers: ``conformance``,
``benchmark`` (skipped without ``--benchmark``), ``gpu`` (skipped without CUDA).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.engines.registry import EngineSpec, EngineSpecError, make_adapter, parse_engine_spec

SCALES = ("quick", "full")
_SESSION_KEY = pytest.StashKey["KvbenchSession"]()


@dataclass
class KvbenchSession:
    """Options parsed once, plus what the run produces (results, report, regressions)."""

    engine_specs: list[EngineSpec]
    benchmark: bool = False
    scale: str = "quick"
    report_dir: Path = Path("reports")
    baseline: Path | None = None
    thresholds: list[str] = field(default_factory=list)
    slos: str | None = None
    model: str | None = None
    run_name: str = ""
    results: Any = None  # kvbench.bench.results.Results, created on first use
    report_path: Path | None = None
    regressions: list[Any] = field(default_factory=list)
    gate_error: str | None = None
    repeats: int = 3  # timed repeats of every benchmark job (--benchmark-repeats)
    gate_absolute: bool = False
    gate_noise_k: float = 3.0
    verdict: Any = None  # kvbench.bench.gate.Verdict when --baseline was given
    near_ties: list[str] = field(default_factory=list)  # conformance divergences excused as near-ties

    def get_results(self):
        if self.results is None:
            from kvbench.bench.results import Results

            self.results = Results()
        return self.results


def add_options(group: Any) -> None:
    """The kvbench options; shared by the plugin and the CLI (both use argparse-style ``addoption``)."""
    group.addoption("--engine", action="append", default=None, metavar="KIND[:KEY=VALUE,...]",
                    help="engine under test, repeatable (default: reference). Kinds: reference, hf, hf-cb")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="run the storm benchmarks too and write <report-dir>/<run>/report.html")
    group.addoption("--benchmark-scale", choices=SCALES, default="quick",
                    help="benchmark size: quick (minutes on 2 CPU cores) or full")
    group.addoption("--report-dir", default="reports", metavar="DIR", help="where benchmark runs are written")
    group.addoption("--baseline", default=None, metavar="RESULTS.json",
                    help="compare with a saved run; a regression past a threshold fails the session")
    group.addoption("--threshold", action="append", default=None, metavar="EXPR",
                    help="regression threshold such as throughput:-10%% or preemptions:+0 (repeatable)")
    group.addoption("--slo", default=None, metavar="EXPR", help='goodput SLOs, e.g. "ttft<=0.5,tbt<=0.1"')
    group.addoption("--benchmark-repeats", type=int, default=3, metavar="N",
                    help="serve every timed benchmark point N times; results keep each repeat, the median and "
                         "the spread (default 3)")
    group.addoption("--gate-absolute", action="store_true", default=False,
                    help="with --baseline: gate absolute times too, not only same-run ratios to the reference engine")
    group.addoption("--gate-noise-k", type=float, default=3.0, metavar="K",
                    help="with --baseline: a time's change must exceed K pooled spreads of the repeats (default 3)")
    group.addoption("--kvbench-model", default=None, metavar="DIR",
                    help="Hugging Face Llama checkpoint (safetensors) to run engines on; default: built-in tiny")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser.getgroup("kvbench", "kvbench: paged-KV engine conformance and benchmarks"))


def pytest_configure(config: pytest.Config) -> None:
    for line in ("conformance: a kvbench conformance check of an engine",
                 "benchmark: a kvbench storm benchmark (runs only with --benchmark)",
                 "gpu: needs a CUDA device (skipped without one)"):
        config.addinivalue_line("markers", line)
    try:
        specs = [parse_engine_spec(s) for s in (config.getoption("engine") or ["reference"])]
    except EngineSpecError as e:
        raise pytest.UsageError(str(e)) from None
    if len({s.name for s in specs}) != len(specs):
        raise pytest.UsageError("--engine: the same engine is named twice")
    thresholds = config.getoption("threshold")
    if thresholds:
        from kvbench.bench.gate import ThresholdError, parse_thresholds

        try:
            parse_thresholds(thresholds)
        except ThresholdError as e:
            raise pytest.UsageError(f"--threshold: {e}") from None
    slos = config.getoption("slo")
    if slos:
        from kvbench.bench.metrics import parse_slos

        try:
            parse_slos(slos)
        except ValueError as e:
            raise pytest.UsageError(f"--slo: {e}") from None
    repeats, noise_k = config.getoption("benchmark_repeats"), config.getoption("gate_noise_k")
    if repeats < 1:
        raise pytest.UsageError(f"--benchmark-repeats must be >= 1, got {repeats}")
    if not noise_k >= 0:
        raise pytest.UsageError(f"--gate-noise-k must be >= 0, got {noise_k}")
    baseline = config.getoption("baseline")
    if baseline and not Path(baseline).is_file():
        raise pytest.UsageError(f"--baseline {baseline}: no such file")
    config.stash[_SESSION_KEY] = KvbenchSession(
        engine_specs=specs, benchmark=config.getoption("benchmark"), scale=config.getoption("benchmark_scale"),
        report_dir=Path(config.getoption("report_dir")), baseline=Path(baseline) if baseline else None,
        thresholds=list(thresholds or []), slos=slos, model=config.getoption("kvbench_model"),
        run_name=_dt.datetime.now().strftime("%Y%m%d-%H%M%S"), repeats=repeats,
        gate_absolute=config.getoption("gate_absolute"), gate_noise_k=noise_k)


def session_of(config: pytest.Config) -> KvbenchSession:
    return config.stash[_SESSION_KEY]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return torch.cuda.is_available()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_spec" in metafunc.fixturenames:
        specs = session_of(metafunc.config).engine_specs
        metafunc.parametrize("engine_spec", specs, ids=[s.name for s in specs], scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session = session_of(config)
    skip_bench = pytest.mark.skip(reason="storm benchmark: run with --benchmark")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    has_cuda = None
    for item in items:
        if "benchmark" in item.keywords and item.get_closest_marker("benchmark") and not session.benchmark:
            item.add_marker(skip_bench)
        if "gpu" in item.keywords and item.get_closest_marker("gpu"):
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvbench_session(request: pytest.FixtureRequest) -> KvbenchSession:
    return session_of(request.config)


@pytest.fixture(scope="session")
def model_dir(kvbench_session: KvbenchSession) -> str:
    """The checkpoint engines run on: ``--kvbench-model`` or the built-in tiny model."""
    if kvbench_session.model:
        return kvbench_session.model
    from kvbench.checkpoints import builtin_checkpoint

    return str(builtin_checkpoint("tiny"))


@pytest.fixture(scope="session")
def engine(engine_spec: EngineSpec, model_dir: str):
    """The adapter for one ``--engine`` spec, shared by every test of the session."""
    adapter = make_adapter(engine_spec, model_dir)
    yield adapter
    adapter.close()


@pytest.fixture(scope="session")
def kvbench_results(kvbench_session: KvbenchSession):
    """The run's :class:`kvbench.bench.results.Results`; written to the report dir at the end."""
    return kvbench_session.get_results()


def require(engine: Any, *capabilities: str) -> None:
    """Skip the calling test, naming the engine and capability, unless the engine has them all."""
    missing = [c for c in capabilities if c not in engine.capabilities]
    if missing:
        pytest.skip(f"{engine.name} lacks capability {', '.join(missing)}")


# ------------------------------------------------------------------------------- end of session
def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    ks = config.stash.get(_SESSION_KEY, None)
    if ks is None or ks.results is None or _is_xdist_worker(config) or not ks.results.scenarios:
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
    report = pytest.TestReport(nodeid=GATE_NODEID, location=(str(ks.baseline), None, "kvbench regression gate"),
                               keywords={}, outcome="failed", longrepr="\n".join(lines), when="call")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.stats.setdefault("failed", []).append(report)
    session.testsfailed += 1
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    ks = config.stash.get(_SESSION_KEY, None)
    if ks is None:
        return
    tr = terminalreporter
    if ks.near_ties:
        tr.section("kvbench near-ties (not failures: divergence where the ground truth's top-2 margin is tiny)")
        for line in ks.near_ties:
            tr.write_line(line)
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
