"""The prices ``preemption_mode="auto"`` starts with: a profile's cost model, or linear costs measured on
the engine's own model at start-up.

The engine gets its prices from one call, :func:`auto_costs`; :func:`measure_linear_costs` is the
measurement itself (timers and the two operations passed in, so it is testable on a fake clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from reference_engine.config import EngineConfig
from reference_engine.costs.cost_model import CostModel
from reference_engine.costs.model_shapes import ModelShape
from reference_engine.costs.profiles import load_profile
from reference_engine.policies.preemption_costs import DEFAULT_COSTS, LinearCosts, ModelCosts, PreemptionCosts

#: costs measured by :func:`auto_costs`, per (model, dtype, device, block size): measured once per
#: process, so that engines built again for the same model (a benchmark's repeats, a conformance
#: check's runs) make the same choices; a fresh measurement per engine moved victims near the
#: crossover from one mode to the other between repeats on a loaded machine
_MEASURED_COSTS: dict[tuple, LinearCosts] = {}


def auto_costs(config: EngineConfig, model_config: Any, kv_cache: Any, runner: Any,
               free_device_blocks: int) -> PreemptionCosts:
    """What ``preemption_mode="auto"`` prices victims with, for an engine at start-up (nothing running).

    ``config.cost_profile`` given: :class:`ModelCosts` on the step cost model of the engine's model
    (``model_config``: :class:`reference_engine.model.ModelConfig`'s sizes) on that profile. Else
    :class:`LinearCosts` measured (:func:`measure_linear_costs`) on the engine's own ``kv_cache`` (a
    batched ``swap_out`` of its first blocks) and ``runner`` (``runner.prefill_alone(n)``), once per
    process and model (:data:`_MEASURED_COSTS`); :data:`DEFAULT_COSTS` when the pools are too small
    to measure in (fewer than 2 blocks on either side, or room for fewer than 8 tokens)."""
    if config.cost_profile is not None:
        mc = model_config
        shape = ModelShape("engine-model", mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads,
                           mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings, mc.head_dim,
                           bool(getattr(mc, "tie_word_embeddings", False)))
        return ModelCosts(CostModel(shape, load_profile(config.cost_profile), config.dtype), config.block_size)
    num_blocks = min(8, kv_cache.device_cache.shape[0], kv_cache.host_cache.shape[0])

    def copy_blocks(n: int) -> None:
        # The swap-out path itself, index building included. Safe at start-up: it reads device blocks
        # nobody holds and writes host blocks that are only ever read after a later swap-out wrote them.
        kv_cache.swap_out([(i, i) for i in range(n)])

    long = min(128, config.max_model_len - 1, free_device_blocks * config.block_size)
    if long < 8 or num_blocks < 2:  # too small a pool to measure in: the documented defaults
        return DEFAULT_COSTS
    key = (config.model, config.dtype, config.device, config.block_size)
    if key not in _MEASURED_COSTS:
        _MEASURED_COSTS[key] = measure_linear_costs(copy_blocks, runner.prefill_alone, time.perf_counter,
                                                    blocks=num_blocks, short=max(long // 4, 1), long=long)
    return _MEASURED_COSTS[key]


def measure_linear_costs(copy_blocks: Callable[[int], None], prefill: Callable[[int], None],
                         timer: Callable[[], float] = time.perf_counter, *, blocks: int = 8,
                         short: int = 32, long: int = 128, repeats: int = 3) -> LinearCosts:
    """Time ``copy_blocks(n)`` (one batched copy of ``n`` blocks, one direction) at 1 and ``blocks``
    blocks, and ``prefill(n)`` (a prefill of ``n`` tokens alone) at ``short`` and ``long`` tokens;
    the best of ``repeats`` each after one warm-up. Per block and per token are the slopes (the
    per-step fixed cost of a prefill step is paid anyway: the recompute runs in a step that runs)."""

    def best(fn: Callable[[int], None], n: int) -> float:
        fn(n)  # warm-up: first-call allocations and lazy initialisation are not the steady cost
        times = []
        for _ in range(repeats):
            t0 = timer()
            fn(n)
            times.append(timer() - t0)
        return min(times)

    one, many = best(copy_blocks, 1), best(copy_blocks, blocks)
    per_block = max(many - one, 0.0) / (blocks - 1) if blocks > 1 else many
    per_block = per_block or many / blocks
    per_copy = max(one - per_block, 0.0)
    t_short, t_long = best(prefill, short), best(prefill, long)
    per_token = max(t_long - t_short, 0.0) / (long - short)
    per_token = per_token or t_long / long
    return LinearCosts(per_block, per_copy, per_token,
                       source=f"measured at engine start: copy of 1/{blocks} blocks, prefill of {short}/{long} tokens")
