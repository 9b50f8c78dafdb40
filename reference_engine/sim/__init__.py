"""The capacity-planning simulator: the reference engine's own scheduler and block manager, with a
runner that computes nothing and advances a virtual clock by a step cost model.

Modules: :mod:`~reference_engine.sim.models` (model shapes: presets or any ``config.json``),
:mod:`~reference_engine.sim.profiles` (hardware profiles: H200, H100, A100-80GB from public specs, or
a calibrated profile file), :mod:`~reference_engine.sim.cost_model` (step, swap and recompute
costs), :mod:`~reference_engine.sim.runner` (the virtual clock, the runner, the KV stand-in),
:mod:`~reference_engine.sim.engine` (:class:`SimEngine`), :mod:`~reference_engine.sim.calibrate`
(fitting a profile on this machine).

    engine = SimEngine(EngineConfig(model="llama-3-8b", dtype="bfloat16"), load_model_shape("llama-3-8b"),
                       load_profile("h200"))
    engine.add_request("r1", prompt, SamplingParams(max_tokens=128, ignore_eos=True))
    while engine.has_unfinished_requests(): engine.step()
    engine.clock.now()   # simulated seconds
"""

from __future__ import annotations

from reference_engine.sim.cost_model import CostModel, Crossover, StepShape
from reference_engine.sim.engine import SimEngine, device_pool_blocks
from reference_engine.sim.models import PRESETS, ModelShape, load_model_shape
from reference_engine.sim.profiles import PROFILES, Coefficients, HardwareProfile, load_profile
from reference_engine.sim.runner import SimKVCache, SimRunner, VirtualClock

__all__ = ["PRESETS", "PROFILES", "Coefficients", "CostModel", "Crossover", "HardwareProfile", "ModelShape",
           "SimEngine", "SimKVCache", "SimRunner", "StepShape", "VirtualClock", "device_pool_blocks",
           "load_model_shape", "load_profile"]
