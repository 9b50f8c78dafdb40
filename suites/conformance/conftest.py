"""Fixtures of the conformance suite: the request set, and the ground truth from ``hf``."""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import conformance_requests, roomy_knobs
from kvbench.engines.base import GenRequest, GenResult
from kvbench.engines.registry import EngineSpec, make_adapter


@pytest.fixture(scope="session", autouse=True)
def _pinned_torch_threads(request: pytest.FixtureRequest):
    """One torch thread on CPU, as the benchmarks pin (``kvbench.bench.threads``): on a 2-core machine
    torch's default of a spinning thread per core made these small-model runs up to 10x slower."""
    from kvbench.bench.threads import pinned_torch_threads

    with pinned_torch_threads(request.config.getoption("--benchmark-scale", "quick")) as threads:
        yield threads


@pytest.fixture(scope="session")
def requests_greedy(model_dir: str) -> list[GenRequest]:
    return conformance_requests(model_dir)


@pytest.fixture(scope="session")
def truth_engine(model_dir: str):
    """transformers' plain ``generate``: the ground truth for greedy outputs."""
    adapter = make_adapter(EngineSpec("hf"), model_dir)
    yield adapter
    adapter.close()


@pytest.fixture(scope="session")
def truth(truth_engine, requests_greedy) -> GenResult:
    return truth_engine.generate(requests_greedy)


@pytest.fixture(scope="session")
def unpressured(engine, requests_greedy) -> GenResult:
    """The engine's own outputs with a pool large enough that nothing is preempted."""
    return engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))


@pytest.fixture
def near_ties(kvbench_session) -> list[str]:
    return kvbench_session.near_ties
