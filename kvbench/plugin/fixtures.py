"""What tests see: the fixtures (``kvbench_session``, ``engine_spec``, ``engine``, ``model_dir``,
``kvbench_results``), :func:`require`, and the skips decided at collection (benchmarks without
``--benchmark``, GPU tests without CUDA, conformance checks of a simulator)."""

from __future__ import annotations

from typing import Any

import pytest

from kvbench.engines.base import EngineAdapter
from kvbench.engines.registry import EngineSpec, adapter_class, make_adapter
from kvbench.plugin.conformance_records import CHECK_PROPERTY, ENGINE_PROPERTY, PRESSURED_PROPERTY, check_id
from kvbench.plugin.session import KvbenchSession, engine_spec_of, is_simulator, session_of


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
        spec = engine_spec_of(item)
        if spec is not None and item.get_closest_marker("conformance") and is_simulator(spec):
            from kvbench.sim.adapter import SIMULATED_REASON

            item.add_marker(pytest.mark.skip(reason=SIMULATED_REASON))  # placeholder tokens prove nothing
        if spec is not None and item.get_closest_marker("conformance"):
            # identity first, so every phase's report (and --junitxml) says which engine and check it is
            # whether the check pressures the engine: @pytest.mark.conformance(pressured=False) says not
            # (the unpressured run, bad input), so a run of those alone proves nothing about preemption
            pressured = all(m.kwargs.get("pressured", True) for m in item.iter_markers("conformance"))
            item.user_properties += [(ENGINE_PROPERTY, spec.name), (CHECK_PROPERTY, check_id(item)),
                                     (PRESSURED_PROPERTY, pressured)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test that raised (failed, errored, or failed as expected; a skip is not a failure) tells its engine,
    so that nothing it left behind (a server kept for reuse, with requests or blocks still in it) serves the
    next test: :meth:`kvbench.engines.base.EngineAdapter.check_failed`."""
    report = yield
    if call.when != "teardown" and call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        engine = getattr(item, "funcargs", {}).get("engine")
        if isinstance(engine, EngineAdapter):
            engine.check_failed()
    return report


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvbench_session(request: pytest.FixtureRequest) -> KvbenchSession:
    return session_of(request.config)


@pytest.fixture(scope="session")
def model_dir(kvbench_session: KvbenchSession) -> str:
    """The checkpoint engines run on: ``--kvbench-model``, or the built-in tiny model in a shape every engine
    of the run loads (vLLM's CPU build: head size 32, :func:`kvbench.models.builtin.checkpoint_for`)."""
    if kvbench_session.model:
        return kvbench_session.model
    from kvbench.models.builtin import checkpoint_for

    return str(checkpoint_for(engine_layouts(kvbench_session.engine_specs)))


def engine_layouts(specs: list[EngineSpec]) -> list[Any]:
    """The KV layouts the run's engines declare before they start (a built-in checkpoint is shaped so every
    one of them loads it: :func:`kvbench.models.builtin.checkpoint_for`)."""
    return [adapter_class(s.kind).kv_layout_for(dict(s.options)) for s in specs]


@pytest.fixture(scope="session")
def engine(engine_spec: EngineSpec, model_dir: str, request: pytest.FixtureRequest):
    """The adapter for one ``--engine`` spec, shared by every test of the session."""
    adapter = make_adapter(engine_spec, model_dir)
    ks = session_of(request.config)
    # Checks force preemptions on purpose and prove them; admission control exists to avoid them and
    # would leave a check nothing to prove. So checks run with admission off unless they ask for it, and
    # the records say so (a knob override). Exactness with admission on is tested in
    # tests/engine/test_policies.py; the benchmarks keep the engine's setting.
    adapter.configure_run(liveness=ks.liveness,
                          admission_off_by_default="admission_control" in adapter.capabilities)
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
        why = getattr(engine, "lacking", {}) or {}  # the engine's own reason, where its adapter knows it
        reasons = "".join(f" ({why[c]})" for c in missing if c in why)
        pytest.skip(f"{engine.name} lacks capability {', '.join(missing)}{reasons}")

