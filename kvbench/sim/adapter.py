"""The ``sim`` adapter: the reference engine's scheduler and block manager on a cost model's clock.

``--engine sim:hardware=h200,model=llama-3-8b`` plans capacity for a machine and a model kvbench has
never run on: :class:`reference_engine.sim.SimEngine` is the reference engine with a runner that
computes nothing and moves a virtual clock on by the step cost model. Every scenario, the report,
``kvbench compare`` and the gate run on it unchanged, and every time in its traces is *simulated*
seconds (``describe()["simulated"]`` is True; the report tags it).

Options: ``hardware`` (a built-in profile: h200, h100, a100-80gb; or a profile file from ``kvbench
calibrate``; default: h200), ``model`` (a preset: llama-3-8b, llama-2-7b, llama-3-70b; or a
``config.json`` or model directory; default: the checkpoint kvbench runs on), ``clock`` (``cost``:
arrivals released on the simulated clock, the default; ``step``: released by engine step like the
reference engine on the step clock, so its counts equal the reference engine's on the same workload),
``front_end`` (``on``, the default: serve through the profile's front end if it has one,
:mod:`kvbench.sim.front_end`; ``off``: clients see the engine's steps directly), and every
``EngineConfig`` field the reference adapter takes, except the device's.

It cannot check correctness (its tokens are placeholders): conformance checks skip it (``simulated``).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any

from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.core.liveness import Liveness
from kvbench.core.trace import StepRecord, TraceRecorder
from kvbench.drivers.step_loop import StepReport, drive
from kvbench.engines.inprocess.reference import (
    _KNOB_TO_CONFIG,
    STEP_DELAY_OPTION,
    ReferenceAdapter,
    _Steppable,
    coerce_option,
    counters_of,
    step_changes,
)

#: why conformance checks skip a simulated engine
SIMULATED_REASON = "simulated: no real tokens"
_SIM_KEYS = ("hardware", "model", "clock", "fast", "front_end")
# no device: these mean nothing here; the step delay is a testing aid of real engine steps
_DEVICE_KEYS = ("device", "attention_backend", "linear_backend", "elementwise_backend", "kv_cache_space",
                STEP_DELAY_OPTION)
CLOCKS = ("cost", "step")


class SimAdapter(ReferenceAdapter):
    """the simulator: reference_engine's scheduler on a cost model's virtual clock (no real tokens)"""

    kind = "sim"
    #: conformance checks skip it with :data:`SIMULATED_REASON`
    simulated = True
    # Placeholder tokens: no sampling, no stop tokens, no block bytes to compare (block introspection
    # would test the very block manager the reference engine's checks already test).
    capabilities = frozenset({"recompute", "swap", "prefix_caching", "chunked_prefill", "priority", "events",
                              "abort", "auto_preemption", "admission_control"})  # the reference scheduler's own
    steppable = True
    option_keys = {  # noqa: RUF012
        "hardware": "h200, h100, a100-80gb, or a profile JSON from `kvbench calibrate` (default h200)",
        "model": "llama-3-8b, llama-2-7b, llama-3-70b, or a config.json / model dir (default: the run's checkpoint)",
        "clock": "cost (release arrivals on the simulated clock, default) or step (by engine step, as the "
                 "reference engine's step clock: equal counts)",
        "front_end": "on (default: deliver through the profile's front_end, when it has one) or off",
        "fast": "true (default): steady decoders advance lazily (same decisions, far less work); false: every "
                "request through the plain step",
        **{k: v for k, v in ReferenceAdapter.option_keys.items() if k not in _DEVICE_KEYS},
        "dtype": "float32, float16 or bfloat16 (default: the hardware profile's)",
        "gpu_memory_utilization": "share of the device memory for weights + KV (default 0.9)",
    }

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        """The profile and model load, ``clock`` is known, and every engine option passes ``EngineConfig``."""
        super(ReferenceAdapter, cls).validate_options(options)  # keys only; the engine's own check below
        from reference_engine.costs import load_model_shape, load_profile

        load_profile(options.get("hardware", "h200"))
        if "model" in options:
            load_model_shape(options["model"])
        if options.get("clock", "cost") not in CLOCKS:
            raise ValueError(f"engine 'sim': clock={options['clock']!r} is invalid: expected one of {CLOCKS}")
        if options.get("fast", "true").lower() not in ("true", "false"):
            raise ValueError(f"engine 'sim': fast={options['fast']!r} is invalid: expected true or false")
        if options.get("front_end", "on").lower() not in ("on", "off"):
            raise ValueError(f"engine 'sim': front_end={options['front_end']!r} is invalid: expected on or off")
        ReferenceAdapter.validate_options({k: v for k, v in options.items() if k not in _SIM_KEYS})

    @cached_property
    def profile(self):
        from reference_engine.costs import load_profile

        return load_profile(self.options.get("hardware", "h200"))

    @cached_property
    def model_shape(self):
        from reference_engine.costs import load_model_shape

        return load_model_shape(self.options.get("model", self.model_dir))

    def engine_config(self, knobs: Knobs = DEFAULT_KNOBS):
        """The reference engine's config for these options and knobs, at the profile's dtype unless given."""
        from reference_engine import EngineConfig

        values: dict[str, Any] = {k: coerce_option(k, v) for k, v in self.options.items() if k not in _SIM_KEYS}
        values.setdefault("dtype", self.profile.dtype)
        for knob, value in knobs.as_dict().items():
            values[_KNOB_TO_CONFIG[knob]] = value
        return EngineConfig(model=self.model_shape.name, **values)

    def build_engine(self, knobs: Knobs = DEFAULT_KNOBS):
        from reference_engine.sim import SimEngine

        return SimEngine(self.engine_config(knobs), self.model_shape, self.profile)

    @property
    def front_end(self):
        """The profile's :class:`~reference_engine.costs.FrontEndCosts` unless ``front_end=off``; None: no front end."""
        if self.options.get("front_end", "on").lower() == "off":
            return None
        return self.profile.front_end

    def describe(self) -> dict[str, Any]:
        front = self.front_end
        return {**super().describe(), "hardware": self.profile.name,
                "front_end": None if front is None else dataclasses.asdict(front),
                "hardware_source": self.profile.source, "calibrated": self.profile.fit is not None,
                "model": self.model_shape.name, "clock": self.options.get("clock", "cost")}

    def serve(self, workload: Any, recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS, progress=None,
              step_seconds: float | None = None) -> None:
        """Serve ``workload`` in simulated time: every time in the trace is read from the engine's
        virtual clock. Arrivals are released on that clock (``clock=cost``), or before the step
        ``floor(arrival / step_seconds)`` (``clock=step``, when the runner passes ``step_seconds``)."""
        engine = self.build_engine(knobs)
        requests = getattr(workload, "requests", workload)
        by_step = step_seconds if self.options.get("clock", "cost") == "step" else None
        if self.front_end is not None:  # the client's view through a serving front end, every step a plain one
            from kvbench.sim.front_end import serve_through_front_end

            if by_step is not None:
                raise ValueError("engine 'sim': clock=step cannot run through a front end (it prices time, the step "
                                 "clock counts steps): use clock=cost, or front_end=off")
            serve_through_front_end(_SimSteppable(engine), engine.clock, requests, recorder, self.front_end,
                                    getattr(workload, "concurrency", None), progress)
            recorder.set_counters(counters_of(engine))
            return
        fast = self.options.get("fast", "true").lower() == "true"
        liveness = fast_path_liveness(self.liveness, engine) if fast else self.liveness
        drive(_SimSteppable(engine, recorder if fast else None), requests, recorder,
              concurrency=getattr(workload, "concurrency", None),
              progress=progress, step_seconds=by_step, liveness=liveness, virtual_clock=engine.clock)
        recorder.set_counters(counters_of(engine))


