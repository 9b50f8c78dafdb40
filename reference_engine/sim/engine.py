"""SimEngine: the reference engine with its model replaced by the cost model.

It *is* :class:`~reference_engine.engine.LLMEngine`: the same ``add_request`` validation, ``step()``
(schedule -> swap copies -> run -> update), ``abort_request``, ``stats()``, ``counters()`` and events,
over the real :class:`~reference_engine.scheduler.Scheduler` and
:class:`~reference_engine.block_manager.BlockManager`. Only three parts are swapped in: the runner
(:class:`~reference_engine.sim.runner.SimRunner`: placeholder tokens, the clock moved on by the
step's cost), the KV tensors (:class:`~reference_engine.sim.runner.SimKVCache`: swap copies priced
over the host link) and the timer (``engine.timer`` is the virtual clock, so ``last_step["seconds"]``
and ``swap_seconds`` are simulated seconds). With the same requests released before the same steps
it makes the same scheduling decisions as the real engine, whatever the model's size.

The device pool is sized as on a GPU: ``gpu_memory_utilization`` of the profile's memory minus the
weights at ``EngineConfig.dtype`` (activation memory is not reserved: the pool is a little larger
than a real engine's), unless ``num_gpu_blocks_override`` says otherwise.
"""

from __future__ import annotations

import itertools

from reference_engine.block_manager import BlockManager
from reference_engine.config import ConfigError, EngineConfig, GiB
from reference_engine.counters import EngineCounters
from reference_engine.engine import LLMEngine
from reference_engine.events import EventLog, EventSink
from reference_engine.outputs import RequestOutput
from reference_engine.scheduler import Scheduler
from reference_engine.sim.cost_model import CostModel
from reference_engine.sim.models import ModelShape
from reference_engine.sim.profiles import HardwareProfile
from reference_engine.sim.runner import SimKVCache, SimRunner, VirtualClock, placeholder_token


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


class SimEngine(LLMEngine):
    """An LLMEngine that computes nothing; ``clock`` is its virtual time in seconds."""

    def __init__(self, config: EngineConfig, model: ModelShape, profile: HardwareProfile,
                 event_sink: EventSink | None = None):
        # Not LLMEngine.__init__: it loads weights and allocates KV tensors. The parts built here are
        # the ones it builds, from the same config, with the model's parts replaced.
        self.device = None
        self.model = _NoWeights(model)
        self.shape, self.profile = model, profile
        self.config = config = config.resolve(model.max_position_embeddings)
        self.cost = CostModel(model, profile, config.dtype)
        block_bytes = config.block_size * self.cost.kv_bytes_per_token
        num_gpu_blocks = config.num_gpu_blocks_override or device_pool_blocks(model, profile, config, block_bytes)
        if config.num_cpu_blocks_override is not None:
            num_cpu_blocks = config.num_cpu_blocks_override
        elif config.preemption_mode == "swap":
            num_cpu_blocks = int(config.swap_space * GiB) // block_bytes
        else:
            num_cpu_blocks = 0
        self.clock = VirtualClock()
        self._counters = EngineCounters()
        self.block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size,
                                          config.enable_prefix_caching, self._counters)
        self.kv_cache = SimKVCache(block_bytes, self.cost, self.clock)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy, clock=self.clock.now, events=EventLog(config.max_events))
        if event_sink is not None:
            self.add_event_sink(event_sink)
        self.attention_backend = "simulated"
        self.runner = SimRunner(self.cost, self.clock, placeholder_token(model.eos_token_ids))
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.last_step: dict[str, float | int] = {}
        self.timer = self.clock.now

    def step(self) -> list[RequestOutput]:
        """:meth:`LLMEngine.step`'s four calls (schedule, swap copies, run, update) on the virtual clock.

        Its outputs differ in one way: their ``token_ids`` and ``prompt_token_ids`` are the request's
        own lists, not copies (placeholders, read at once; copying them every step was a third of a
        large simulation's time)."""
        t0 = self.timer()
        out = self.scheduler.schedule()
        self._copy_swapped_blocks(out)
        sampled = self.runner.execute(out)
        touched = self.scheduler.update(out, sampled)
        if self.config.check_invariants:
            self.block_manager.check_invariants()
        outputs, self._pending = self._pending + [_output_of(r) for r in touched], []
        self.last_step = {"seconds": self.timer() - t0, "num_tokens": out.num_tokens,
                          "num_prefill_tokens": out.num_prefill_tokens, "num_decode_tokens": out.num_decode_tokens,
                          "num_preempted": out.num_preempted}
        return outputs


def _output_of(req) -> RequestOutput:
    finished = req.status.finished
    return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids, finished,
                         req.status.value if finished else None, req.num_preemptions, req.num_recomputed_tokens,
                         req.num_prefix_hit_tokens)

