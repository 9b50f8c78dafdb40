"""Where ``preemption_mode="auto"`` gets its prices: seconds a swap or a recompute of a victim will cost.

Two sources behind one protocol (:class:`PreemptionCosts`, two methods):

* :class:`LinearCosts`: per block over the link, per copy, per recomputed token. The engine measures them
  once at start-up when no profile is given (:mod:`reference_engine.policies.startup_costs`), so on this
  machine "auto" prices with this machine's numbers. Simple and documented, not a fit: the measurement
  is short and noisy on a busy machine, which can only move victims near the crossover from one mode to
  the other.
* :class:`ModelCosts`: the step cost model the capacity simulator runs on
  (:class:`reference_engine.costs.cost_model.CostModel`) for a hardware profile
  (``EngineConfig.cost_profile``: a calibrated profile file, or ``h200``...). The recompute is priced as
  the extra cost of its prefill added to the step it runs in: the running batch's decodes plus the
  prompts of waiting requests that step would prefill anyway (up to its token budget). On a GPU a decode
  step is memory-bound, so a short prefill beside it alone looks free; but preemption means requests
  wait, the readmission step is full of their prompts and compute-bound, and a recomputed token displaces
  one of theirs. Priced beside the decodes only, auto recomputed many short victims that a swap would
  have served for less, and lost throughput to fixed swap in the simulator
  (docs/journal/measurements.md#preemption-policies has what auto measured against the fixed modes).

Until the engine hands it measured or profiled prices, the scheduler prices with :data:`DEFAULT_COSTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from reference_engine.costs.cost_model import StepShape


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
