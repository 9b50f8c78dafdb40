"""The fixtures the tests that break an engine share: the tiny checkpoint, the suite's greedy requests, the
ground truth from Hugging Face transformers, and one torch thread.

A test module imports the ones it uses (``from tests.kvbench.fault_test_fixtures import model_dir, ...``);
pytest registers an imported fixture for that module alone, so each module keeps its own module-scoped copies
and ``one_torch_thread``, imported, is autouse in that module only.
"""

from __future__ import annotations

import pytest

from kvbench.conformance.prove import conformance_requests
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The benchmarks' thread policy (kvbench.bench.threads: one thread on CPU unless KVBENCH_TORCH_THREADS says
    otherwise). With torch's default of one thread per core, OpenMP threads spinning on the tiny model's small
    matrices cost a fault-test file 175 s of CPU on a loaded 2-core machine; the tokens do not depend on it (the
    ground truth runs under the same pin)."""
    from kvbench.bench.threads import pinned_torch_threads

    with pinned_torch_threads("quick") as threads:
        yield threads


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(builtin_checkpoint("tiny"))


@pytest.fixture(scope="module")
def requests_greedy(model_dir):
    return conformance_requests(model_dir)


@pytest.fixture(scope="module")
def truth_engine(model_dir):
    adapter = make_adapter(parse_engine_spec("hf"), model_dir)
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def truth(truth_engine, requests_greedy):
    return truth_engine.generate(requests_greedy)
