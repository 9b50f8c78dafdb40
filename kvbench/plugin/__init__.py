"""The kvbench pytest plugin (entry point ``pytest11: kvbench``), one module per concern:

    options              the command-line options, in groups shared with other front ends
    session              KvbenchSession: the options parsed once, and what the run produces
    configure            pytest_configure: every option checked before any test runs; the parts registered
    fixtures             the fixtures, require(), and the skips decided at collection
    conformance_records  each conformance test's identity, evidence and outcome as a results.json record
    expected_failures    --kvbench-expectations: pinned, strict xfails per engine
    distribution         pytest-xdist workers and --kvbench-shard
    soak                 --soak: the soak tests run only when asked for
    session_end          results.json, the report, the regression gate and the terminal summary

This package is the plugin pytest loads; it loads those modules as its own plugins (``pytest_plugins``)
and re-exports the names tests and suites import (``from kvbench.plugin import require``).

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

from kvbench.plugin.conformance_records import (
    CHECK_PROPERTY,
    ENGINE_PROPERTY,
    NEAR_TIES_PROPERTY,
    OVERRIDES_PROPERTY,
    ConformanceRecorder,
    check_id,
    conformance_record,
)
from kvbench.plugin.distribution import TIMED_GROUP, WORKER_OUTPUT_KEY, Distribution
from kvbench.plugin.expected_failures import ExpectedFailures
from kvbench.plugin.fixtures import engine_layouts, require
from kvbench.plugin.options import (
    DEFAULT_REPEATS,
    SCALES,
    add_conformance_options,
    add_distribution_options,
    add_options,
    add_soak_options,
)
from kvbench.plugin.session import KvbenchSession, session_of
from kvbench.plugin.session_end import GATE_NODEID
from kvbench.plugin.soak import SoakGate

#: the modules whose hooks and fixtures make up the plugin (each registered as a plugin of its own)
pytest_plugins = [
    "kvbench.plugin.options",
    "kvbench.plugin.configure",
    "kvbench.plugin.fixtures",
    "kvbench.plugin.conformance_records",
    "kvbench.plugin.session_end",
]

__all__ = [
    "CHECK_PROPERTY",
    "DEFAULT_REPEATS",
    "ENGINE_PROPERTY",
    "GATE_NODEID",
    "NEAR_TIES_PROPERTY",
    "OVERRIDES_PROPERTY",
    "SCALES",
    "TIMED_GROUP",
    "WORKER_OUTPUT_KEY",
    "ConformanceRecorder",
    "Distribution",
    "ExpectedFailures",
    "KvbenchSession",
    "SoakGate",
    "add_conformance_options",
    "add_distribution_options",
    "add_options",
    "add_soak_options",
    "check_id",
    "conformance_record",
    "engine_layouts",
    "require",
    "session_of",
]
