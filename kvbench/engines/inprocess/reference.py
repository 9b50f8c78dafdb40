"""The ``reference`` adapter: reference_engine in-process, white box.

Every ``EngineConfig`` field is an option (``reference:preemption_mode=swap,enable_prefix_caching=true``);
a check's :class:`~kvbench.engines.base.Knobs` override options, since that is how checks force
pressure. Counters come from ``LLMEngine.counters()``, whose fields carry the contract's names
(:func:`counters_of`), per-step records from the engine's queues and events, and the block manager is
exposed to the stateful refcount machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.core.counters import COUNTER_NAMES, Counters
from kvbench.core.engine_events import EventRecord
from kvbench.core.liveness import Watchdog
from kvbench.core.trace import StepRecord, TraceRecorder
from kvbench.drivers.step_loop import StepReport, drive
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter, GenOutput, GenRequest, GenResult, Knobs, WorkloadRequest

# Knobs field -> EngineConfig field
_KNOB_TO_CONFIG = {
    "block_size": "block_size", "num_gpu_blocks": "num_gpu_blocks_override",
    "num_cpu_blocks": "num_cpu_blocks_override", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
    "enable_chunked_prefill": "enable_chunked_prefill", "enable_prefix_caching": "enable_prefix_caching",
    "preemption_mode": "preemption_mode", "scheduling_policy": "scheduling_policy",
    "admission_policy": "admission_policy", "admission_headroom": "admission_headroom",
    "prefill_pacing_tokens": "prefill_pacing_tokens",
}


@functools.cache
def _config_types() -> dict[str, Any]:
    """Every ``EngineConfig`` field but ``model`` -> its resolved type (``int``, ``int | None``, ``str``...)."""
    from reference_engine import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def coerce_option(name: str, raw: str) -> Any:
    """Turn an option string into the EngineConfig field's type ("true" -> True, "64" -> 64, "none" -> None)."""
    from reference_engine import ConfigError

    declared = _config_types()[name]
    union = typing.get_origin(declared) in (typing.Union, types.UnionType)
    members = typing.get_args(declared) if union else (declared,)
    if raw.lower() in ("none", "null") and type(None) in members:
        return None
    kind = next(m for m in members if m is not type(None))
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if kind is int or kind is float:
            return kind(raw)
    except ValueError:
        shown = " | ".join("None" if m is type(None) else m.__name__ for m in members)
        raise ConfigError(name, raw, f"a value of type {shown}") from None
    return raw


#: the one option that is the adapter's, not ``EngineConfig``'s (see :meth:`ReferenceAdapter.step_delay`)
STEP_DELAY_OPTION = "step_delay_ms"


