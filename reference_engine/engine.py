"""LLMEngine: ``step()`` = schedule -> copy swapped blocks -> run the model -> postprocess.

Public API (vLLM's names)::

    engine = LLMEngine(EngineConfig(model=ckpt_dir, num_gpu_blocks_override=64))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step().outputs: ...   # step() also says what it did: .record
    engine.generate(prompts, params) ; engine.abort_request("r1")
    engine.stats()      # gauges (queues, pool sizes and usage), a flat dict
    engine.counters()   # the cumulative counters, a typed snapshot (EngineCounters: the contract's names)
    engine.events       # the latest EngineConfig.max_events events; engine.add_event_sink(fn) sees all

What the engine runs on comes from a parts factory (:class:`EngineParts`): :func:`load_parts` loads the
model and allocates the KV tensors; the simulator (:mod:`reference_engine.sim`) passes one whose
runner prices steps on a virtual clock: ``LLMEngine(config, build_parts=...)``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from reference_engine.block_manager import BlockManager
from reference_engine.config import EngineConfig, GiB
from reference_engine.engine_counters import EngineCounters
from reference_engine.events import EventLog, EventSink
from reference_engine.kernels.backends import BACKENDS, resolve_backend
from reference_engine.kv_cache import KVCache
from reference_engine.model import fuse_elementwise, load_model
from reference_engine.outputs import RequestOutput, StepRecord, StepResult
from reference_engine.policies.admission import make_admission
from reference_engine.policies.preemption_costs import PreemptionCosts
from reference_engine.policies.startup_costs import auto_costs
from reference_engine.request import Request, RequestRejected, RequestStatus
from reference_engine.runner import ModelRunner
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import Scheduler, SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StepRunner(Protocol):
    """Runs (or prices) one scheduled step."""

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Compute ``out.chunks`` into their blocks; the sampled token of every chunk that completes its
        sequence, by request id. A runner that runs a step in several passes also takes ``on_sampled``
        (:meth:`ModelRunner.execute <reference_engine.runner.ModelRunner.execute>`); the engine passes it
        only when its ``on_sampled`` is set."""
        ...


class SwapSpace(Protocol):
    """The KV pools as the engine sees them: batched block copies between device and host."""

    block_bytes: int

    def swap_out(self, mapping: list[tuple[int, int]]) -> int:
        """Copy (device block, host block) pairs to the host; the bytes copied."""
        ...

    def swap_in(self, mapping: list[tuple[int, int]]) -> int:
        """Copy (host block, device block) pairs to the device; the bytes copied."""
        ...


@dataclass
class EngineParts:
    """What an :class:`LLMEngine` runs on, built from its config by a parts factory: :func:`load_parts`
    (the model's weights and KV tensors on ``config.device``), or another (the simulator's
    :func:`reference_engine.sim.sim_engine.priced_parts`: a runner that prices steps on a virtual
    clock). The engine builds the scheduler over ``block_manager`` and drives the rest."""

    config: EngineConfig  # resolved (EngineConfig.resolve) for the model's max_position_embeddings
    model: Any  # its .config: vocab_size and eos_token_ids (what add_request checks and stops on)
    block_manager: BlockManager  # its counters are the engine's one record
    kv_cache: SwapSpace
    runner: StepRunner
    preemption_costs: PreemptionCosts | None = None  # what auto prices victims with (None: the defaults)
    timer: Callable[[], float] = time.perf_counter  # times steps and swap copies
    clock: Callable[[], float] = time.monotonic  # stamps events
    output_of: Callable[[Request], RequestOutput] = RequestOutput.of  # what step() reports of a request
    device: torch.device | None = None
    attention_backend: str = "torch"
    linear_backend: str = "torch"
    elementwise_backend: str = "torch"


def block_manager_for(config: EngineConfig, num_gpu_blocks: int, block_bytes: int) -> BlockManager:
    """The block manager of ``num_gpu_blocks`` device blocks and the host pool ``config`` asks for
    (``num_cpu_blocks_override``, else ``swap_space`` GiB of ``block_bytes`` blocks where the mode may swap,
    else none: recompute never swaps, so it reserves no host memory), with a fresh counter record that the
    pool, block manager, scheduler and engine each count their own facts in."""
    if config.num_cpu_blocks_override is not None:
        num_cpu_blocks = config.num_cpu_blocks_override
    elif config.preemption_mode in ("swap", "auto"):  # auto may swap: it needs the host pool too
        num_cpu_blocks = int(config.swap_space * GiB) // block_bytes
    else:
        num_cpu_blocks = 0
    return BlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size, config.enable_prefix_caching,
                        EngineCounters())


