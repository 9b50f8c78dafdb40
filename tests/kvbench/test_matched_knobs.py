"""Every benchmark job states the behaviour its scenario leaves unset (kvbench.bench.matched_knobs)."""

from __future__ import annotations

from types import SimpleNamespace

from kvbench.bench.matched_knobs import STATED, stated
from kvbench.core.knobs import Knobs


def test_what_a_scenario_leaves_unset_is_stated_the_same_for_every_engine() -> None:
    asked = Knobs(block_size=16, num_gpu_blocks=64)
    vllm_like, reference_like = SimpleNamespace(unsupported_knobs={}), SimpleNamespace(unsupported_knobs={})
    assert stated(asked, vllm_like) == stated(asked, reference_like) == asked.merged(STATED)
    assert stated(asked, vllm_like).enable_prefix_caching is False  # vLLM's own default (on) is not what runs


def test_what_a_scenario_sets_wins() -> None:
    caching = Knobs(enable_prefix_caching=True, max_num_batched_tokens=256)
    got = stated(caching, None)
    assert (got.enable_prefix_caching, got.max_num_batched_tokens, got.enable_chunked_prefill) == (True, 256, True)


def test_no_budget_is_stated_without_chunking_and_nothing_an_engine_cannot_set() -> None:
    unchunked = stated(Knobs(enable_chunked_prefill=False), None)
    assert unchunked.max_num_batched_tokens is None, "without chunking a budget must hold a whole prompt"
    always_chunks = SimpleNamespace(unsupported_knobs={"enable_chunked_prefill": "always on"})
    got = stated(Knobs(), always_chunks)
    assert got.enable_chunked_prefill is None and got.max_num_batched_tokens is None
    assert got.enable_prefix_caching is False
