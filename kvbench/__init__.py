"""kvbench: conformance checks and storm benchmarks for paged-KV LLM serving engines."""

from __future__ import annotations

__version__ = "0.1.0"
