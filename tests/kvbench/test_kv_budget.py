"""Pressure stated in tokens, and each engine's terms for it (kvbench.core.kv_budget)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbench.core.knobs import Knobs
from kvbench.core.kv_budget import (
    ANY_LAYOUT,
    KVBudget,
    KVLayout,
    in_engine_terms,
    pool_knobs,
    pressured,
    roomy,
    shared_pool,
    together,
)
from kvbench.engines.http.presets import VLLM_CPU_LAYOUT, VLLM_GPU_LAYOUT


def test_the_conformance_pool_is_the_same_tokens_on_every_engine() -> None:
    budget = pressured([35, 189, 120])  # the conformance set's largest request needs 189 tokens
    assert budget.tokens == 378
    ref = pool_knobs(budget, ANY_LAYOUT)
    assert (ref.block_size, ref.num_gpu_blocks, ref.max_model_len) == (16, 24, None)
    cpu = pool_knobs(budget, VLLM_CPU_LAYOUT)
    assert (cpu.block_size, cpu.num_gpu_blocks) == (32, 12)
    assert cpu.max_model_len == 192 and cpu.max_model_len <= cpu.block_size * cpu.num_gpu_blocks
    gpu = pool_knobs(budget, VLLM_GPU_LAYOUT)
    assert (gpu.block_size, gpu.num_gpu_blocks, gpu.max_model_len) == (16, 24, 192)


@given(tokens=st.integers(1, 100_000), largest=st.integers(1, 10_000), multiple=st.sampled_from([1, 16, 32, 64]),
       holds=st.booleans(), wanted=st.one_of(st.none(), st.integers(1, 128)))
def test_every_pool_holds_the_largest_request_in_a_block_size_the_engine_takes(tokens, largest, multiple, holds,
                                                                                wanted) -> None:
    layout = KVLayout(block_multiple=multiple, preferred_block_size=16, pool_holds_max_model_len=holds)
    knobs = pool_knobs(KVBudget(tokens, largest), layout, wanted)
    assert layout.takes_block_size(knobs.block_size)
    pool = knobs.block_size * knobs.num_gpu_blocks
    assert pool >= largest and pool >= tokens
    # no more than a block beyond what was asked, plus the block an engine whose pool must hold max_model_len
    # keeps back (vLLM's null block)
    held_back = knobs.block_size if holds else 0
    assert pool < max(tokens, largest + held_back) + knobs.block_size
    if holds:
        assert largest <= knobs.max_model_len <= pool - knobs.block_size  # it starts: the rest holds max_model_len
    else:
        assert knobs.max_model_len is None


def test_roomy_holds_every_request_at_once() -> None:
    needs = [10, 200, 33]
    knobs = pool_knobs(roomy(needs), VLLM_CPU_LAYOUT)
    assert knobs.block_size * knobs.num_gpu_blocks >= sum(-(-n // 32) * 32 for n in needs)


def test_scenario_pools_keep_their_tokens_in_another_engines_blocks() -> None:
    knobs = Knobs(block_size=16, num_gpu_blocks=128, num_cpu_blocks=1024, preemption_mode="swap")
    same = in_engine_terms(knobs, ANY_LAYOUT, [300])
    assert same == knobs
    cpu = in_engine_terms(knobs, VLLM_CPU_LAYOUT, [300, 500])
    assert (cpu.block_size, cpu.num_gpu_blocks, cpu.num_cpu_blocks, cpu.max_model_len) == (32, 64, 512, 512)
    assert cpu.preemption_mode == "swap"


def test_a_budget_needs_a_request() -> None:
    with pytest.raises(ValueError, match="largest"):
        KVBudget(tokens=10, largest=0)


class _FixedPoolServer:
    """An engine whose pool is what it was started with (as ``openai:url=`` sees a running server)."""

    name = "fixed"

    def __init__(self, block_size: int, blocks: int, max_model_len: int | None = None):
        self.pool = Knobs(block_size=block_size, num_gpu_blocks=blocks, max_model_len=max_model_len)

    def fixed_pool(self) -> Knobs:
        return self.pool


def test_a_running_servers_pool_gets_a_workload_sized_to_it() -> None:
    from kvbench.conformance.prove import PRESSURE, fitted_requests, kv_needs
    from kvbench.models.builtin import builtin_checkpoint

    model = str(builtin_checkpoint("tiny"))
    for blocks in (24, 64):
        server = _FixedPoolServer(16, blocks)
        requests = fitted_requests(server, model)
        needs = kv_needs(requests)
        pool = 16 * blocks
        assert max(needs) <= pool / PRESSURE  # the pool holds the largest request PRESSURE times...
        assert sum(needs) > 3 * pool  # ...but not a third of them at once: real pressure


def test_a_pool_too_large_to_pressure_skips_saying_so() -> None:
    from kvbench.conformance.prove import fitted_requests
    from kvbench.models.builtin import builtin_checkpoint

    with pytest.raises(pytest.skip.Exception, match="too large to pressure"):
        fitted_requests(_FixedPoolServer(16, 100_000), str(builtin_checkpoint("tiny")))


def test_a_running_servers_pool_is_used_as_it_stands_or_the_check_skips(monkeypatch) -> None:
    """A running server's pool is what the requests are sized to: a check skips only when the pool cannot
    hold its largest request; an unpressured run larger than the pool is met by waves, not by a skip."""
    from kvbench.engines.http.openai import KnobsNotSettable, OpenAIAdapter

    adapter = OpenAIAdapter.__new__(OpenAIAdapter)
    adapter.name = "openai"
    monkeypatch.setattr(adapter, "fixed_pool", lambda: Knobs(block_size=16, num_gpu_blocks=24), raising=False)
    assert adapter.pool_knobs(KVBudget(tokens=300, largest=150)) == Knobs(block_size=16, num_gpu_blocks=24)
    with pytest.raises(KnobsNotSettable, match="cannot hold this check's largest request"):
        adapter.pool_knobs(KVBudget(tokens=900, largest=450))
    assert adapter.pool_knobs(roomy([100, 150, 120])) == Knobs(block_size=16, num_gpu_blocks=24)


def test_pressured_pools_of_different_workloads_round_to_one_shared_pool() -> None:
    """On an engine that starts afresh per knob set, checks whose workloads differ a little share one launch:
    their pressured pools round to the same power of two of blocks, and max_model_len follows the pool alone."""
    sizes = {}
    for needs in ([35, 189], [120, 240], [300, 288]):  # 378, 480 and 600 tokens asked: 12, 15 and 19 blocks of 32
        budget = replace(pressured(needs), roundable=True)
        knobs = pool_knobs(shared_pool(budget, VLLM_CPU_LAYOUT, max_len=1024), VLLM_CPU_LAYOUT)
        sizes[knobs.num_gpu_blocks, knobs.max_model_len] = needs
        assert knobs.max_model_len >= max(needs)  # every request still fits
    assert list(sizes) == [(16, 480)]


@given(tokens=st.integers(1, 50_000), largest=st.integers(1, 5_000), holds=st.booleans(),
       max_len=st.one_of(st.none(), st.integers(1, 8_192)))
def test_a_shared_pool_keeps_the_pressure_within_a_factor_of_sqrt_two(tokens, largest, holds, max_len) -> None:
    layout = KVLayout(block_multiple=32, preferred_block_size=32, pool_holds_max_model_len=holds)
    asked = KVBudget(tokens, largest, roundable=True)
    shared = shared_pool(asked, layout, max_len=max_len)
    knobs = pool_knobs(shared, layout)
    pool = knobs.block_size * knobs.num_gpu_blocks
    held_back = 32 if holds else 0
    assert pool >= largest + held_back or pool >= -(-largest // 32) * 32 + held_back  # the largest still runs
    exact = pool_knobs(replace(asked, roundable=False), layout)
    if pool > exact.block_size * exact.num_gpu_blocks:  # rounded up: never more than sqrt(2) the pool asked
        assert pool <= 2 ** 0.5 * max(tokens, 32) + 32
    if holds:
        assert largest <= knobs.max_model_len <= pool - 32


def test_only_roundable_pressured_budgets_are_rounded() -> None:
    exact = KVBudget(tokens=9 * 32, largest=8 * 32)  # a check that sized its pool on purpose (a whole-pool request)
    assert shared_pool(exact, VLLM_CPU_LAYOUT) == exact
    roomy_budget = replace(roomy([100, 200]), roundable=True)
    assert shared_pool(roomy_budget, VLLM_CPU_LAYOUT) == roomy_budget
    cells = KVLayout(only_block_size=1, pool_multiple=256, slots="unified")  # llama.cpp rounds its own cells
    rounded = KVBudget(tokens=700, largest=300, roundable=True)
    assert shared_pool(rounded, cells) == rounded


@given(st.lists(st.integers(1, 400), min_size=1, max_size=12), st.booleans())
def test_a_pool_for_all_at_once_holds_every_request_at_once_and_rounds_only_up(needs, holds) -> None:
    layout = VLLM_CPU_LAYOUT if holds else KVLayout(preferred_block_size=16)
    size = layout.block_size()
    budget = together(needs, size)
    blocks_needed = sum(-(-n // size) for n in needs) + (1 if holds else 0)
    exact = pool_knobs(budget, layout)
    assert exact.num_gpu_blocks >= blocks_needed, "every request at once, in whole blocks"
    shared = pool_knobs(shared_pool(budget, layout), layout)
    assert shared.num_gpu_blocks >= blocks_needed, "rounded up, never down"
    assert shared.num_gpu_blocks & (shared.num_gpu_blocks - 1) == 0 or shared.num_gpu_blocks == exact.num_gpu_blocks
    assert shared.num_gpu_blocks < 2 * max(blocks_needed, -(-max(needs) // size) + (1 if holds else 0))


def test_five_small_streams_land_on_the_pool_most_checks_share_on_vllm() -> None:
    """The mid-stream error check's five streams of at most three 32-token blocks: vLLM's 16-block launch."""
    knobs = pool_knobs(shared_pool(together([80] * 5, 32), VLLM_CPU_LAYOUT, max_len=1024), VLLM_CPU_LAYOUT)
    assert (knobs.num_gpu_blocks, knobs.max_model_len) == (16, 480)