class ReferenceAdapter(EngineAdapter):
    """reference_engine in-process (white box: events, counters, block introspection)."""

    kind = "reference"
    capabilities = frozenset({"recompute", "swap", "prefix_caching", "chunked_prefill", "priority",
                              "block_introspection", "events", "sampling", "abort", "stop_token_ids",
                              "auto_preemption", "admission_control"})
    #: kvbench steps this engine itself, so ``serve`` can run on the step clock (deterministic counts)
    steppable = True
    option_keys = {  # noqa: RUF012
        "block_size": "KV block size in tokens (power of two, 1-128)",
        "num_gpu_blocks_override": "device KV pool size in blocks",
        "num_cpu_blocks_override": "host (swap) pool size in blocks",
        "swap_space": "host swap pool in GiB (default 4)",
        "kv_cache_space": "device KV pool in GiB on CPU when no block override (default 0.5)",
        "gpu_memory_utilization": "share of GPU memory for weights + KV on CUDA (default 0.9)",
        "max_num_seqs": "most requests running at once (default 256)",
        "max_num_batched_tokens": "token budget per step",
        "max_model_len": "longest sequence (default: the model's)",
        "enable_chunked_prefill": "true/false",
        "enable_prefix_caching": "true/false",
        "preemption_mode": "recompute, swap or auto (per victim, by cost)",
        "cost_profile": "hardware profile (JSON file or built-in name) auto prices victims with; default: measured",
        "admission_policy": "none, watermark (projected KV use), aimd (concurrency cap driven by preemptions) or "
                        "full_prompt (the whole sequence must fit: vLLM V1's admission)",
        "admission_headroom": "watermark: share of the pool kept free of projected use (default 0.05)",
        "admission_horizon": "watermark: steps of output growth projected (default 64)",
        "preemption_budget": "aimd: preemptions allowed per 100 steps before the cap halves (default 1)",
        "prefill_pacing_tokens": "prefill tokens a step computes beside decodes (unchunked: a longer prompt only "
                                 "as the step's one prefill); default none (no cap)",
        "microbatch_tokens": "a step of more tokens runs as forward passes of about this many (the server streams "
                             "each pass's tokens at once); 0: one pass; default 512 on CPU, 0 on CUDA",
        "scheduling_policy": "fcfs or priority",
        "seed": "engine seed for unseeded sampling",
        "device": "cpu, cuda or cuda:N",
        "dtype": "float32, float16 or bfloat16",
        "check_invariants": "run the block manager self-check after every step (slow)",
        "max_events": "events the engine keeps in its bounded log (default 10000; kvbench reads them through a sink)",
        "attention_backend": "decode attention: auto (triton on CUDA; on CPU cpp, or sliced where it cannot be "
                             "built), torch, sliced, cpp or triton",
        "linear_backend": "matmuls: auto (onednn on CPU where it runs), torch, or onednn (weights packed once into "
                          "oneDNN's layout)",
        "elementwise_backend": "RMSNorm and SwiGLU: auto (cpp on CPU in float32 and bfloat16 where it builds), torch, "
                               "or cpp (one fused C++ pass per layer)",
        STEP_DELAY_OPTION: "testing aid, not an engine setting: sleep this many milliseconds after every engine step "
                           "(a deliberate, known slowdown for checking that the regression gate catches one)",
    }

    knob_options = _KNOB_TO_CONFIG

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        """Every option checked by ``EngineConfig`` itself (its ``__post_init__``), on a placeholder model
        path, so nothing is loaded. Checks that need the model (``max_model_len`` against its positions,
        the token budget against ``max_model_len``) run when an engine is built."""
        super().validate_options(options)
        from reference_engine import EngineConfig

        cls._step_delay_of(options)
        EngineConfig(model="<model checked when the engine is built>",
                     **{k: coerce_option(k, v) for k, v in options.items() if k != STEP_DELAY_OPTION})

    def compute_dtype(self) -> str:
        """``EngineConfig.dtype``: the ``dtype`` option, float32 by default."""
        return self.options.get("dtype", "float32")

    def sampling_scores(self, request: GenRequest, index: int, logits: Any) -> Any:
        """The scores whose argmax the engine's sampler picks as ``request``'s ``index``-th output token, given
        the logits (``[vocab]``) that predicted it: ``log_softmax(logits / T) - log(q)``, ``q`` the token's seeded
        exponential draws (torch's one-sample multinomial is that race, ``argmax(p / q)``; tested against the
        engine). A temperature-sampled pick is then a greedy pick over these scores, and two runs' picks can
        differ only where they are nearly tied, as for greedy decoding, in logits / T. None for a greedy
        request or where top-k/top-p shape the distribution (not modelled)."""
        import torch

        from reference_engine.request import Request
        from reference_engine.sampler import request_seed, token_generator

        if request.temperature <= 0 or request.top_k > 0 or request.top_p < 1.0:
            return None
        req = Request(request.request_id, list(request.prompt_token_ids), sampling_params_of(request), 0.0)
        generator = token_generator(request_seed(req, self.engine_config().seed), index, logits.device)
        draws = torch.empty_like(logits, dtype=torch.float32).exponential_(1, generator=generator)
        scaled = (logits.float() - logits.float().max()) / request.temperature
        return torch.log_softmax(scaled, dim=-1) - draws.log()

    @staticmethod
    def _step_delay_of(options: dict[str, str]) -> float:
        """``step_delay_ms`` in seconds (0 when absent); ValueError naming the option for a bad value."""
        raw = options.get(STEP_DELAY_OPTION, "0")
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and 0 <= ms <= 10_000):
            raise ValueError(f"engine 'reference': option {STEP_DELAY_OPTION}={raw!r} must be a number of "
                             "milliseconds from 0 to 10000")
        return ms / 1000.0

    @property
    def step_delay(self) -> float:
        """Seconds slept after every engine step when served (``step_delay_ms``; 0 by default).

        A testing aid: a slowdown of known size that changes no count (on the step clock the schedule
        is the same), so ``scripts/gate_selfcheck.sh`` can check that the gate catches a time
        regression and names it. It is not an engine setting and never applies to ``generate``. A
        sleep lasts at least this long: on a loaded machine a short one costs more, since the thread
        then waits for a core again (docs/journal/measurements.md#a-short-step-delay)."""
        return self._step_delay_of(self.options)

    def engine_config(self, knobs: Knobs = DEFAULT_KNOBS):
        """The EngineConfig for these options with the knobs applied over them."""
        from reference_engine import EngineConfig

        values: dict[str, Any] = {k: coerce_option(k, v) for k, v in self.options.items() if k != STEP_DELAY_OPTION}
        for knob, value in knobs.as_dict().items():
            values[_KNOB_TO_CONFIG[knob]] = value
        return EngineConfig(model=self.model_dir, **values)

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        """What the engine's own configuration resolves ``knobs`` to, as it resolves them when it is built
        (``EngineConfig.resolve``: the token budget and ``max_model_len`` filled in from the model): the engine's
        settings, not kvbench's request. A pool the engine sizes from memory (no ``num_gpu_blocks`` set) is left
        out: only the built engine knows it. {} when the configuration cannot be resolved."""
        try:
            positions = json.loads((Path(self.model_dir) / "config.json").read_text())["max_position_embeddings"]
            config = self.engine_config(self.knobs_for(knobs)).resolve(int(positions))
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        said = {knob: getattr(config, field) for knob, field in _KNOB_TO_CONFIG.items()}
        return {knob: value for knob, value in said.items() if value is not None}

    def build_engine(self, knobs: Knobs = DEFAULT_KNOBS):
        """A fresh LLMEngine for these options and knobs."""
        from reference_engine import LLMEngine

        return LLMEngine(self.engine_config(knobs))

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """All requests added, then steps until none is left, under the no-progress watchdog
        (:attr:`liveness`: :class:`~kvbench.core.liveness.LivenessError` names the stuck requests)."""
        from reference_engine import RequestRejected

        engine = self.build_engine(knobs)
        events = _EventCollector(engine)
        rejected: dict[str, str] = {}
        for r in requests:
            try:
                engine.add_request(r.request_id, r.prompt_token_ids, sampling_params_of(r), priority=r.priority)
            except RequestRejected as e:  # the others are still served
                rejected[r.request_id] = str(e)
        final = {}
        watchdog = Watchdog(self.liveness)
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.finished:
                    final[out.request_id] = out
            watchdog.observe(_work_done(engine), _request_states(engine))
        outputs = []
        for r in requests:
            if r.request_id in rejected:
                outputs.append(GenOutput(r.request_id, [], "rejected", 0, rejected[r.request_id]))
            else:
                out = final[r.request_id]
                outputs.append(GenOutput(r.request_id, out.token_ids, out.finish_reason, out.num_preemptions,
                                         cached_tokens=out.num_cached_tokens))
        return GenResult(outputs, counters_of(engine), _evidence(engine), events=events.records)

    def block_manager_factory(self):
        """Fresh block managers for the stateful refcount machine (conformance check 5)."""
        from kvbench.engines.inprocess.reference_blocks import reference_block_manager

        return reference_block_manager()

    def swap_round_trip(self, requests: Sequence[GenRequest], knobs: Knobs) -> tuple[int, list[str]]:
        """Run ``requests`` under ``knobs`` while comparing every swapped block's bytes when it comes
        back with what it held when it left. Returns (blocks compared, mismatch descriptions)."""
        import torch

        engine = self.build_engine(knobs)
        kv = engine.kv_cache
        left: dict[int, Any] = {}
        compared, mismatches = 0, []
        swap_out, swap_in = kv.swap_out, kv.swap_in

        def checked_out(mapping):
            for device_block, host_block in mapping:
                left[host_block] = kv.read_blocks([device_block])
            return swap_out(mapping)

        def checked_in(mapping):
            nonlocal compared
            nbytes = swap_in(mapping)
            for host_block, device_block in mapping:
                compared += 1
                if not torch.equal(kv.read_blocks([device_block]), left.pop(host_block)):
                    mismatches.append(f"host block {host_block} -> device block {device_block} changed in transit")
            return nbytes

        kv.swap_out, kv.swap_in = checked_out, checked_in
        for r in requests:
            engine.add_request(r.request_id, r.prompt_token_ids, sampling_params_of(r))
        while engine.has_unfinished_requests():
            engine.step()
        return compared, mismatches

    def serve(self, workload: Any, recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS, progress=None,
              step_seconds: float | None = None) -> None:
        """Serve ``workload`` on a fresh engine; ``step_seconds`` puts arrivals and aborts on the step
        clock (:func:`kvbench.drivers.step_loop.drive`), None on the wall clock."""
        engine = self.build_engine(knobs)
        requests = getattr(workload, "requests", workload)
        drive(_Steppable(engine, self.step_delay), requests, recorder,
              concurrency=getattr(workload, "concurrency", None), progress=progress,
              step_seconds=step_seconds, liveness=self.liveness)
        recorder.set_counters(counters_of(engine))


