"""The capacity-planning simulator: the reference engine's own scheduler and block manager, with a
runner that computes nothing and advances a virtual clock by a step cost model.

Modules: :mod:`~reference_engine.sim.pricing_runner` (the virtual clock, the runner that prices
steps, the KV stand-in), :mod:`~reference_engine.sim.sim_engine` (:class:`SimEngine`: the engine
built from those parts), :mod:`~reference_engine.sim.lazy` (the fast path's lazy decodes),
:mod:`~reference_engine.sim.calibrate` (fitting a profile on this machine). The costs themselves
(model shapes, hardware profiles, the step cost model) live below both engine and simulator, in
:mod:`reference_engine.costs`.

    engine = SimEngine(EngineConfig(model="llama-3-8b", dtype="bfloat16"), load_model_shape("llama-3-8b"),
                       load_profile("h200"))
    engine.add_request("r1", prompt, SamplingParams(max_tokens=128, ignore_eos=True))
    while engine.has_unfinished_requests(): engine.step()
    engine.clock.now()   # simulated seconds
"""

from __future__ import annotations

from reference_engine.sim.pricing_runner import SimKVCache, SimRunner, VirtualClock
from reference_engine.sim.sim_engine import SimEngine, device_pool_blocks

__all__ = ["SimEngine", "SimKVCache", "SimRunner", "VirtualClock", "device_pool_blocks"]
