"""An OpenAI-compatible HTTP server for reference_engine: ``python -m reference_engine.serve --model DIR``.

One module per concept:

* ``cli``: command-line flags, generated from ``EngineConfig``'s fields with ``vllm serve``'s names;
* ``engine_process``: the engine in its own process (the CLI's default), speaking over a pipe: requests
  in, each step's new tokens out, rebuilt into each request's outputs on the server's side;
* ``engine_loop``: the same contract on a thread of the server (``--no-engine-process``, and
  ``build_app(engine)`` for an engine object): batches requests from every connection into its steps
  and hands each request's outputs to an asyncio queue;
* ``protocol``: the request and response bodies (pydantic, unknown fields refused);
* ``detokenize``: token ids in and out of text with the checkpoint's own ``tokenizer.json``;
* ``metrics``: ``/metrics`` in Prometheus text, vLLM's metric names plus ``reference_engine:`` extras;
* ``app``: the FastAPI application (routes, errors, auth, body limit);
* ``front_end_faults``: a testing aid, front ends broken on purpose (the hidden ``--front-end-fault``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reference_engine.serve.app import build_app
    from reference_engine.serve.engine_loop import EngineLoop
    from reference_engine.serve.engine_process import EngineProcess

__all__ = ["EngineLoop", "EngineProcess", "build_app"]

#: imported on first use: the engine process (spawned, it imports ``engine_process`` through this package)
#: then loads neither FastAPI nor uvicorn, and the server's process loads no torch
_WHERE = {"build_app": "app", "EngineLoop": "engine_loop", "EngineProcess": "engine_process"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"reference_engine.serve.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'reference_engine.serve' has no attribute {name!r}")