def fast_path_liveness(liveness: Liveness, engine: Any) -> Liveness:
    """The watchdog's limits for a run on :meth:`SimEngine.step_fast`: a lazy decoder's tokens reach the
    driver when its span closes, at the latest when it finishes (a state change), up to
    ``max_model_len`` steps later; ``stall_steps`` counts from there."""
    if liveness.stall_steps is None:
        return liveness
    return dataclasses.replace(liveness, stall_steps=liveness.stall_steps + engine.config.max_model_len)


class _SimSteppable(_Steppable):  # submit and has_work as the reference engine's
    """The sim engine seen through the driver's SteppableEngine protocol, built for long runs: events
    arrive through a sink (the engine's log keeps only the latest ``max_events``, and re-reading it
    each step cost time), and per-step work is proportional to what the step touched.

    With a ``recorder`` it steps with :meth:`SimEngine.step_fast`: the tokens of lazy decoders come
    back as spans of steps, and go straight into the trace here, at the end times of those steps
    (the driver records everything else, as for any engine)."""

    def __init__(self, engine, recorder: TraceRecorder | None = None):  # not super(): its own event sink
        self.engine = engine
        self.recorder = recorder
        self._events: list = []
        self._produced: dict[str, int] = {}
        self._step_end: list[float] = [0.0] * (engine.scheduler.step_index + 1)  # [k]: when step k ended
        engine.add_event_sink(self._take)

    def _record_spans(self, spans) -> None:
        ends, requests = self._step_end, self.recorder.trace.requests
        for span in spans:
            requests[span.request_id].token_times.extend(ends[span.first:span.last + 1])

    def _take(self, event) -> None:
        if event.kind in ("admitted", "preempted", "swapped_in"):
            self._events.append(event)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        if self.recorder is not None:
            spans, self.engine.lazy.closed = self.engine.lazy.closed, []
            self._record_spans(spans)

    def step(self) -> StepReport:
        if self.recorder is not None:
            done = self.engine.step_fast()
            self._step_end.append(self.recorder.now())
            assert len(self._step_end) == self.engine.scheduler.step_index + 1, "one step per call"
            self._record_spans(done.spans)
            return self._report(dict.fromkeys(done.tokens, 1), done.finished, done.record)
        result = self.engine.step()
        new_tokens, finished = {}, {}
        produced = self._produced
        for out in result.outputs:
            rid = out.request_id
            n = len(out.token_ids) - produced.get(rid, 0)
            if n:
                new_tokens[rid] = n
            if out.finished:
                finished[rid] = out.finish_reason
                produced.pop(rid, None)
            else:
                produced[rid] = len(out.token_ids)
        return self._report(new_tokens, finished, result.record)

    def _report(self, new_tokens: dict[str, int], finished: dict[str, str | None], last) -> StepReport:
        """``last``: the engine's record of the step (:class:`reference_engine.outputs.StepRecord`)."""
        admitted, preempted, resumed = step_changes(self._events)
        self._events.clear()
        bm, s = self.engine.block_manager, self.engine.scheduler
        cpu = (1 - bm.num_free_cpu_blocks / bm.num_cpu_blocks) if bm.num_cpu_blocks else None
        record = StepRecord(t=0.0, duration=0.0, num_running=len(s.running), num_waiting=len(s.waiting),
                            num_swapped=len(s.swapped), kv_usage=1 - bm.num_free_gpu_blocks / bm.num_gpu_blocks,
                            cpu_kv_usage=cpu,
                            num_prefill_tokens=last.num_prefill_tokens, num_decode_tokens=last.num_decode_tokens,
                            num_preempted=last.num_preempted)
        return StepReport(new_tokens, finished, admitted, preempted, resumed, record)
