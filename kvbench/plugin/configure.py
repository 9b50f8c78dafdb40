"""``pytest_configure``: every kvbench option checked and parsed once into the session, before any
test runs (a bad ``--engine``, threshold, SLO, shard, liveness limit or expectations file is one usage
error), and the plugin's parts registered."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import pytest

from kvbench.engines.registry import EngineSpec, EngineSpecError, adapter_class, one_line, parse_engine_spec
from kvbench.plugin.conformance_records import ConformanceRecorder
from kvbench.plugin.distribution import configure_distribution
from kvbench.plugin.expected_failures import ExpectedFailures
from kvbench.plugin.options import DEFAULT_REPEATS
from kvbench.plugin.session import SESSION_KEY, KvbenchSession
from kvbench.plugin.soak import configure_soak


def pytest_configure(config: pytest.Config) -> None:
    for line in ("conformance: a kvbench conformance check of an engine",
                 "benchmark: a kvbench storm benchmark (runs only with --benchmark)",
                 "gpu: needs a CUDA device (skipped without one)"):
        config.addinivalue_line("markers", line)
    try:
        specs = [parse_engine_spec(s) for s in (config.getoption("engine") or ["reference"])]
    except EngineSpecError as e:
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
    ks = config.stash[SESSION_KEY] = KvbenchSession(
        engine_specs=specs, benchmark=config.getoption("benchmark"), scale=config.getoption("benchmark_scale"),
        report_dir=Path(config.getoption("report_dir")), baseline=Path(baseline) if baseline else None,
        thresholds=list(thresholds or []), slos=slos, model=config.getoption("kvbench_model"),
        run_name=_dt.datetime.now().strftime("%Y%m%d-%H%M%S"), repeats=repeats,
        gate_absolute=config.getoption("gate_absolute"), gate_noise_k=noise_k)
    config.pluginmanager.register(ConformanceRecorder(ks), "kvbench-conformance-recorder")
    configure_distribution(config, ks)
    configure_soak(config)
    configure_conformance(config, ks)
    from kvbench.plugin.launch_order import LaunchOrder

    config.pluginmanager.register(LaunchOrder(config), "kvbench-launch-order")


def _check_engines_available(specs: list[EngineSpec]) -> None:
    """An engine that cannot be had (not installed, nothing listening) is one usage error before any test
    runs, not a traceback per check."""
    from kvbench.engines.base import EngineUnavailable

    for spec in specs:
        try:
            adapter_class(spec.kind).check_available(dict(spec.options))
        except EngineUnavailable as e:
            raise pytest.UsageError(f"--engine {spec.name}: {e}") from None


def configure_conformance(config: pytest.Config, ks: KvbenchSession) -> None:
    """Liveness limits, the near-tie tolerance and expectations files, checked before anything runs."""
    from kvbench.conformance.expectations import ExpectationsError, load_expectations
    from kvbench.core.liveness import Liveness

    try:
        ks.liveness = Liveness(stall_steps=config.getoption("kvbench_stall_steps") or None,
                               stall_seconds=config.getoption("kvbench_stall_seconds") or None,
                               deadline=config.getoption("kvbench_deadline") or None)
    except ValueError as e:
        raise pytest.UsageError(f"--kvbench-deadline/--kvbench-stall-steps/--kvbench-stall-seconds: {e}") from None
    tolerance = config.getoption("kvbench_near_tie_tolerance")
    if tolerance is not None and not (tolerance >= 0 and tolerance != float("inf")):
        raise pytest.UsageError(f"--kvbench-near-tie-tolerance: {tolerance} is not a finite number >= 0 (logits)")
    ks.near_tie_tolerance = tolerance
    for path in config.getoption("kvbench_expectations") or []:
        try:
            ks.expectations.extend(load_expectations(path))
        except ExpectationsError as e:
            raise pytest.UsageError(f"--kvbench-expectations: {e}") from None
    if ks.expectations:
        config.pluginmanager.register(ExpectedFailures(ks), "kvbench-expected-failures")