def load_parts(config: EngineConfig) -> EngineParts:
    """The engine's parts for ``config``: the model loaded on ``config.device``, KV pools sized by
    ``num_gpu_blocks_override`` or the device's memory (``gpu_memory_utilization`` on CUDA,
    ``kv_cache_space`` on CPU) and ``swap_space``, the model runner, and auto's measured prices."""
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("EngineConfig.device is 'cuda' but torch.cuda.is_available() is False")
    dtype = _DTYPES[config.dtype]
    model = load_model(config.model, device=str(device), dtype=dtype)
    backends = {setting: resolve_backend(setting, getattr(config, setting), device, dtype) for setting in BACKENDS}
    if backends["linear_backend"] == "onednn":
        from reference_engine.kernels.cpu_linear import pack_linears

        pack_linears(model)
    if backends["elementwise_backend"] == "cpp":
        fuse_elementwise(model)
    mc = model.config
    config = config.resolve(mc.max_position_embeddings)
    block_bytes = mc.num_layers * 2 * config.block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    num_gpu_blocks = config.num_gpu_blocks_override or _device_pool_blocks(config, device, block_bytes)
    block_manager = block_manager_for(config, num_gpu_blocks, block_bytes)
    kv_cache = KVCache(num_gpu_blocks, block_manager.num_cpu_blocks, mc.num_layers, config.block_size, mc.num_kv_heads,
                       mc.head_dim, dtype, device)
    runner = ModelRunner(model, kv_cache, block_manager, device, config.seed, backends["attention_backend"],
                         microbatch_tokens=config.microbatch_tokens)
    costs = None
    if config.preemption_mode == "auto":
        costs = auto_costs(config, mc, kv_cache, runner, block_manager.num_free_gpu_blocks)
    return EngineParts(config, model, block_manager, kv_cache, runner, preemption_costs=costs, device=device,
                       **backends)


