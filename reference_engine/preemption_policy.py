"""``preemption_mode="auto"``: for each victim, swap or recompute, whichever the cost model says is cheaper.

For a victim holding ``B`` device blocks with ``C`` computed tokens, of which ``H`` a recompute would
get back from the prefix cache (see below)::

    swap      = round trip over the host link:  2 x (per_copy_s + B x block_bytes / link rate)
    recompute = the prefill of the discarded tokens:  (C - H) x per-token prefill cost

Swap is chosen when it is cheaper *and* the host pool has room for the ``B`` blocks; otherwise the
victim is recomputed (if swap was cheaper but the host pool was full, that is a swap fallback, counted
and recorded as one). Host blocks are a scarce resource: a swap that would leave less host room than
the next victim in line needs (the scheduler's own victim order over the other running requests, when
swapping that one would save time) goes ahead only if it saves at least as much time per host block as
that one would. So host room is spent where it saves the most per block: a victim that is cheap to
recompute (short, or mostly shared) does not take the room a long one behind it would need. A victim
that shares blocks with a running request is recomputed whatever the prices: a swap-in brings the
shared blocks back as private copies, held for the rest of its life, so the batch holds fewer
requests (simulated with a 256-token shared prompt: swapping such victims cost auto 4-6% of
throughput against fixed recompute, Llama-3-8B on H200).

``H``, the tokens a recompute gets back (the scheduler's ``_surviving_tokens``): the victim's leading
blocks that another running request also holds (they stay on the device), and its own cached blocks
unless the running requests draw them from the free queue before the victim can be readmitted (their
growth until the first of them can finish, less the blocks free now; the victim's last blocks go
first). Each ``preempted`` event carries the choice: ``mode``, ``reason``, ``estimated_swap_s`` and
``estimated_recompute_s``.

Where the prices come from (:class:`PreemptionCosts`, a protocol with two methods):

* :class:`LinearCosts`: per block over the link, per copy, per recomputed token. The engine measures
  them once at start-up when no profile is given (:func:`auto_costs`: :func:`measure_linear_costs` times
  a batched copy of a few blocks and two prefills of different lengths on the engine's own model), so on this machine
  "auto" prices with this machine's numbers. Simple and documented, not a fit: the measurement takes
  a few tens of milliseconds and is noisy on a busy machine, which can only move victims near the
  crossover from one mode to the other.
* :class:`ModelCosts`: the step cost model the capacity simulator runs on
  (:class:`reference_engine.costs.cost_model.CostModel`) for a hardware profile
  (``EngineConfig.cost_profile``: a calibrated profile file, or ``h200``...); the recompute is priced as
  the extra cost of its prefill added to the step it runs in: the running batch's decodes plus the
  prompts of waiting requests that step would prefill anyway (up to its token budget). On a GPU a
  decode step is memory-bound, so a short prefill beside it alone looks free; but preemption means
  requests wait, the readmission step is full of their prompts and compute-bound, and a recomputed
  token displaces one of theirs. Priced beside the decodes only, auto recomputed 2,536 short victims
  at an estimated 0.29 s in all and lost 2.4% of throughput to fixed swap (simulated no-cache mix,
  Llama-3-8B on H200).

Until the engine hands it measured or profiled prices, the scheduler prices with :data:`DEFAULT_COSTS`.
The scheduler calls one function, :func:`choose`; the engine gets its prices from one, :func:`auto_costs`.

Constructible from plain numbers: the decision (:func:`choose`) needs no model and no tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from reference_engine.config import EngineConfig
from reference_engine.costs.cost_model import CostModel, StepShape
from reference_engine.costs.model_shapes import ModelShape
from reference_engine.costs.profiles import load_profile


class PreemptionCosts(Protocol):
    """Seconds a preemption of each kind will cost the engine, in total (out and back)."""

    def swap_seconds(self, num_blocks: int) -> float:
        """Copy ``num_blocks`` blocks to the host and, later, back."""
        ...

    def recompute_seconds(self, num_tokens: int, num_running: int = 0, context_tokens: int = 0,
                          prefill_tokens: int = 0) -> float:
        """Prefill ``num_tokens`` discarded tokens again, alongside ``num_running`` decodes reading
        ``context_tokens`` KV tokens in all and ``prefill_tokens`` tokens of other prefills (0, 0, 0: a
        step of its own)."""
        ...


@dataclass(frozen=True)
class LinearCosts:
    """Costs linear in blocks and tokens: ``swap = 2 x (per_copy_s + blocks x per_block_s)``,
    ``recompute = tokens x per_token_s``. ``source`` says where the numbers come from."""

    per_block_s: float
    per_copy_s: float
    per_token_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("per_block_s", "per_copy_s", "per_token_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LinearCosts.{name}={value!r} is invalid: expected a finite number >= 0")

    def swap_seconds(self, num_blocks: int) -> float:
        return 0.0 if num_blocks <= 0 else 2 * (self.per_copy_s + num_blocks * self.per_block_s)

    def recompute_seconds(self, num_tokens: int, num_running: int = 0, context_tokens: int = 0,
                          prefill_tokens: int = 0) -> float:
        return max(num_tokens, 0) * self.per_token_s


#: auto's prices until the engine measures or loads real ones (a CPU-ish guess: 20 us per copy, 5 us
#: per block over the link, 50 us per recomputed token); plain-number tests pass their own
DEFAULT_COSTS = LinearCosts(per_block_s=5e-6, per_copy_s=2e-5, per_token_s=5e-5, source="defaults")


class ModelCosts:
    """Prices from the step cost model (:class:`~reference_engine.costs.cost_model.CostModel`, or any
    object with its ``swap_seconds(nbytes)`` and ``recompute_seconds(tokens, alongside)``)."""

    def __init__(self, cost_model: Any, block_size: int):
        self.cost_model = cost_model
        self.block_bytes = block_size * cost_model.kv_bytes_per_token
        self.source = f"cost model: {cost_model.model.name} on {cost_model.profile.name}"

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * self.cost_model.swap_seconds(num_blocks * self.block_bytes)

    def recompute_seconds(self, num_tokens: int, num_running: int = 0, context_tokens: int = 0,
                          prefill_tokens: int = 0) -> float:
        alongside = None
        if num_running > 0:
            alongside = StepShape(0, num_running, num_running, num_running, context_tokens, context_tokens)
        if prefill_tokens > 0:
            others = StepShape.prefill(prefill_tokens)
            alongside = others if alongside is None else alongside + others
        return self.cost_model.recompute_seconds(num_tokens, alongside)


@dataclass(frozen=True)
class Decision:
    """What auto chose for one victim, and why (recorded on its ``preempted`` event)."""

    mode: str  # "swap" | "recompute"
    reason: str
    estimated_swap_s: float
    estimated_recompute_s: float
    recompute_tokens: int  # computed tokens a recompute would compute again

    def event_data(self) -> dict[str, Any]:
        return {"reason": self.reason, "estimated_swap_s": self.estimated_swap_s,
                "estimated_recompute_s": self.estimated_recompute_s}


def choose(costs: PreemptionCosts, *, num_blocks: int, computed_tokens: int, surviving_tokens: int,
           free_host_blocks: int, num_running: int = 0, context_tokens: int = 0, waiting_tokens: int = 0,
           reserve_blocks: int = 0, reserve_saving_per_block: float = 0.0, shared_blocks: int = 0) -> Decision:
    """Swap or recompute a victim holding ``num_blocks`` blocks with ``computed_tokens`` computed, of
    which ``surviving_tokens`` would survive a recompute (prefix-cached or shared). Ties go to
    recompute (it holds no host memory). A victim that does not fit the host pool is recomputed; the
    reason says whether swap would have been cheaper (the caller counts that as a swap fallback).
    ``waiting_tokens``: prompt tokens of waiting requests that the readmission step would prefill
    anyway (at most a step's token budget), which the recompute is priced beside.
    ``reserve_blocks``, ``reserve_saving_per_block``: the host room to keep for the next victim in line
    and what swapping it would save per block (0, 0: none to keep; see the module docstring)."""
    tokens = max(computed_tokens - surviving_tokens, 0)
    swap_s = costs.swap_seconds(num_blocks)
    recompute_s = costs.recompute_seconds(tokens, num_running, context_tokens, waiting_tokens)
    if swap_s < recompute_s:
        if shared_blocks > 0:
            return Decision("recompute", "shares blocks with a running request (a swap-in brings them back unshared)",
                            swap_s, recompute_s, tokens)
        if num_blocks > free_host_blocks:
            return Decision("recompute", "swap cheaper but host pool full", swap_s, recompute_s, tokens)
        saving = (recompute_s - swap_s) / max(num_blocks, 1)
        if free_host_blocks - num_blocks < reserve_blocks and saving < reserve_saving_per_block:
            return Decision("recompute", "host room kept for the next victim in line", swap_s, recompute_s, tokens)
        return Decision("swap", "swap cheaper", swap_s, recompute_s, tokens)
    reason = "recompute cheaper"
    if surviving_tokens and computed_tokens and tokens < computed_tokens:
        reason = f"recompute cheaper ({surviving_tokens} of {computed_tokens} tokens kept by the prefix cache)"
    return Decision("recompute", reason, swap_s, recompute_s, tokens)


# --------------------------------------------------------------------------------------------
# the engine's prices: a profile's cost model, or linear costs measured on its own model at start-up

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
