"""The simulator's runner: the engine's runner interface, computing nothing, advancing a virtual clock.

:class:`SimRunner` takes the same :class:`~reference_engine.scheduler.SchedulerOutput` as
:class:`~reference_engine.runner.ModelRunner`, prices the step with the cost model, moves the clock
on by that much and "samples" a placeholder token for every chunk that completes its sequence.
Output lengths therefore come from ``max_tokens`` (requests must ``ignore_eos``; the placeholder is
never an EOS token). :class:`SimKVCache` stands in for the KV tensors: a swap copy moves the clock on
by its cost over the host link and returns the bytes it would have copied.
"""

from __future__ import annotations

from reference_engine.costs.cost_model import CostModel, StepShape
from reference_engine.scheduler import SchedulerOutput


class VirtualClock:
    """Simulated seconds. Only ever moves forward: by :meth:`advance` for work done (a step, a copy,
    taking a request in) and by :meth:`advance_to` for waiting (an idle engine, the next arrival);
    ``idle_s`` adds up the waiting until the runner takes it (:meth:`take_idle`)."""

    def __init__(self, start: float = 0.0):
        self.t = float(start)
        self.idle_s = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.t += seconds

    def advance_to(self, t: float) -> None:
        """Jump to ``t`` if it is later (an idle engine waiting for the next arrival)."""
        if t > self.t:
            self.idle_s += t - self.t
            self.t = float(t)

    def take_idle(self) -> float:
        """Seconds spent waiting since the last call (and start counting again)."""
        idle, self.idle_s = self.idle_s, 0.0
        return idle


def placeholder_token(eos_token_ids: tuple[int, ...]) -> int:
    """A token id that is no EOS token, so a placeholder never ends a request by itself."""
    token = 0
    while token in eos_token_ids:
        token += 1
    return token


class SimRunner:
    """``execute(out)`` as :class:`~reference_engine.runner.ModelRunner` does it, on the virtual clock."""

    def __init__(self, cost: CostModel, clock: VirtualClock, token: int = 0):
        self.cost = cost
        self.clock = clock
        self.token = token
        self.last_shape = StepShape()
        self.last_seconds = 0.0

    def execute(self, out: SchedulerOutput, on_sampled: object = None, extra: StepShape | None = None
                ) -> dict[str, int]:
        """Advance the clock by the step's cost, plus what waking up costs after the clock's idle spell
        since the previous step (:meth:`~reference_engine.costs.profiles.Coefficients.wake_seconds`); a
        placeholder token for every completing chunk. ``extra``: work of the step that is not in
        ``out.chunks`` (the fast path's lazy decodes, whose tokens the caller accounts for). A step is
        priced as one pass: ``on_sampled`` is never called."""
        shape = StepShape.of_chunks((c.start, c.num_tokens, c.completes) for c in out.chunks)
        if extra is not None and extra.num_seqs:
            shape = shape + extra
        if not shape.num_seqs:
            self.last_shape, self.last_seconds = StepShape(), 0.0
            return {}
        self.last_shape = shape
        wake = self.cost.profile.coefficients.wake_seconds(self.clock.take_idle())
        self.last_seconds = self.cost.step_seconds(shape) + wake
        self.clock.advance(self.last_seconds)
        token = self.token
        return {c.request.request_id: token for c in out.chunks if c.completes}


class SimKVCache:
    """The KV pools' stand-in: swap copies cost link time on the clock; there are no tensors."""

    def __init__(self, block_bytes: int, cost: CostModel, clock: VirtualClock):
        self.block_bytes = block_bytes
        self.cost = cost
        self.clock = clock

    def _copy(self, mapping: list[tuple[int, int]]) -> int:
        if not mapping:
            return 0
        nbytes = len(mapping) * self.block_bytes
        self.clock.advance(self.cost.swap_seconds(nbytes))  # one batched copy per direction per step
        return nbytes

    def swap_out(self, mapping: list[tuple[int, int]]) -> int:
        return self._copy(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> int:
        return self._copy(mapping)

    def read_blocks(self, block_ids: list[int]):
        raise NotImplementedError("the simulator holds no KV tensors: there are no blocks to read")