def _device_pool_blocks(config: EngineConfig, device: torch.device, block_bytes: int) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free)
        return max(int(budget) // block_bytes, 1)
    return max(int(config.kv_cache_space * GiB) // block_bytes, 1)


class LLMEngine:
    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None, *,
                 build_parts: Callable[[EngineConfig], EngineParts] = load_parts):
        """``event_sink``, if given, is called with every event as it is recorded (see
        :meth:`add_event_sink`). ``build_parts``: what makes the model, KV pools and runner from
        ``config`` (:class:`EngineParts`; the simulator passes its own)."""
        parts = build_parts(config)
        self.config = config = parts.config
        self.device, self.model, self.attention_backend = parts.device, parts.model, parts.attention_backend
        self.linear_backend = parts.linear_backend
        self.elementwise_backend = parts.elementwise_backend
        self.block_manager, self.kv_cache, self.runner = parts.block_manager, parts.kv_cache, parts.runner
        self._counters = parts.block_manager.counters
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy, clock=parts.clock, events=EventLog(config.max_events),
            preemption_costs=parts.preemption_costs, admission=admission_of(config),
            prefill_pacing_tokens=config.prefill_pacing_tokens)
        if event_sink is not None:
            self.add_event_sink(event_sink)
        self._output_of = parts.output_of
        self._pending: list[RequestOutput] = []  # aborted outputs, delivered by the next step()
        self._ids = itertools.count()
        self.timer: Callable[[], float] = parts.timer  # what steps and swap copies are timed with
        # Told, during a step, of the tokens (request id -> token) of each forward pass but the step's last
        # as soon as they are sampled (``microbatch_tokens``), before any request has changed; each is
        # also in the step's outputs. It must not call the engine. An attribute rather than a step()
        # argument, so that whatever wraps step() (faults, observers) passes it on untouched.
        self.on_sampled: Callable[[dict[str, int]], None] | None = None

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
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request, or raise :class:`RequestRejected` (engine untouched) if it can never run.

        ``cache_salt``: the request shares cached prefix blocks only with requests of the same salt."""
        try:
            self._validate(request_id, prompt_token_ids, sampling_params)
        except RequestRejected as e:
            self.scheduler.record_event("rejected", str(request_id), reason=str(e))
            raise
        eos = self.model.config.eos_token_ids[0] if self.model.config.eos_token_ids else None
        req = Request(request_id, list(prompt_token_ids), sampling_params,
                      time.monotonic() if arrival_time is None else arrival_time, priority, eos,
                      cache_salt=cache_salt)
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
        if not _tokens_in_range(prompt, vocab):
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

    def take_aborted(self) -> list[RequestOutput]:
        """The outputs of requests aborted since the last step, which the next ``step()`` would deliver
        first; the caller takes them instead (a step driven from outside: the simulator's fast path)."""
        aborted, self._pending = self._pending, []
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ------------------------------------------------------------------ the step
    def step(self) -> StepResult:
        """Schedule, copy swapped blocks, run, update. Returns the outputs of the requests the step
        touched (aborted ones first) and the step's :class:`~reference_engine.outputs.StepRecord`.
        While it runs, :attr:`on_sampled` (if set) hears of each forward pass's tokens but the last's."""
        t0 = self.timer()
        out = self.scheduler.schedule()
        self.copy_swapped_blocks(out)
        on_sampled = self.on_sampled
        sampled = self.runner.execute(out) if on_sampled is None else self.runner.execute(out, on_sampled)
        touched = self.scheduler.update(out, sampled)
        if self.config.check_invariants:
            self.block_manager.check_invariants()
        outputs, self._pending = self._pending + [self._output_of(r) for r in touched], []
        record = StepRecord(self.timer() - t0, out.num_tokens, out.num_prefill_tokens, out.num_decode_tokens,
                            out.num_preempted)
        return StepResult(outputs, record)

    def copy_swapped_blocks(self, out: SchedulerOutput) -> None:
        """The step's swap copies (``step()``'s second phase, public for steps driven from outside: the
        simulator's fast path). One batched copy per direction; each request's event gets its own blocks
        and bytes, and the seconds of the step's whole copy (``requests`` says how many shared it)."""
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
        """Gauges only, what holds right now: pool sizes, free and cached blocks, queue lengths, the
        pools' usage fractions. What has happened so far is :meth:`counters`."""
        bm, s = self.block_manager, self.scheduler
        gpu_used = bm.num_gpu_blocks - bm.num_free_gpu_blocks
        cpu_used = bm.num_cpu_blocks - bm.num_free_cpu_blocks
        return {
            "num_gpu_blocks": bm.num_gpu_blocks, "num_free_gpu_blocks": bm.num_free_gpu_blocks,
            "num_cpu_blocks": bm.num_cpu_blocks, "num_free_cpu_blocks": bm.num_free_cpu_blocks,
            "num_cached_blocks": len(bm.pool.cached),
            "num_running": len(s.running), "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
            "gpu_cache_usage": gpu_used / bm.num_gpu_blocks,
            "cpu_cache_usage": cpu_used / bm.num_cpu_blocks if bm.num_cpu_blocks else 0.0,
        }


def admission_of(config: EngineConfig):
    """The admission policy ``config`` names (:mod:`reference_engine.policies.admission`)."""
    return make_admission(config.admission_policy, max_num_seqs=config.max_num_seqs,
                          horizon=config.admission_horizon, headroom=config.admission_headroom,
                          budget=config.preemption_budget, max_model_len=config.max_model_len)


def _tokens_in_range(prompt: Sequence[int], vocab: int) -> bool:
    """Every token an int in ``[0, vocab)``. A list of plain ints is checked at C speed (a simulated surge
    holds millions of prompt tokens; checking them one by one was a large share of its time)."""
    if type(prompt) is list and set(map(type, prompt)) == {int}:
        return min(prompt) >= 0 and max(prompt) < vocab
    return all(isinstance(t, int) and 0 <= t < vocab for t in prompt)


__all__ = ["LLMEngine", "RequestRejected", "RequestStatus"]
