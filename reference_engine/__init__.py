"""reference_engine: a small, readable paged-KV Llama engine (swap, recompute, prefix caching,
chunked prefill, priority), the baseline kvbench checks and compares against.

``LLMEngine`` is imported on first use (PEP 562), so what needs only the config, the requests or the
outputs (the HTTP server's process, whose engine runs in a process of its own) does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reference_engine.config import ConfigError, EngineConfig
from reference_engine.events import EngineEvent
from reference_engine.outputs import RequestOutput, StepRecord, StepResult
from reference_engine.request import RequestRejected
from reference_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from reference_engine.engine import LLMEngine

__all__ = ["ConfigError", "EngineConfig", "EngineEvent", "LLMEngine", "RequestOutput", "RequestRejected",
           "SamplingParams", "StepRecord", "StepResult"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from reference_engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'reference_engine' has no attribute {name!r}")
