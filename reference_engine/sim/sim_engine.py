"""SimEngine: the reference engine built from priced parts.

It *is* :class:`~reference_engine.engine.LLMEngine`, built through its public constructor with
:func:`priced_parts` as the parts factory: the same ``add_request`` validation, ``step()`` (schedule
-> swap copies -> run -> update), ``abort_request``, ``stats()``, ``counters()`` and events, over the
real :class:`~reference_engine.scheduler.Scheduler` and
:class:`~reference_engine.block_manager.BlockManager`. Only the model's parts differ: the runner
(:class:`~reference_engine.sim.pricing_runner.SimRunner`: placeholder tokens, the clock moved on by
the step's cost), the KV tensors (:class:`~reference_engine.sim.pricing_runner.SimKVCache`: swap
copies priced over the host link) and the timer and event clock (the virtual clock, so a step's
``record.seconds`` and ``swap_seconds`` are simulated seconds). With the same requests released
before the same steps it makes the same scheduling decisions as the real engine, whatever the
model's size.

The device pool is sized as on a GPU: ``gpu_memory_utilization`` of the profile's memory minus the
weights at ``EngineConfig.dtype`` (activation memory is not reserved: the pool is a little larger
than a real engine's), unless ``num_gpu_blocks_override`` says otherwise.
"""

from __future__ import annotations

from reference_engine.config import ConfigError, EngineConfig, GiB
from reference_engine.costs.cost_model import CostModel, StepShape
from reference_engine.costs.model_shapes import ModelShape
from reference_engine.costs.profiles import HardwareProfile
from reference_engine.engine import EngineParts, LLMEngine, block_manager_for
from reference_engine.events import EventSink
from reference_engine.outputs import RequestOutput, StepRecord, StepResult
from reference_engine.policies.preemption_costs import ModelCosts
from reference_engine.request import RequestStatus
from reference_engine.sim.lazy import LazyDecodes, Span
from reference_engine.sim.pricing_runner import SimKVCache, SimRunner, VirtualClock, placeholder_token


class _NoWeights:
    """Where the engine reads ``model.config`` (vocabulary size, EOS ids, positions): the shape only."""

    def __init__(self, shape: ModelShape):
        self.config = shape


def device_pool_blocks(model: ModelShape, profile: HardwareProfile, config: EngineConfig, block_bytes: int) -> int:
    """Blocks that fit in ``gpu_memory_utilization`` of the device after the weights. Raises
    ConfigError naming ``gpu_memory_utilization`` when not even one block fits."""
    weights = model.weight_bytes(CostModel(model, profile, config.dtype).dtype_bytes)
    budget = profile.memory_bytes * config.gpu_memory_utilization - weights
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise ConfigError("gpu_memory_utilization", config.gpu_memory_utilization,
                          f"a share of {profile.name}'s {profile.memory_bytes / GiB:.0f} GiB that holds "
                          f"{model.name}'s {weights / GiB:.1f} GiB of weights and at least one KV block")
    return blocks


def priced_parts(config: EngineConfig, model: ModelShape, profile: HardwareProfile, cost: CostModel,
                 clock: VirtualClock) -> EngineParts:
    """The engine's parts for ``config`` with the model priced instead of run: pools sized for
    ``model`` on ``profile`` (:func:`device_pool_blocks`), a runner and KV stand-in that move ``clock``
    on by ``cost``, ``clock`` as the timer and event clock, and auto pricing victims with that same
    cost model. Outputs share the request's own lists (placeholders, read at once; copying them every
    step was a third of a large simulation's time)."""
    config = config.resolve(model.max_position_embeddings)
    block_bytes = config.block_size * cost.kv_bytes_per_token
    num_gpu_blocks = config.num_gpu_blocks_override or device_pool_blocks(model, profile, config, block_bytes)
    block_manager = block_manager_for(config, num_gpu_blocks, block_bytes)
    return EngineParts(
        config, _NoWeights(model), block_manager, SimKVCache(block_bytes, cost, clock),
        SimRunner(cost, clock, placeholder_token(model.eos_token_ids)),
        preemption_costs=ModelCosts(cost, config.block_size), timer=clock.now, clock=clock.now,
        output_of=_output_of, device=None, attention_backend="simulated")