def counters_of(engine) -> Counters:
    """The engine's counters as the contract's record: every ``engine.counters()`` field that is a
    contract counter, copied by name (``EngineCounters`` uses the contract's names; its extra fields,
    ``steps`` and ``evicted_blocks``, are not in the contract). Pool sizes and ``leaked_blocks``
    (device + host blocks still held) come from the gauges of ``engine.stats()``."""
    record, stats = engine.counters(), engine.stats()
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name in COUNTER_NAMES}
    values["leaked_blocks"] = (stats["num_gpu_blocks"] - stats["num_free_gpu_blocks"]
                               + stats["num_cpu_blocks"] - stats["num_free_cpu_blocks"])
    values["num_gpu_blocks"] = stats["num_gpu_blocks"]
    values["num_cpu_blocks"] = stats["num_cpu_blocks"]
    return Counters.from_dict(values)


def sampling_params_of(request: GenRequest | WorkloadRequest):
    """The reference engine's SamplingParams for a request: a GenRequest's sampling fields; a
    WorkloadRequest has only temperature and seed, and always runs to ``max_tokens`` (no EOS, no stop)."""
    from reference_engine import SamplingParams

    return SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                          top_k=getattr(request, "top_k", 0), top_p=getattr(request, "top_p", 1.0), seed=request.seed,
                          ignore_eos=getattr(request, "ignore_eos", True),
                          stop_token_ids=tuple(getattr(request, "stop_token_ids", ())))


