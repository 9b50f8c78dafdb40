"""The kvbench pytest plugin (entry point ``pytest11: kvbench``).

Options (group "kvbench")::

    --engine KIND[:KEY=VALUE,...]   engine under test, repeatable (default: reference); also
             MODULE:CLASS[:KEY=VALUE,...] for an adapter class that is not registered as a kind
    --benchmark                     also run the storm benchmarks and write a report
    --benchmark-scale quick|full    benchmark size (default quick)
    --report-dir DIR                where runs are written (default reports/)
    --baseline RESULTS.json         compare with a saved run; regressions fail the session
    --threshold EXPR                regression threshold, repeatable (default: see kvbench.bench.gate)
    --benchmark-repeats N           timed repeats of every benchmark run (default 3 at quick scale, 1 at full)
    --gate-absolute                 gate absolute times, not same-run ratios to the reference engine
    --gate-noise-k K                a time's change must exceed K pooled spreads of the repeats (default 3)
    --slo EXPR                      goodput SLOs, e.g. "ttft<=0.5,tbt<=0.1"
    --kvbench-model DIR             checkpoint to run engines on (default: the built-in tiny model)

Fixtures: ``kvbench_session``, ``engine_spec`` (parametrised over ``--engine``), ``engine`` (an
adapter, one per spec per session), ``model_dir``, ``kvbench_results``. Markers: ``conformance``,
``benchmark`` (skipped without ``--benchmark``), ``gpu`` (skipped without CUDA).

Every ``--engine`` is checked when the options are parsed (kind, keys, and values through the adapter's
``validate_options``), so a bad spec is a usage error before any test runs.

Conformance results are data: each test marked ``conformance`` and parametrised over ``engine_spec``
leaves one record (engine, check, outcome, the counters ``prove()`` saw, near-ties, the reason, the
engine options its knobs overrode) in ``results.json`` under ``"conformance"``; see
:func:`conformance_record`. Without ``--benchmark`` the run writes ``<report-dir>/<run>/results.json``
with those records alone. The evidence also rides on each test's ``user_properties``, so
``--junitxml`` carries it as properties.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.core.evidence import collecting, evidence_of
from kvbench.engines.registry import EngineSpec, EngineSpecError, adapter_class, make_adapter, parse_engine_spec

SCALES = ("quick", "full")
#: ``--benchmark-repeats`` when not given, by scale. One at full: three repeats of the full main job
#: would take about an hour on 2 CPU cores (one takes about 20 minutes); results still record the number
#: (``parameters.repeats``, one entry per repeat), and the gate falls back to its thresholds alone when
#: a point has no spread.
DEFAULT_REPEATS = {"quick": 3, "full": 1}
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
    conformance: dict[str, dict[str, Any]] = field(default_factory=dict)  # nodeid -> record, in run order
    results_path: Path | None = None  # where results.json was written (with or without a report)
    liveness: Any = None  # kvbench.core.liveness.Liveness every engine runs under
    expectations: list[Any] = field(default_factory=list)  # kvbench.conformance.expectations.Expectation
    findings: list[str] = field(default_factory=list)  # expected failures seen, and ones that now pass

    def get_results(self):
        if self.results is None:
            from kvbench.bench.results import Results

            self.results = Results()
        return self.results


def add_options(group: Any) -> None:
    """The kvbench options; shared by the plugin and the CLI (both use argparse-style ``addoption``)."""
    group.addoption("--engine", action="append", default=None, metavar="KIND[:KEY=VALUE,...]",
                    help="engine under test, repeatable (default: reference). Kinds: reference, hf, hf-cb and "
                         "any registered in the 'kvbench.engines' entry-point group; or MODULE:CLASS[:KEY=VALUE,...] "
                         "for an EngineAdapter subclass")
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
    group.addoption("--benchmark-repeats", type=int, default=None, metavar="N",
                    help="serve every timed benchmark point N times; results keep each repeat, the median and "
                         "the spread (default 3 at quick scale, 1 at full)")
    group.addoption("--gate-absolute", action="store_true", default=False,
                    help="with --baseline: gate absolute times too, not only same-run ratios to the reference engine")
    group.addoption("--gate-noise-k", type=float, default=3.0, metavar="K",
                    help="with --baseline: a time's change must exceed K pooled spreads of the repeats (default 3)")
    group.addoption("--kvbench-model", default=None, metavar="DIR",
                    help="Hugging Face Llama checkpoint (safetensors) to run engines on; default: built-in tiny")


def add_conformance_options(group: Any) -> None:
    """Liveness limits and expected failures (conformance only)."""
    group.addoption("--kvbench-deadline", type=float, default=None, metavar="SECONDS",
                    help="fail an engine run (one generate/serve) that takes longer than this (default: none)")
    group.addoption("--kvbench-stall-steps", type=int, default=200, metavar="N",
                    help="fail an engine run after N steps with no token and no request state change (default 200)")
    group.addoption("--kvbench-stall-seconds", type=float, default=60.0, metavar="SECONDS",
                    help="fail an engine run after this long with no token and no state change (default 60)")
    group.addoption("--kvbench-expectations", action="append", default=None, metavar="FILE",
                    help="TOML file of checks expected to fail per engine kind, each pinned to its failure "
                         "message; they run as strict xfails "
                         "(repeatable; a bare engine kind such as hf-cb or hf names the file kvbench ships, "
                         "kvbench/conformance/expectations/<kind>.toml)")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvbench", "kvbench: paged-KV engine conformance and benchmarks")
    add_options(group)
    add_conformance_options(group)
    add_distribution_options(group)
    add_soak_options(group)


def pytest_configure(config: pytest.Config) -> None:
    for line in ("conformance: a kvbench conformance check of an engine",
                 "benchmark: a kvbench storm benchmark (runs only with --benchmark)",
                 "gpu: needs a CUDA device (skipped without one)"):
        config.addinivalue_line("markers", line)
    try:
        specs = [parse_engine_spec(s) for s in (config.getoption("engine") or ["reference"])]
    except EngineSpecError as e:
        from kvbench.engines.registry import one_line

        raise pytest.UsageError(one_line(e)) from None
    if len({s.name for s in specs}) != len(specs):
        raise pytest.UsageError("--engine: the same engine is named twice")
    _check_engines_available(specs)
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
    if repeats is None:
        repeats = DEFAULT_REPEATS[config.getoption("benchmark_scale")]
    if repeats < 1:
        raise pytest.UsageError(f"--benchmark-repeats must be >= 1, got {repeats}")
    if not noise_k >= 0:
        raise pytest.UsageError(f"--gate-noise-k must be >= 0, got {noise_k}")
    baseline = config.getoption("baseline")
    if baseline and not Path(baseline).is_file():
        raise pytest.UsageError(f"--baseline {baseline}: no such file")
    ks = config.stash[_SESSION_KEY] = KvbenchSession(
        engine_specs=specs, benchmark=config.getoption("benchmark"), scale=config.getoption("benchmark_scale"),
        report_dir=Path(config.getoption("report_dir")), baseline=Path(baseline) if baseline else None,
        thresholds=list(thresholds or []), slos=slos, model=config.getoption("kvbench_model"),
        run_name=_dt.datetime.now().strftime("%Y%m%d-%H%M%S"), repeats=repeats,
        gate_absolute=config.getoption("gate_absolute"), gate_noise_k=noise_k)
    config.pluginmanager.register(ConformanceRecorder(ks), "kvbench-conformance-recorder")
    _configure_distribution(config, ks)
    _configure_conformance(config, ks)


def _check_engines_available(specs: list[EngineSpec]) -> None:
    """An engine that cannot be had (not installed, nothing listening) is one usage error before any test
    runs, not a traceback per check."""
    from kvbench.engines.base import EngineUnavailable

    for spec in specs:
        try:
            adapter_class(spec.kind).check_available(dict(spec.options))
        except EngineUnavailable as e:
            raise pytest.UsageError(f"--engine {spec.name}: {e}") from None


def _configure_conformance(config: pytest.Config, ks: KvbenchSession) -> None:
    """Liveness limits and expectations files, checked before anything runs."""
    from kvbench.conformance.expectations import ExpectationsError, load_expectations
    from kvbench.core.liveness import Liveness

    try:
        ks.liveness = Liveness(stall_steps=config.getoption("kvbench_stall_steps") or None,
                               stall_seconds=config.getoption("kvbench_stall_seconds") or None,
                               deadline=config.getoption("kvbench_deadline") or None)
    except ValueError as e:
        raise pytest.UsageError(f"--kvbench-deadline/--kvbench-stall-steps/--kvbench-stall-seconds: {e}") from None
    for path in config.getoption("kvbench_expectations") or []:
        try:
            ks.expectations.extend(load_expectations(path))
        except ExpectationsError as e:
            raise pytest.UsageError(f"--kvbench-expectations: {e}") from None
    if ks.expectations:
        config.pluginmanager.register(ExpectedFailures(ks), "kvbench-expected-failures")


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
        spec = _engine_spec_of(item)
        if spec is not None and item.get_closest_marker("conformance") and _simulated(spec):
            from kvbench.engines.sim import SIMULATED_REASON

            item.add_marker(pytest.mark.skip(reason=SIMULATED_REASON))  # placeholder tokens prove nothing
        if spec is not None and item.get_closest_marker("conformance"):
            # identity first, so every phase's report (and --junitxml) says which engine and check it is
            item.user_properties += [(ENGINE_PROPERTY, spec.name), (CHECK_PROPERTY, check_id(item))]


def _simulated(spec: EngineSpec) -> bool:
    """Whether ``spec`` names a simulator (an adapter class with ``simulated = True``)."""
    try:
        return bool(getattr(adapter_class(spec.kind), "simulated", False))
    except EngineSpecError:
        return False


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvbench_session(request: pytest.FixtureRequest) -> KvbenchSession:
    return session_of(request.config)


@pytest.fixture(scope="session")
def model_dir(kvbench_session: KvbenchSession) -> str:
    """The checkpoint engines run on: ``--kvbench-model``, or the built-in tiny model in a shape every engine
    of the run loads (vLLM's CPU build: head size 32, :func:`kvbench.checkpoints.checkpoint_for`)."""
    if kvbench_session.model:
        return kvbench_session.model
    from kvbench.checkpoints import checkpoint_for

    return str(checkpoint_for(engine_layouts(kvbench_session.engine_specs)))


def engine_layouts(specs: list[EngineSpec]) -> list[Any]:
    """The KV layouts the run's engines declare before they start (a built-in checkpoint is shaped so every
    one of them loads it: :func:`kvbench.checkpoints.checkpoint_for`)."""
    return [adapter_class(s.kind).kv_layout_for(dict(s.options)) for s in specs]


@pytest.fixture(scope="session")
def engine(engine_spec: EngineSpec, model_dir: str, request: pytest.FixtureRequest):
    """The adapter for one ``--engine`` spec, shared by every test of the session."""
    adapter = make_adapter(engine_spec, model_dir)
    ks = session_of(request.config)
    if ks.liveness is not None:
        adapter.liveness = ks.liveness
    if "admission_control" in adapter.capabilities:
        _admission_off_in_checks(adapter)
    yield adapter
    adapter.close()


def _admission_off_in_checks(adapter: Any) -> None:
    """Conformance checks force preemptions on purpose and prove them; admission control exists to
    avoid them and would leave a check nothing to prove. So checks run with admission off unless
    they ask for it, and the records say so (a knob override). Exactness with admission on is
    tested in tests/test_policies.py; the benchmarks (``serve``) keep the engine's setting."""
    import functools

    from kvbench.core.knobs import DEFAULT_KNOBS, Knobs

    def admission_off(method, knobs_at: int):
        """``method`` with its knobs (positional ``knobs_at`` or keyword) defaulting to admission off."""

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            args = list(args)
            knobs = kwargs.get("knobs", args[knobs_at] if len(args) > knobs_at else DEFAULT_KNOBS)
            if knobs.admission_policy is None:
                knobs = knobs.merged(Knobs(admission_policy="none"))
            if "knobs" in kwargs or len(args) <= knobs_at:
                kwargs["knobs"] = knobs
            else:
                args[knobs_at] = knobs
            return method(*args, **kwargs)

        return wrapper

    # every entry point a check drives with knobs (the storm of check 6 serves a workload)
    for name, knobs_at in (("generate", 1), ("swap_round_trip", 1), ("serve", 2)):
        if hasattr(adapter, name):
            setattr(adapter, name, admission_off(getattr(adapter, name), knobs_at))


@pytest.fixture(scope="session")
def kvbench_results(kvbench_session: KvbenchSession):
    """The run's :class:`kvbench.bench.results.Results`; written to the report dir at the end."""
    return kvbench_session.get_results()


def require(engine: Any, *capabilities: str) -> None:
    """Skip the calling test, naming the engine and capability, unless the engine has them all."""
    missing = [c for c in capabilities if c not in engine.capabilities]
    if missing:
        why = getattr(engine, "lacking", {}) or {}  # the engine's own reason, where its adapter knows it
        reasons = "".join(f" ({why[c]})" for c in missing if c in why)
        pytest.skip(f"{engine.name} lacks capability {', '.join(missing)}{reasons}")


# ------------------------------------------------------------------------- conformance as data
ENGINE_PROPERTY, CHECK_PROPERTY = "kvbench.engine", "kvbench.check"
OVERRIDES_PROPERTY, NEAR_TIES_PROPERTY = "kvbench.knob_overrides", "kvbench.near_ties"


def _engine_spec_of(item: pytest.Item) -> EngineSpec | None:
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("engine_spec") if callspec is not None else None
    return spec if isinstance(spec, EngineSpec) else None


def check_id(item: pytest.Item) -> str:
    """The check a conformance test is: ``@pytest.mark.conformance(check="...")`` if given, else the test
    function's name without ``test_``; parameters other than the engine follow in brackets
    (``chunked_prefill_equivalence[16]``), so each variant is its own row of the engine x check matrix."""
    marker = item.get_closest_marker("conformance")
    name = (marker.kwargs.get("check") if marker is not None else None) or \
        getattr(item, "originalname", item.name).removeprefix("test_")
    callspec = getattr(item, "callspec", None)
    params = [v for k, v in (callspec.params.items() if callspec is not None else ()) if k != "engine_spec"]
    return f"{name}[{'-'.join(map(str, params))}]" if params else name


def _properties(item: pytest.Item | pytest.TestReport) -> dict[str, Any]:
    return {name: value for name, value in item.user_properties if isinstance(name, str)}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Collect what a conformance test proved (prove()'s counters, overridden options) on its item."""
    if CHECK_PROPERTY not in _properties(item):
        return (yield)
    with collecting(item.user_properties) as collector:
        item.stash[_COLLECTOR_KEY] = collector
        return (yield)


_COLLECTOR_KEY = pytest.StashKey[Any]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    ks = item.config.stash.get(_SESSION_KEY, None)
    collector = item.stash.get(_COLLECTOR_KEY, None)
    near_ties_before = len(ks.near_ties) if ks is not None else 0
    try:
        return (yield)
    finally:
        # the call's report is made after this returns, so these reach it (and --junitxml, and xdist)
        if collector is not None:
            item.user_properties.append((OVERRIDES_PROPERTY, {k: list(v) for k, v in
                                                              collector.knob_overrides.items()}))
            item.user_properties.append((NEAR_TIES_PROPERTY,
                                         len(ks.near_ties) - near_ties_before if ks is not None else 0))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An engine that cannot be had mid-run (a server refusing kvbench's credential: ``CredentialError``)
    is one message, not a traceback per check: the test of that engine fails with the message alone and
    the session stops, since every later one would fail the same way."""
    from kvbench.engines.base import EngineUnavailable

    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if report.failed and isinstance(error, EngineUnavailable) and _engine_spec_of(item) is not None:
        report.longrepr = f"{type(error).__name__}: {error}"
        item.session.shouldfail = f"{type(error).__name__}: {error}"
    return report


def _one_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _reason(report: pytest.TestReport) -> str | None:
    longrepr = report.longrepr
    if longrepr is None:
        return None
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, "Skipped: why")
        return _one_line(str(longrepr[2]).removeprefix("Skipped: "))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _one_line(crash.message)
    return _one_line(str(longrepr))


def _outcome(report: pytest.TestReport) -> tuple[str, str | None] | None:
    """(outcome, reason) this phase settles, or None when it settles nothing (a passed setup/teardown)."""
    xfail_reason = getattr(report, "wasxfail", None)
    if report.when == "teardown":
        return ("error", _reason(report)) if report.failed else None
    if report.when == "setup" and report.passed:
        return None
    if report.passed:
        return ("xpassed", f"XPASS: {xfail_reason}".rstrip(": ")) if xfail_reason is not None else ("passed", None)
    if report.skipped:
        return ("xfailed", xfail_reason or None) if xfail_reason is not None else ("skipped", _reason(report))
    if report.when == "setup":
        return "error", _reason(report)
    if str(report.longrepr).startswith("[XPASS(strict)]"):  # an expected failure that now passes
        return "xpassed", _one_line(str(report.longrepr))
    return "failed", _reason(report)


def conformance_record(report: pytest.TestReport, kind: str | None) -> dict[str, Any] | None:
    """The results.json record this report settles (schema: kvbench.bench.results), or None."""
    props = _properties(report)
    if CHECK_PROPERTY not in props:
        return None
    settled = _outcome(report)
    if settled is None:
        return None
    return {"engine": props[ENGINE_PROPERTY], "kind": kind, "check": props[CHECK_PROPERTY], "nodeid": report.nodeid,
            "outcome": settled[0], "evidence": evidence_of(report.user_properties),
            "near_ties": int(props.get(NEAR_TIES_PROPERTY, 0)), "reason": settled[1],
            "knob_overrides": dict(props.get(OVERRIDES_PROPERTY) or {})}


def _adapter_kind(ks: KvbenchSession, engine: str) -> str | None:
    spec = next((s for s in ks.engine_specs if s.name == engine), None)
    if spec is None:
        return None
    try:
        return adapter_class(spec.kind).kind or spec.kind
    except EngineSpecError:
        return spec.kind


class ConformanceRecorder:
    """Keeps each conformance test's outcome in the session, from its reports (registered in
    ``pytest_configure``; on an xdist controller too, since reports carry the properties)."""

    def __init__(self, ks: KvbenchSession):
        self.ks = ks

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if CHECK_PROPERTY not in _properties(report):
            return
        record = conformance_record(report, _adapter_kind(self.ks, _properties(report)[ENGINE_PROPERTY]))
        if record is None:
            return
        earlier = self.ks.conformance.get(report.nodeid)
        if earlier is not None and report.when == "teardown":
            # a teardown error after a settled call: keep what the call proved, say both
            record["evidence"] = earlier["evidence"] or record["evidence"]
            record["knob_overrides"] = earlier["knob_overrides"] or record["knob_overrides"]
            record["reason"] = f"teardown error after {earlier['outcome']}: {record['reason']}"
        self.ks.conformance[report.nodeid] = record


# ------------------------------------------------------------------------------ expected failures
class ExpectedFailures:
    """Settles each conformance test an expectations entry names (engine kind or family, check id,
    the engine's versions) as a strict, pinned xfail, from its call report: a failure whose message
    the entry's ``match`` finds is the expected failure; any other failure stays a failure, saying
    which entry it did not match; a pass is a failure saying the entry is stale. Keeps the findings
    for the terminal summary. Registered only when ``--kvbench-expectations`` is given.

    Decided when the test has run, not at collection: the engine's family and versions are the
    adapter's to say (a server adapter asks its server), and the adapter exists only then."""

    def __init__(self, ks: KvbenchSession):
        self.ks = ks

    def _expectation_for(self, item: pytest.Item) -> Any:
        from kvbench.conformance.expectations import matching

        spec = _engine_spec_of(item)
        if spec is None or item.get_closest_marker("conformance") is None:
            return None
        adapter = getattr(item, "funcargs", {}).get("engine")
        if adapter is not None and callable(getattr(adapter, "family", None)):
            return matching(self.ks.expectations, adapter.kind, check_id(item), adapter.engine_version,
                            adapter.family())
        return matching(self.ks.expectations, _adapter_kind(self.ks, spec.name) or spec.kind, check_id(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any):
        report = yield
        if report.when != "call" or report.skipped or hasattr(report, "wasxfail"):
            return report
        expectation = self._expectation_for(item)
        if expectation is None:
            return report
        where = f"{expectation.source} (engine {expectation.engine!r}, check {expectation.check!r})"
        if report.passed:
            report.outcome = "failed"
            report.longrepr = f"[XPASS(strict)] now passes: the expectation is stale, remove it from {where}"
            self.ks.findings.append(f"NOW PASSES {item.nodeid}: the expectation is stale: remove {expectation.engine}"
                                    f" / {expectation.check} from {expectation.source}")
            return report
        message = call.excinfo.exconly() if call.excinfo is not None else str(report.longrepr)
        if expectation.matches_failure(message):
            report.outcome = "skipped"
            report.wasxfail = f"expected failure ({expectation.source}): {expectation.reason}"
            self.ks.findings.append(f"expected failure {item.nodeid}: {expectation.describe()}")
            return report
        pinned = f"match {expectation.match!r}" if expectation.match else "no match pattern"
        headline = (f"[UNEXPECTED FAILURE] failed, but not as the expected failure in {where} pins it ({pinned}): "
                    f"{_one_line(message)}")
        report.longrepr = f"{headline}\n\n{report.longreprtext}"
        self.ks.findings.append(f"UNEXPECTED FAILURE {item.nodeid}: does not match {expectation.engine} / "
                                f"{expectation.check} ({pinned}) in {expectation.source}")
        return report


# ------------------------------------------------------------------------------- end of session
def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _add_conformance_to_results(ks: KvbenchSession) -> None:
    """The session's conformance records, and the engines they name, into the run's results."""
    if not ks.conformance:
        return
    results = ks.get_results()
    for spec in ks.engine_specs:
        if spec.name in {r["engine"] for r in ks.conformance.values()} and results.engine(spec.name) is None:
            try:
                cls = adapter_class(spec.kind)
                kind, capabilities = cls.kind or spec.kind, sorted(cls.capabilities)
            except EngineSpecError:
                kind, capabilities = spec.kind, []
            results.add_engine({"name": spec.name, "kind": kind, "options": spec.public_options,
                                "capabilities": capabilities})
    for record in ks.conformance.values():
        results.add_conformance(record)


def _undecided_engines(ks: KvbenchSession) -> dict[str, list[dict[str, Any]]]:
    """Engines for which the run decided no conformance check: every record of theirs is a skip.
    Simulators are left out: they are skipped by design (placeholder tokens prove nothing)."""
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for record in ks.conformance.values():
        by_engine.setdefault(record["engine"], []).append(record)
    simulated = {s.name for s in ks.engine_specs if _simulated(s)}
    return {engine: records for engine, records in by_engine.items()
            if engine not in simulated and all(r["outcome"] == "skipped" for r in records)}


def _undecided_message(engine: str, records: list[dict[str, Any]]) -> str:
    """Why a run that decided nothing for ``engine`` is not green, with its most common skip reasons."""
    reasons: dict[str, int] = {}
    for record in records:
        reasons[record["reason"] or "no reason given"] = reasons.get(record["reason"] or "no reason given", 0) + 1
    common = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
    return "\n".join([f"no conformance check was decided for {engine}: all {len(records)} skipped, so this run "
                      "proves nothing about it (a run that decided nothing is not green). Skip reasons:",
                      *(f"  {n} x {reason}" for reason, n in common)])


def _conformance_summary(tr: Any, ks: KvbenchSession) -> None:
    tr.section("kvbench conformance")
    by_engine: dict[str, dict[str, int]] = {}
    for record in ks.conformance.values():
        counts = by_engine.setdefault(record["engine"], {})
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    given = [spec.name for spec in ks.engine_specs]  # the order of --engine, however the tests ran (xdist)
    for engine, counts in sorted(by_engine.items(), key=lambda kv: given.index(kv[0]) if kv[0] in given else 99):
        near = sum(r["near_ties"] for r in ks.conformance.values() if r["engine"] == engine)
        tr.write_line(f"{engine}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
                      + (f" ({near} near-ties)" if near else ""))
    for engine in _undecided_engines(ks):
        tr.write_line(f"{engine}: NOTHING DECIDED: every check skipped, so the run fails (see kvbench::undecided"
                      f"[{engine}])", red=True)
    overridden: dict[tuple[str, str, str], list[str]] = {}
    for record in ks.conformance.values():
        for knob, (given, used) in record["knob_overrides"].items():
            overridden.setdefault((record["engine"], knob, str(given)), []).append(f"{record['check']} ({used})")
    for (engine, knob, given), checks in overridden.items():
        tr.write_line(f"{engine}: the checks' knob {knob} replaced the option value {given} in {len(checks)} "
                      f"check(s): {', '.join(checks)}", yellow=True)
    if ks.results_path is not None:
        tr.write_line(f"conformance results: {ks.results_path} (key \"conformance\")")


def _claim_run_dir(report_dir: Path, run_name: str) -> str:
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
    ks = config.stash.get(_SESSION_KEY, None)
    if ks is None or _is_xdist_worker(config):
        return
    _add_conformance_to_results(ks)
    for engine, records in _undecided_engines(ks).items():
        _add_failed_item(session, f"kvbench::undecided[{engine}]", f"kvbench: nothing decided for {engine}",
                         _undecided_message(engine, records))
    if ks.results is None:
        return
    ks.run_name = _claim_run_dir(ks.report_dir, ks.run_name)
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
    _add_failed_item(session, GATE_NODEID, "kvbench regression gate", "\n".join(lines), str(ks.baseline))


def _add_failed_item(session: pytest.Session, nodeid: str, title: str, longrepr: str, path: str = "kvbench") -> None:
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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    ks = config.stash.get(_SESSION_KEY, None)
    if ks is None:
        return
    tr = terminalreporter
    if ks.near_ties:
        tr.section("kvbench near-ties (not failures: divergence where the ground truth's top-2 margin is tiny)")
        for line in ks.near_ties:
            tr.write_line(line)
    if ks.conformance:
        _conformance_summary(tr, ks)
    if ks.findings:
        tr.section("kvbench expected failures (findings listed in --kvbench-expectations)")
        for line in ks.findings:
            bad = line.startswith(("NOW PASSES", "UNEXPECTED FAILURE"))
            tr.write_line(line, red=bad, yellow=not bad)
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


# ------------------------------------------------------------- xdist workers, shards across machines
#: the xdist group every timed test joins, so ``--dist loadgroup`` runs them one after another on one worker
TIMED_GROUP = "kvbench-timed"
#: the key of ``config.workeroutput`` a worker sends its results, near-ties and findings under
WORKER_OUTPUT_KEY = "kvbench"
_SHARD_NODEID_KEY = pytest.StashKey[str]()


def add_distribution_options(group: Any) -> None:
    """Splitting a run across machines by hand (within one machine, pytest-xdist's ``-n``)."""
    group.addoption("--kvbench-shard", default=None, metavar="I/N",
                    help="run only shard I of N (1 <= I <= N): a deterministic round-robin over the sorted test ids; "
                         "merge the shards' results.json with 'kvbench merge'")


def _configure_distribution(config: pytest.Config, ks: KvbenchSession) -> None:
    """Check ``--kvbench-shard``, the benchmark/xdist combination and ``--soak-minutes``; register
    :class:`Distribution` and :class:`SoakGate`."""
    shard = None
    if config.getoption("kvbench_shard"):
        from kvbench.bench.shards import ShardError, parse_shard

        try:
            shard = parse_shard(config.getoption("kvbench_shard"))
        except ShardError as e:
            raise pytest.UsageError(str(e)) from None
        ks.run_name += f"-shard{shard.index}of{shard.count}"
    # xdist rewrites a worker's --dist to "no"; the controller's is the one the user chose
    dist = "no" if _is_xdist_worker(config) or not config.getoption("tx", None) else config.getoption("dist", "no")
    if ks.benchmark and dist not in ("no", "loadgroup"):
        raise pytest.UsageError(
            f"--benchmark with pytest-xdist (-n/--tx) needs --dist loadgroup, got --dist {dist}: timed benchmarks "
            f"must run one after another on one worker, never on two workers sharing this machine's cores. Add "
            f"--dist loadgroup, or drop -n for the benchmark run.")
    config.pluginmanager.register(Distribution(ks, shard), "kvbench-distribution")
    config.addinivalue_line("markers", "soak: a long soak run (runs only with --soak)")
    if config.getoption("soak_minutes") <= 0:
        raise pytest.UsageError(f"--soak-minutes must be > 0, got {config.getoption('soak_minutes')}")
    config.pluginmanager.register(SoakGate(config.getoption("soak")), "kvbench-soak-gate")


def add_soak_options(group: Any) -> None:
    """Runs past minutes: the ``soak`` tests (suites/soak)."""
    group.addoption("--soak", action="store_true", default=False,
                    help="run the soak tests (marker soak; skipped without this flag, so a plain pytest and CI never "
                         "run them)")
    group.addoption("--soak-minutes", type=float, default=10.0, metavar="MINUTES",
                    help="how long the HTTP soak loads the server, in total over the preemption modes (default 10)")


class SoakGate:
    """Skips tests marked ``soak`` unless ``--soak`` was given: an option, not ``-m "not soak"`` in
    addopts, so a user's own ``-m`` expression neither re-enables nor is overridden by it."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.enabled:
            return
        skip = pytest.mark.skip(reason="soak test: run with --soak (and --soak-minutes)")
        for item in items:
            if item.get_closest_marker("soak") is not None:
                item.add_marker(skip)


def _is_timed(item: pytest.Item) -> bool:
    return item.get_closest_marker("benchmark") is not None or "benchmark" in getattr(item, "fixturenames", ())


class Distribution:
    """pytest-xdist and ``--kvbench-shard``: what a run spread over processes or machines needs.

    * On an xdist worker, timed tests (marked ``benchmark`` or using pytest-benchmark's fixture) join
      the xdist group :data:`TIMED_GROUP`, so ``--dist loadgroup`` sends them all to one worker.
    * ``--kvbench-shard I/N`` deselects the tests of other shards (:mod:`kvbench.bench.shards`), keyed
      by the node ids collected before xdist appends ``@group``.
    * A worker hands its results (benchmarks), near-ties and findings to the controller through
      ``workeroutput``; the controller merges them (:func:`kvbench.bench.merge.merge_results`) before it
      writes the one ``results.json`` and report. Conformance records need no hand-over: the
      controller rebuilds them from the test reports, which carry their evidence.
    """

    def __init__(self, ks: KvbenchSession, shard: Any):
        self.ks = ks
        self.shard = shard  # kvbench.bench.shards.Shard | None
        self.worker_parts: list[tuple[str, Any]] = []  # (worker id, Results) in the order workers finished

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        worker = _is_xdist_worker(config)
        for item in items:
            item.stash[_SHARD_NODEID_KEY] = item.nodeid
            if worker and _is_timed(item):
                item.add_marker(pytest.mark.xdist_group(name=TIMED_GROUP))
        result = yield
        if self.shard is not None:  # after -k/-m deselection, so shards split what was selected
            from kvbench.bench.shards import in_shard

            # a benchmark's engines stay in one shard: they are served side by side
            units = {item.stash[_SHARD_NODEID_KEY]: _shard_unit(item) for item in items}
            keep = in_shard(units, self.shard, unit_of=units.__getitem__)
            dropped = [item for item in items if item.stash[_SHARD_NODEID_KEY] not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [item for item in items if item.stash[_SHARD_NODEID_KEY] in keep]
        return result

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """(xdist controller) a worker finished: keep what it sent."""
        import json

        raw = (getattr(node, "workeroutput", None) or {}).get(WORKER_OUTPUT_KEY)
        if raw is None:  # a crashed worker sends nothing; xdist reports the crash itself
            return
        payload = json.loads(raw)
        if payload.get("results") is not None:
            from kvbench.bench.results import Results

            worker_id = getattr(getattr(node, "gateway", None), "id", "?")
            self.worker_parts.append((f"worker {worker_id}", Results.from_dict(payload["results"])))
        self.ks.near_ties.extend(payload.get("near_ties") or [])
        self.ks.findings.extend(payload.get("findings") or [])

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """A worker sends; the controller (or a plain run) merges and labels, before results are written."""
        import json

        config, ks = session.config, self.ks
        if _is_xdist_worker(config):
            config.workeroutput[WORKER_OUTPUT_KEY] = json.dumps(  # type: ignore[attr-defined]
                {"results": ks.results.data if ks.results is not None else None, "near_ties": ks.near_ties,
                 "findings": ks.findings})
            return
        if self.worker_parts:
            from kvbench.bench.merge import merge_results

            parts = ([("controller", ks.results)] if ks.results is not None else []) + self.worker_parts
            ks.results = merge_results(parts)
        if self.shard is not None and (ks.results is not None or ks.conformance):
            ks.get_results().data["shard"] = self.shard.to_dict()


def _shard_unit(item: pytest.Item) -> str:
    """The unit ``--kvbench-shard`` keeps together: a benchmark without its engine parameter (its
    engines are served side by side, so their times pair up only within one run), else the test."""
    nodeid = item.stash[_SHARD_NODEID_KEY]
    callspec = getattr(item, "callspec", None)
    if item.get_closest_marker("benchmark") is None or callspec is None or "engine_spec" not in callspec.params:
        return nodeid
    others = [f"{k}={v!r}" for k, v in sorted(callspec.params.items()) if k != "engine_spec"]
    return nodeid.split("[", 1)[0] + (f"[{','.join(others)}]" if others else "")
