"""reference_engine: a small, readable paged-KV Llama engine (swap, recompute, prefix caching,
chunked prefill, priority), the baseline kvbench checks and compares against."""

from __future__ import annotations

from reference_engine.config import ConfigError, EngineConfig
from reference_engine.engine import LLMEngine, RequestRejected
from reference_engine.events import EngineEvent
from reference_engine.outputs import RequestOutput, StepRecord, StepResult
from reference_engine.sampling_params import SamplingParams

__all__ = ["ConfigError", "EngineConfig", "EngineEvent", "LLMEngine", "RequestOutput", "RequestRejected",
           "SamplingParams", "StepRecord", "StepResult"]
