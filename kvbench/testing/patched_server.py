"""The reference server with a patch applied to its engine: how a test puts a fault inside a server
and shows a check failing over HTTP on it.

``python -m kvbench.testing.patched_server --patch MODULE:FUNCTION[=ARG] [reference_engine.serve's flags]``

Every ``LLMEngine`` the server builds is handed to ``FUNCTION(engine)`` (``FUNCTION(engine, ARG)`` with
``=ARG``) before it serves, e.g. ``--patch kvbench.conformance.faults:apply_fault=corrupts_recomputed_output``.
The function is named by import path, as ``--engine module:Class`` names an adapter. The engine steps
on a thread of the server (``--no-engine-process``): a patch made in this process would not reach an
engine spawned in its own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any


def resolve(spec: str) -> Callable[[Any], None]:
    """``MODULE:FUNCTION[=ARG]`` as a one-argument callable; ValueError naming what is wrong."""
    target, _, arg = spec.partition("=")
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"--patch {spec!r}: expected MODULE:FUNCTION[=ARG]")
    function = getattr(importlib.import_module(module_name), function_name, None)
    if not callable(function):
        raise ValueError(f"--patch {spec!r}: {module_name} has no function {function_name}")
    return (lambda engine: function(engine, arg)) if arg else function


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.testing.patched_server", add_help=False)
    parser.add_argument("--patch", required=True)
    args, serve_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        patch = resolve(args.patch)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from reference_engine.engine import LLMEngine
    from reference_engine.serve.command_line import main as serve

    build = LLMEngine.__init__

    def patched_init(self: Any, *a: Any, **k: Any) -> None:
        build(self, *a, **k)
        patch(self)

    LLMEngine.__init__ = patched_init  # type: ignore[method-assign]
    return serve([*serve_argv, "--no-engine-process"])


if __name__ == "__main__":
    raise SystemExit(main())
