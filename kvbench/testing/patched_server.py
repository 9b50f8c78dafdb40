"""The reference server with a patch applied to its engine: how a test puts a fault inside a server
and shows a check failing over HTTP on it.

``python -m kvbench.testing.patched_server --patch MODULE:FUNCTION[=ARG] [reference_engine.serve's flags]``

Every ``LLMEngine`` the server builds is handed to ``FUNCTION(engine)`` (``FUNCTION(engine, ARG)`` with
``=ARG``) before it serves, e.g. ``--patch kvbench.conformance.faults:apply_fault=corrupts_recomputed_output``.
The function is named by import path, as ``--engine module:Class`` names an adapter.

That holds wherever the engine is built: on a thread of the server (``--no-engine-process``) and in the
engine's own process (the default), both the engine it starts with and each one a ``POST
/kvbench/reconfigure`` builds (``--allow-reconfigure``). The engine process is started with
multiprocessing's ``spawn``, which imports the server's main module, this one, under the name
``__mp_main__`` before it builds the engine: this module then patches that process's ``LLMEngine`` from
the spec the server left in its environment (:data:`PATCH_ENV`). A reconfigure therefore gives a test a
fresh patched engine in tens of milliseconds instead of a new server's seconds; a patch that reads its
argument at each build (``kvbench.conformance.faults:apply_fault_named_in=FILE``) lets one server serve
one fault after another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

#: the environment variable that carries ``--patch`` into the engine process
PATCH_ENV = "KVBENCH_PATCHED_SERVER_PATCH"


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


def patch_every_engine(patch: Callable[[Any], None]) -> None:
    """Make every ``LLMEngine`` this process builds from now on pass through ``patch`` once built."""
    from reference_engine.engine import LLMEngine

    build = LLMEngine.__init__

    def patched_init(self: Any, *a: Any, **k: Any) -> None:
        build(self, *a, **k)
        patch(self)

    LLMEngine.__init__ = patched_init  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.testing.patched_server", add_help=False)
    parser.add_argument("--patch", required=True)
    args, serve_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        patch = resolve(args.patch)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from reference_engine.serve.command_line import main as serve

    patch_every_engine(patch)  # an engine on a thread of this process (--no-engine-process)
    os.environ[PATCH_ENV] = args.patch  # an engine process spawned from this one (see the module docstring)
    return serve(serve_argv)


if __name__ == "__mp_main__" and os.environ.get(PATCH_ENV):
    # the engine process, importing the server's main module before it builds its engine
    patch_every_engine(resolve(os.environ[PATCH_ENV]))

if __name__ == "__main__":
    raise SystemExit(main())
