"""LLMEngine: ``step()`` = schedule -> copy swapped blocks -> run the model -> postprocess.

Public API (vLLM's names)::

    engine = LLMEngine(EngineConfig(model=ckpt_dir, num_gpu_blocks_override=64))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step().outputs: ...   # step() also says what it did: .record
    engine.generate(prompts, params) ; engine.abort_request("r1")
    engine.stats()      # gauges + cumulative counters, a flat dict (kvbench and /metrics read it)
    engine.counters()   # the cumulative counters as a typed snapshot (EngineCounters)
    engine.events       # the latest EngineConfig.max_events events; engine.add_event_sink(fn) sees all
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import torch

from reference_engine.admission import make_admission
from reference_engine.block_manager import BlockManager
from reference_engine.config import EngineConfig, GiB
from reference_engine.counters import EngineCounters
from reference_engine.events import EventLog, EventSink
from reference_engine.kv_cache import KVCache
from reference_engine.model import load_model
from reference_engine.outputs import RequestOutput, StepRecord, StepResult
from reference_engine.request import Request, RequestStatus
from reference_engine.runner import ModelRunner
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import DEFAULT_COSTS, ScheduledChunk, Scheduler, SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RequestRejected(ValueError):
    """``add_request`` refused a request; the engine and every other request are untouched."""


class LLMEngine:
    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None):
        """``event_sink``, if given, is called with every event as it is recorded (see
        :meth:`add_event_sink`)."""
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("EngineConfig.device is 'cuda' but torch.cuda.is_available() is False")
        dtype = _DTYPES[config.dtype]
        self.model = load_model(config.model, device=str(self.device), dtype=dtype)
        mc = self.model.config
        self.config = config = config.resolve(mc.max_position_embeddings)
        block_bytes = mc.num_layers * 2 * config.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
        num_gpu_blocks = config.num_gpu_blocks_override or self._device_pool_blocks(block_bytes)
        if config.num_cpu_blocks_override is not None:
            num_cpu_blocks = config.num_cpu_blocks_override
        elif config.preemption_mode in ("swap", "auto"):
            num_cpu_blocks = int(config.swap_space * GiB) // block_bytes
        else:
            num_cpu_blocks = 0  # recompute never swaps: reserve no host memory
        # One record for the whole engine: the pool, block manager, scheduler and engine each count
        # their own facts in it.
        self._counters = EngineCounters()
        self.block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size,
                                          config.enable_prefix_caching, self._counters)
        self.kv_cache = KVCache(num_gpu_blocks, num_cpu_blocks, mc.num_layers, config.block_size, mc.num_kv_heads,
                                mc.head_dim, dtype, self.device)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy, events=EventLog(config.max_events),
            admission=admission_of(config), prefill_pacing_tokens=config.prefill_pacing_tokens)
        if event_sink is not None:
            self.add_event_sink(event_sink)
        self.attention_backend = _attention_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device, config.seed,
                                  self.attention_backend)
        if config.preemption_mode == "auto":
            self.scheduler.preemption_costs = preemption_costs_of(self)
        self._pending: list[RequestOutput] = []  # aborted outputs, delivered by the next step()
        self._ids = itertools.count()
        # What steps and swap copies are timed with (the simulator, reference_engine.sim, puts its
        # virtual clock here).
        self.timer: Callable[[], float] = time.perf_counter

    def _device_pool_blocks(self, block_bytes: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.gpu_memory_utilization - (total - free)
            return max(int(budget) // block_bytes, 1)
        return max(int(self.config.kv_cache_space * GiB) // block_bytes, 1)

    # ------------------------------------------------------------------ requests
    @property
    def events(self) -> EventLog:
        """The latest ``config.max_events`` events, oldest first (list-like: len, iteration, indexing,
        slicing). Older ones are dropped: to see every event, add a sink."""
        return self.scheduler.events

    def add_event_sink(self, sink: EventSink) -> None:
        """Call ``sink(event)`` with every event from now on, as it is recorded, whatever
        ``max_events`` retains. It runs inside ``step()`` and ``add_request()``: keep it quick, never raise."""
        self.scheduler.events.add_sink(sink)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request, or raise :class:`RequestRejected` (engine untouched) if it can never run."""
        try:
            self._validate(request_id, prompt_token_ids, sampling_params)
        except RequestRejected as e:
            self.scheduler.record_event("rejected", str(request_id), reason=str(e))
            raise
        eos = self.model.config.eos_token_ids[0] if self.model.config.eos_token_ids else None
        req = Request(request_id, list(prompt_token_ids), sampling_params,
                      time.monotonic() if arrival_time is None else arrival_time, priority, eos)
        self.scheduler.add(req)

    def _validate(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected(f"request id {request_id!r} is invalid: expected a non-empty string")
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"request {request_id!r}: sampling_params must be a SamplingParams")
        if request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        n = len(prompt)
        max_len = self.config.max_model_len
        if n == 0:
            raise RequestRejected(f"request {request_id!r}: the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise RequestRejected(f"request {request_id!r}: prompt token ids must be integers in [0, {vocab})")
        if n >= max_len:
            raise RequestRejected(f"request {request_id!r}: prompt of {n} tokens does not fit max_model_len="
                                  f"{max_len} (it must leave room for at least one output token)")
        # The last sampled token is never fed back, so a full-length request holds this many tokens of KV.
        kv_tokens = min(n + params.max_tokens, max_len) - 1
        needed = self.block_manager.blocks_needed(kv_tokens)
        if needed > self.block_manager.num_gpu_blocks:
            raise RequestRejected(
                f"request {request_id!r} needs {needed} KV blocks ({n} prompt + up to {params.max_tokens} output "
                f"tokens, block_size={self.config.block_size}) but the whole device pool has "
                f"{self.block_manager.num_gpu_blocks}: it could never run, even alone")

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state, freeing its blocks. Returns False if it is unknown or finished."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._pending.append(RequestOutput.of(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ------------------------------------------------------------------ the step
    def _output_of(self, request: Request) -> RequestOutput:
        """What ``step`` reports of a request it touched (a snapshot: its own lists copied)."""
        return RequestOutput.of(request)

    def step(self) -> StepResult:
        """Schedule, copy swapped blocks, run, update. Returns the outputs of the requests the step
        touched (aborted ones first) and the step's :class:`~reference_engine.outputs.StepRecord`."""
        t0 = self.timer()
        out = self.scheduler.schedule()
        self._copy_swapped_blocks(out)
        sampled = self.runner.execute(out)
        touched = self.scheduler.update(out, sampled)
        if self.config.check_invariants:
            self.block_manager.check_invariants()
        outputs, self._pending = self._pending + [self._output_of(r) for r in touched], []
        record = StepRecord(self.timer() - t0, out.num_tokens, out.num_prefill_tokens, out.num_decode_tokens,
                            out.num_preempted)
        return StepResult(outputs, record)

    def _copy_swapped_blocks(self, out: SchedulerOutput) -> None:
        """One batched copy per direction; each request's event gets its own blocks and bytes, and the
        seconds of the step's whole copy (``requests`` says how many shared it)."""
        # Swap-outs first: their freed device blocks may be rewritten by this very step.
        for kind, per_request in (("swapped_out", out.swap_out_blocks), ("swapped_in", out.swap_in_blocks)):
            if not per_request:
                continue
            t0 = self.timer()
            copy = self.kv_cache.swap_out if kind == "swapped_out" else self.kv_cache.swap_in
            nbytes = copy([pair for pairs in per_request.values() for pair in pairs])
            seconds = self.timer() - t0
            if kind == "swapped_out":
                self._counters.swapped_out_bytes += nbytes
            else:
                self._counters.swapped_in_bytes += nbytes
            self._counters.swap_seconds += seconds
            for rid, pairs in per_request.items():
                self.scheduler.record_event(kind, rid, blocks=len(pairs), bytes=len(pairs) * self.kv_cache.block_bytes,
                                            seconds=seconds, requests=len(per_request))

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run all prompts to completion (all added before the first step); outputs in prompt order."""
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for o in self.step().outputs:
                if o.finished:
                    final[o.request_id] = o
        return [final[rid] for rid in ids]

    # ------------------------------------------------------------------ observability
    def counters(self) -> EngineCounters:
        """A snapshot of the cumulative counters (later steps do not change it)."""
        return self._counters.snapshot()

    def stats(self) -> dict[str, float | int]:
        """Gauges (queues, pool usage) and the cumulative counters under their ``stats()`` names
        (vLLM's metric names where it has one; :class:`EngineCounters` documents each counter)."""
        bm, s, c = self.block_manager, self.scheduler, self._counters
        gpu_used = bm.num_gpu_blocks - bm.num_free_gpu_blocks
        cpu_used = bm.num_cpu_blocks - bm.num_free_cpu_blocks
        return {
            "num_gpu_blocks": bm.num_gpu_blocks, "num_free_gpu_blocks": bm.num_free_gpu_blocks,
            "num_cpu_blocks": bm.num_cpu_blocks, "num_free_cpu_blocks": bm.num_free_cpu_blocks,
            "num_cached_blocks": len(bm.pool.cached),
            "num_running": len(s.running), "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
            "gpu_cache_usage": gpu_used / bm.num_gpu_blocks,
            "cpu_cache_usage": cpu_used / bm.num_cpu_blocks if bm.num_cpu_blocks else 0.0,
            "num_preemptions": c.preemptions,
            "num_preemptions_recompute": c.preemptions_recompute, "num_preemptions_swap": c.preemptions_swap,
            "num_swap_fallbacks": c.swap_fallbacks, "num_swap_outs": c.swap_outs, "num_swap_ins": c.swap_ins,
            "swapped_out_bytes": c.swapped_out_bytes, "swapped_in_bytes": c.swapped_in_bytes,
            "swap_seconds": c.swap_seconds,
            "prefix_cache_queries": c.prefix_cache_queries, "prefix_cache_hits": c.prefix_cache_hits,
            "num_prefill_chunks": c.prefill_chunks, "num_computed_tokens": c.computed_tokens,
            "num_recomputed_tokens": c.recomputed_tokens, "num_generated_tokens": c.generated_tokens,
            "num_evicted_blocks": c.evicted_blocks, "num_steps": c.steps,
        }


def admission_of(config: EngineConfig):
    """The admission policy ``config`` names (:mod:`reference_engine.admission`)."""
    return make_admission(config.admission_policy, max_num_seqs=config.max_num_seqs,
                          horizon=config.admission_horizon, headroom=config.admission_headroom,
                          budget=config.preemption_budget, max_model_len=config.max_model_len)


#: costs measured by :func:`preemption_costs_of`, per (model, dtype, device, block size): measured once
#: per process, so that engines built again for the same model (a benchmark's repeats, a conformance
#: check's runs) make the same choices; a fresh measurement per engine moved victims near the
#: crossover from one mode to the other between repeats on a loaded machine
_MEASURED_COSTS: dict[tuple, object] = {}


def preemption_costs_of(engine: LLMEngine):
    """What ``preemption_mode="auto"`` prices victims with: the step cost model on
    ``config.cost_profile`` when one is given, else swap and prefill costs measured on this engine's
    own KV cache and model (:func:`reference_engine.preemption_policy.measure_linear_costs`), once per
    process and model (:data:`_MEASURED_COSTS`)."""
    from reference_engine.preemption_policy import ModelCosts, measure_linear_costs

    config, kv = engine.config, engine.kv_cache
    if config.cost_profile is not None:
        from reference_engine.costs.cost_model import CostModel
        from reference_engine.costs.model_shapes import ModelShape
        from reference_engine.costs.profiles import load_profile

        mc = engine.model.config
        shape = ModelShape("engine-model", mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads,
                           mc.intermediate_size, mc.vocab_size, mc.max_position_embeddings, mc.head_dim,
                           bool(getattr(mc, "tie_word_embeddings", False)))
        return ModelCosts(CostModel(shape, load_profile(config.cost_profile), config.dtype), config.block_size)
    num_blocks = min(8, kv.device_cache.shape[0], kv.host_cache.shape[0])

    def copy_blocks(n: int) -> None:
        # The swap-out path itself, index building included. Safe at start-up: it reads device blocks
        # nobody holds and writes host blocks that are only ever read after a later swap-out wrote them.
        kv.swap_out([(i, i) for i in range(n)])

    def prefill(n: int) -> None:
        # a prefill of n tokens alone, through the runner, into blocks borrowed and given back at once
        # (the pool is empty at start-up: nothing is overwritten)
        probe = Request("__auto_cost_probe__", [0] * n, SamplingParams(max_tokens=1), 0.0)
        if not engine.block_manager.allocate_slots(probe, n):
            raise RuntimeError("no room")
        try:
            chunk = ScheduledChunk(probe, 0, n, True)
            engine.runner.execute(SchedulerOutput(step=0, chunks=(chunk,),
                                                  block_ids={probe.request_id: tuple(engine.block_manager.blocks_of(
                                                      probe.request_id))}))
        finally:
            engine.block_manager.forget(probe.request_id)

    long = min(128, config.max_model_len - 1, engine.block_manager.num_free_gpu_blocks * config.block_size)
    if long < 8 or num_blocks < 2:  # too small a pool to measure in: the documented defaults
        return DEFAULT_COSTS
    key = (config.model, config.dtype, config.device, config.block_size)
    if key not in _MEASURED_COSTS:
        _MEASURED_COSTS[key] = measure_linear_costs(copy_blocks, prefill, time.perf_counter, blocks=num_blocks,
                                                    short=max(long // 4, 1), long=long)
    return _MEASURED_COSTS[key]


def _attention_backend(choice: str, device: torch.device) -> str:
    """"torch", "sliced" or "triton" for this device ("auto": torch off CUDA). Triton is imported only
    when it could be used, so CPU engines (and every ``import reference_engine``) do not pay for it."""
    if choice in ("torch", "sliced"):
        return choice
    if choice == "auto" and device.type != "cuda":
        return "torch"
    from reference_engine.triton_attention import resolve_attention_backend

    return resolve_attention_backend(choice, device)


__all__ = ["LLMEngine", "RequestRejected", "RequestStatus"]
