"""Shared fixtures of the project's own tests: a tiny checkpoint, transformers' greedy outputs as
ground truth, and an engine factory that checks, after every test, that the pool is whole.

And one rule: a test that starts a server process carries the ``server`` marker (``pytest -m "not server"``
leaves every one of them out); :mod:`tests.server_marker`'s hooks, imported here, fail one that does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvbench.core.cache import cache_root
from kvbench.models.random_llama import write_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from tests.server_marker import pytest_runtest_call, pytest_runtest_setup  # noqa: F401 - hooks of this directory

NUM_REQUESTS = 32


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules holding the longest tests run first: those with a test marked ``slow`` (a real peer started
    several times, a calibration served for real), the ones whose slow test also starts servers before the
    rest. In a parallel run (``-n 2``, the README's test command) one worker is busy with them from the start
    while the other works through the rest, instead of the run ending on them. Whole modules move, in their
    own order, so that a module-scoped fixture is still built once."""
    def weight(item: pytest.Item) -> int:
        slow, server = item.get_closest_marker("slow") is not None, item.get_closest_marker("server") is not None
        return 0 if slow and server else 1 if slow else 2

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    module_weight: dict[str, int] = {}
    for item in items:
        module_weight[module(item)] = min(weight(item), module_weight.get(module(item), 2))
    items.sort(key=lambda item: module_weight[module(item)])


@pytest.fixture(scope="session", autouse=True)
def _machine_caches() -> Iterator[None]:
    """The machine's caches named by their variables for the whole run, so that a process whose home is
    elsewhere still finds them: ``pytester`` gives each test a home of its own, and a child pytest that builds
    an engine there compiled the CPU kernels again (``$TORCH_EXTENSIONS_DIR``: over a minute on 2 cores,
    most of the slowest test's time) and rewrote the built-in checkpoints (``$KVBENCH_CACHE``). A test that
    wants a fresh cache still sets its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR")
                  or str(Path.home() / ".cache" / "torch_extensions"))  # reference_engine's kernels' default
        mp.setenv("KVBENCH_CACHE", str(cache_root()))
        yield


@pytest.fixture(scope="session", autouse=True)
def _pinned_torch_threads(request: pytest.FixtureRequest):
    """One torch thread on CPU, as the benchmarks pin (``kvbench.bench.threads``): on a 2-core machine
    torch's default of a spinning thread per core made these small-model runs up to 10x slower."""
    from kvbench.bench.threads import pinned_torch_threads

    with pinned_torch_threads("quick") as threads:
        yield threads


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def workload() -> tuple[list[list[int]], list[int]]:
    """32 requests, prompts of 1-300 tokens, outputs of 1-100 tokens (seeded)."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, 301, (NUM_REQUESTS,), generator=g).tolist()
    lengths[:3] = [1, 300, 17]  # make sure the extremes are there
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    max_tokens = torch.randint(1, 101, (NUM_REQUESTS,), generator=g).tolist()
    max_tokens[:3] = [100, 100, 1]
    return prompts, max_tokens


def greedy_params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]


@pytest.fixture(scope="session")
def hf_greedy(tiny_ckpt: str, workload) -> list[list[int]]:
    """transformers' greedy ``generate``, one request at a time: the ground truth."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32, use_safetensors=True).eval()
    prompts, max_tokens = workload
    outs = []
    with torch.inference_mode():
        for prompt, m in zip(prompts, max_tokens, strict=True):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture
def make_engine(tiny_ckpt: str) -> Iterator[Callable[..., LLMEngine]]:
    """Build engines on the tiny checkpoint; at teardown each must have checked out clean:
    invariants hold and every device and host block is back in its pool."""
    engines: list[LLMEngine] = []

    def factory(**overrides) -> LLMEngine:
        overrides.setdefault("check_invariants", True)
        overrides.setdefault("num_cpu_blocks_override", 256 if overrides.get("preemption_mode") == "swap" else None)
        engine = LLMEngine(EngineConfig(model=tiny_ckpt, **overrides))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        for rid in list(engine.scheduler.requests):  # a test that stopped early: abort what is left
            engine.abort_request(rid)
        engine.block_manager.check_invariants()
        assert engine.block_manager.is_whole(), f"blocks leaked: {engine.stats()}"
