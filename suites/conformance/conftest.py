"""Fixtures of the conformance suite: the request set, and the ground truth from ``hf``."""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import fitted_requests, near_tie_tolerance, roomy_knobs
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
def requests_greedy(engine, model_dir: str) -> list[GenRequest]:
    """The conformance request set; sized to the pool of a server that is already running (``openai:url=``),
    whose pool a check cannot change (:func:`kvbench.conformance.prove.fitted_requests`)."""
    return fitted_requests(engine, model_dir)


@pytest.fixture(scope="session")
def _truth_engines():
    """transformers' plain ``generate`` per dtype, loaded once each and shared by every engine of the run."""
    adapters: dict[str, object] = {}
    yield adapters
    for adapter in adapters.values():
        adapter.close()


@pytest.fixture(scope="session")
def truth_engine(engine, model_dir: str, _truth_engines):
    """transformers' plain ``generate``: the ground truth for greedy outputs, in the dtype ``engine`` computes
    in (float32 when it does not say): a bfloat16 model is another model than its float32 original, so a
    bfloat16 engine is held to bfloat16's ground truth (:mod:`kvbench.conformance.equivalence`)."""
    dtype = engine.compute_dtype() or "float32"
    if dtype not in _truth_engines:
        _truth_engines[dtype] = make_adapter(EngineSpec("hf", {"dtype": dtype} if dtype != "float32" else {}),
                                             model_dir)
    return _truth_engines[dtype]


_TRUTHS: dict[tuple, GenResult] = {}


@pytest.fixture(scope="session")
def truth(truth_engine, requests_greedy) -> GenResult:
    """The ground truth of the request set, computed once per distinct set and dtype (engines share it)."""
    key = (truth_engine.compute_dtype(),
           tuple((r.request_id, tuple(r.prompt_token_ids), r.max_tokens) for r in requests_greedy))
    if key not in _TRUTHS:
        _TRUTHS[key] = truth_engine.generate(requests_greedy)
    return _TRUTHS[key]


@pytest.fixture(scope="session")
def unpressured(engine, requests_greedy) -> GenResult:
    """The engine's own outputs with a pool large enough that nothing is preempted."""
    return engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))


@pytest.fixture
def near_ties(kvbench_session) -> list[str]:
    return kvbench_session.near_ties


@pytest.fixture(scope="session")
def tolerance(engine, kvbench_session) -> float:
    """The near-tie tolerance ``engine`` is judged with (:func:`kvbench.conformance.prove.near_tie_tolerance`)."""
    return near_tie_tolerance(engine, kvbench_session.near_tie_tolerance)
