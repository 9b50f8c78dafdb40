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
* ``app``: the FastAPI application (routes, errors, auth, body limit).
"""

from __future__ import annotations

from reference_engine.serve.app import build_app
from reference_engine.serve.engine_loop import EngineLoop
from reference_engine.serve.engine_process import EngineProcess

__all__ = ["EngineLoop", "EngineProcess", "build_app"]