class SimEngine(LLMEngine):
    """An LLMEngine that computes nothing; ``clock`` is its virtual time in seconds."""

    def __init__(self, config: EngineConfig, model: ModelShape, profile: HardwareProfile,
                 event_sink: EventSink | None = None):
        self.shape, self.profile = model, profile
        self.cost = CostModel(model, profile, config.dtype)
        self.clock = VirtualClock()
        super().__init__(config, event_sink,
                         build_parts=lambda c: priced_parts(c, model, profile, self.cost, self.clock))
        config = self.config
        self.lazy = LazyDecodes(config.block_size, config.max_model_len, self.runner.token)
        # The fast path replays schedule() for steps it proves preemption-free; under the priority
        # policy admission itself may preempt, and prefix caching registers blocks every step.
        # The lazy decoders' token counts are stale between syncs, and admission control reads them (and AIMD
        # needs every step's outcome): with admission on, every step takes the plain path.
        # Prefill pacing reads whether anyone decodes, which the lazy decoders hide: also the plain path.
        self.fast_path_eligible = (config.scheduling_policy == "fcfs" and not config.enable_prefix_caching
                                   and config.admission_policy == "none" and config.prefill_pacing_tokens is None)
        self.fast_steps = self.plain_steps = 0  # how often step_fast could take its fast path

    def add_request(self, *args, **kwargs) -> None:
        """:meth:`LLMEngine.add_request`, then the clock moves on by the profile's ``per_request_s``."""
        super().add_request(*args, **kwargs)
        self.clock.advance(self.profile.coefficients.per_request_s)

    def abort_request(self, request_id: str) -> bool:
        req = self.lazy.requests.get(request_id)
        if req is not None:
            self.lazy.leave(req, self.scheduler.step_index + 1)
        return super().abort_request(request_id)

    def step(self) -> StepResult:
        """:meth:`LLMEngine.step` on the virtual clock. Lazy requests (left by :meth:`step_fast`) are
        synced first."""
        if self.lazy.requests:
            self.lazy.leave_all(self.scheduler.step_index + 1)
        return super().step()

    # ------------------------------------------------------------------ the fast path
    def step_fast(self) -> FastStep:
        """One engine step with the same decisions as :meth:`step`, at a cost proportional to what
        happens in it rather than to the running batch (:mod:`reference_engine.sim.lazy`).

        A step is taken fast when nothing in it can preempt: every lazy decoder crossing a block
        boundary and every partial prefill gets its blocks from the free pool, and the token budget
        covers the decodes. It then gives the crossing decoders their blocks and calls
        :meth:`Scheduler.schedule` with the lazy decodes by count (``decoded_elsewhere``) and the
        partial prefills as the only running requests to schedule; the pricing runner adds the lazy
        decodes to the step's shape. Any other step is a plain :meth:`step` with every lazy request
        synced first, after which the steady decoders turn lazy again. Tokens of lazy requests come
        back as :class:`~reference_engine.sim.lazy.Span` s, in ``FastStep.spans`` (aborts add theirs to
        ``lazy.closed``, drained by the next step)."""
        s = self.scheduler.step_index + 1
        if not self._can_step_fast(s):
            self.plain_steps += 1
            aborted = self.take_aborted()
            result = self.step()
            self._join_decoders(self.scheduler.running)
            return self._fast_result(aborted + result.outputs, len(aborted), [], result.record)
        self.fast_steps += 1
        return self._step_fast(s)

    def _partial_prefills(self) -> list:
        sched = self.scheduler
        if len(sched.running) == len(self.lazy):
            return []
        return [r for r in sched.running if r.request_id not in self.lazy.requests]

    def _can_step_fast(self, s: int) -> bool:
        if not self.fast_path_eligible:
            return False
        sched, bm, lazy = self.scheduler, self.block_manager, self.lazy
        budget = sched.max_num_batched_tokens - len(lazy)
        if budget < 0:
            return False
        needed = len(lazy.crossing(s))
        for req in self._partial_prefills():
            gap = req.num_tokens - req.num_computed_tokens
            if gap <= 1:  # a decoder that could not turn lazy: the plain step orders it among the others
                return False
            if budget == 0:
                continue
            n = min(gap, budget)
            held = len(bm.block_tables.get(req.request_id, ()))
            needed += max(0, bm.blocks_needed(req.num_computed_tokens + n) - held)
            budget -= n
        return needed <= bm.num_free_gpu_blocks

    def _step_fast(self, s: int) -> FastStep:
        t0 = self.timer()
        sched, bm, lazy, counters = self.scheduler, self.block_manager, self.lazy, self.scheduler.counters
        aborted = self.take_aborted()
        # -- schedule(), with the lazy decodes by count: first the blocks of those crossing a boundary
        for req in lazy.crossing(s):
            lazy.sync(req, s)
            allocated = bm.allocate_slots(req, 1)
            assert allocated, "_can_step_fast counted the blocks"
            lazy.allocated(req.request_id, s)
        out = sched.schedule(decoded_elsewhere=len(lazy), running=self._partial_prefills())
        assert not out.preempted, "_can_step_fast proved the step preempts nobody"
        # -- swap copies, the run, the update
        self.copy_swapped_blocks(out)
        n = len(lazy)
        context = lazy.computed_before(s) + n
        decodes = StepShape(0, n, n, n, context, context)
        sampled = self.runner.execute(out, extra=decodes)
        counters.computed_tokens += n
        counters.generated_tokens += n
        finishing = lazy.finishing(s)
        for req in finishing:  # decodes come first in update()'s order too
            lazy.leave(req, s + 1)
            sched.finish(req, RequestStatus.FINISHED_LENGTH)
        lazy.forget_step(s)
        touched = sched.update(out, sampled)
        self._join_decoders(touched)
        outputs = aborted + [_output_of(r) for r in finishing + touched]
        record = StepRecord(self.timer() - t0, out.num_tokens + n, out.num_prefill_tokens, out.num_decode_tokens + n, 0)
        return self._fast_result(outputs, len(aborted), finishing, record)

    def _join_decoders(self, requests) -> None:
        if not self.fast_path_eligible:
            return
        lazy, bm, s = self.lazy, self.block_manager, self.scheduler.step_index + 1
        for req in requests:
            if req.request_id not in lazy.requests and lazy.can_join(req):
                lazy.join(req, len(bm.block_tables[req.request_id]), s)

    def _fast_result(self, outputs: list[RequestOutput], num_aborted: int, finishing: list,
                     record: StepRecord) -> FastStep:
        lazy_done = {r.request_id for r in finishing}
        tokens = [o.request_id for o in outputs[num_aborted:] if o.request_id not in lazy_done]
        finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
        spans, self.lazy.closed = self.lazy.closed, []
        return FastStep(tokens, finished, spans, record)


class FastStep:
    """What one :meth:`SimEngine.step_fast` did for the driver: ``tokens``: requests that got one
    token at the end of this step; ``spans``: lazy requests' tokens, one at the end of every step of
    each span (closed this step or by aborts since the last one); ``finished``: request id -> reason;
    ``record``: what the step did, as :meth:`LLMEngine.step`'s (lazy decodes included)."""

    __slots__ = ("finished", "record", "spans", "tokens")

    def __init__(self, tokens: list[str], finished: dict[str, str | None], spans: list[Span], record: StepRecord):
        self.tokens, self.finished, self.spans, self.record = tokens, finished, spans, record


def _output_of(req) -> RequestOutput:
    finished = req.status.finished
    return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids, finished,
                         req.status.value if finished else None, req.num_preemptions, req.num_recomputed_tokens,
                         req.num_prefix_hit_tokens)

