"""What a step, a swap and a recompute cost, below both the engine and the simulator.

:mod:`~reference_engine.costs.model_shapes` (model shapes: presets or any ``config.json``),
:mod:`~reference_engine.costs.profiles` (hardware profiles: H200, H100, A100-80GB from public specs,
or a calibrated profile file), :mod:`~reference_engine.costs.cost_model` (step, swap and recompute
costs from a shape on a profile). Plain numbers only: nothing here imports the engine, the
simulator or torch.
"""

from __future__ import annotations

from reference_engine.costs.cost_model import CostModel, Crossover, StepShape
from reference_engine.costs.model_shapes import PRESETS, ModelShape, load_model_shape
from reference_engine.costs.profiles import PROFILES, Coefficients, FrontEndCosts, HardwareProfile, load_profile

__all__ = ["PRESETS", "PROFILES", "Coefficients", "CostModel", "Crossover", "FrontEndCosts", "HardwareProfile",
           "ModelShape", "StepShape", "load_model_shape", "load_profile"]