def _work_done(engine) -> int:
    """Tokens computed plus tokens sampled so far: grows with every step that did anything."""
    counters = engine.counters()
    return counters.computed_tokens + counters.generated_tokens


def _request_states(engine) -> dict[str, str]:
    """Every unfinished request's state, in words the watchdog's error shows."""
    return {rid: f"{r.status.value}, {r.num_computed_tokens}/{r.num_tokens} tokens computed, "
                 f"{len(r.output_token_ids)}/{r.sampling_params.max_tokens} generated"
            for rid, r in engine.scheduler.requests.items()}


# engine event kind -> the data keys of kvbench.core.engine_events it carries
_EVENT_KEYS = {"admitted": ("cached_tokens", "resumed", "kv_usage", "num_running"),
               "preempted": ("mode", "wanted", "tokens_discarded"),
               "swapped_out": ("bytes",), "swapped_in": ("bytes",), "finished": ("reason",), "aborted": ("state",)}


class _EventCollector:
    """Every engine event of one run as :class:`~kvbench.core.engine_events.EventRecord` s, taken from an
    event sink as it is recorded (the engine's own log is bounded). A ``preempted`` record also gets
    ``running``: the requests running when the victim was chosen, in admission order (the scheduler
    has already taken the victim off its running list when it records the event, so it is put back
    by its admission number)."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[EventRecord] | None = None
        add_sink = getattr(engine.events, "add_sink", None)
        if callable(add_sink):
            self.records = []
            add_sink(self._take)

    def _take(self, event) -> None:
        keys = _EVENT_KEYS.get(event.kind)
        if keys is None:
            return
        data = {k: event.data[k] for k in keys if k in event.data}
        if event.kind == "preempted":
            scheduler = self.engine.scheduler
            victim = scheduler.requests.get(event.request_id)
            running = list(scheduler.running) + ([victim] if victim is not None else [])
            data["running"] = tuple(r.request_id for r in sorted(running, key=lambda r: r.admitted_seq))
        self.records.append(EventRecord(event.kind, event.request_id, event.step, data))


def _evidence(engine, limit: int = 20) -> list[str]:
    interesting = [e for e in engine.events if e.kind in ("preempted", "swap_fallback", "swapped_in", "prefix_hit")]
    return [f"step {e.step}: {e.kind} {e.request_id} {e.data}" for e in interesting[:limit]]


def step_changes(events: Sequence[Any]) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """A step's engine events as the driver's :class:`~kvbench.drivers.step_loop.StepReport` lists: (admitted,
    preempted with its mode, resumed: re-admitted after a recompute preemption, or swapped back in)."""
    admitted, preempted, resumed = [], [], []
    for e in events:
        if e.kind == "admitted":
            (resumed if e.data.get("resumed") else admitted).append(e.request_id)
        elif e.kind == "preempted":
            preempted.append((e.request_id, e.data["mode"]))
        elif e.kind == "swapped_in":
            resumed.append(e.request_id)
    return admitted, preempted, resumed


class _Steppable:
    """reference_engine seen through the driver's SteppableEngine protocol."""

    def __init__(self, engine, step_delay: float = 0.0):
        self.engine = engine
        self.step_delay = step_delay  # seconds slept after each step (the step_delay_ms testing aid)
        # Events arrive through a sink: the engine's own log is bounded, so reading it by position would
        # miss events once it is full.
        self._new_events: list[Any] = []
        engine.add_event_sink(self._new_events.append)
        self._produced: dict[str, int] = {}

    def submit(self, request: Any) -> None:
        self.engine.add_request(request.request_id, request.prompt_token_ids, sampling_params_of(request),
                                priority=request.priority)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> StepReport:
        result = self.engine.step()
        if self.step_delay:
            time.sleep(self.step_delay)
        new_tokens, finished, outputs = {}, {}, {}
        for out in result.outputs:
            n = len(out.token_ids) - self._produced.get(out.request_id, 0)
            if n:
                new_tokens[out.request_id] = n
            self._produced[out.request_id] = len(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
                outputs[out.request_id] = list(out.token_ids)
                self._produced.pop(out.request_id, None)
        admitted, preempted, resumed = step_changes(self._new_events)
        self._new_events.clear()
        stats, last = self.engine.stats(), result.record
        record = StepRecord(t=0.0, duration=0.0, num_running=stats["num_running"], num_waiting=stats["num_waiting"],
                            num_swapped=stats["num_swapped"], kv_usage=stats["gpu_cache_usage"],
                            cpu_kv_usage=stats["cpu_cache_usage"] if stats["num_cpu_blocks"] else None,
                            num_prefill_tokens=last.num_prefill_tokens, num_decode_tokens=last.num_decode_tokens,
                            num_preempted=last.num_preempted)
        return StepReport(new_tokens, finished, admitted, preempted, resumed, record, outputs)
