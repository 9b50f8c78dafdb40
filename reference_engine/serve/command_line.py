"""``python -m reference_engine.serve --model DIR [flags]``.

Every ``EngineConfig`` field is a flag named as ``vllm serve`` names it (``--block-size``,
``--num-gpu-blocks-override``, ``--preemption-mode``, ``--enable-prefix-caching`` /
``--no-enable-prefix-caching``, ...): the flags are generated from the dataclass, so a new field is a new
flag, and each flag's help is the field's entry in ``reference_engine.config.FIELD_DOCS``. Values are
checked by ``EngineConfig`` itself, and a bad one exits with status 2 and its ``ConfigError`` message,
which names the field. Server flags: ``--host`` (default 127.0.0.1: binding
every interface is a choice to make explicitly), ``--port`` (0 = a free port, printed), ``--api-key``,
``--served-model-name``, ``--max-body-bytes``, ``--access-log``, ``--engine-process`` (default on: the
engine steps in its own process; ``--no-engine-process`` keeps it on a thread of the server),
``--engine-threads`` (the engine process's torch threads; default ``$OMP_NUM_THREADS`` where set, else every
core but one, which the HTTP process keeps: :func:`~reference_engine.serve.engine_process.default_engine_threads`),
``--bind-cpus`` (default on), ``--engine-malloc`` (the engine process's allocator: TCMalloc where the system
has it, :mod:`~reference_engine.serve.allocator`), ``--output-poll-us`` (how often the HTTP process looks for
outputs while requests stream: :data:`~reference_engine.serve.engine_process.OUTPUT_POLL_S`),
``--allow-reconfigure`` (off by default; a testing and benchmarking aid: ``POST /kvbench/reconfigure`` with
``{"args": [engine flags]}`` replaces the idle engine with one built from those flags in the same engine
process, checked by this same parser: :func:`reconfigure_args`).

Once the engine is loaded and the socket listens, one line is printed to stdout::

    reference_engine.serve: listening on http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reference_engine.config import FIELD_DOCS, ConfigError, EngineConfig
from reference_engine.serve.allocator import CHOICES as ALLOCATOR_CHOICES
from reference_engine.serve.allocator import AllocatorMissing, engine_preload
from reference_engine.serve.protocol import DEFAULT_MAX_BODY_BYTES, BadEngineArgs

READY_PREFIX = "reference_engine.serve: listening on "
_SCALARS = {"int": int, "float": float, "str": str}


def _flag_type(annotation: str) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a field annotation such as ``"int | None"`` (annotations are strings
    under ``from __future__ import annotations``)."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    if parts == ["bool"]:
        return None, True
    if len(parts) != 1 or parts[0] not in _SCALARS:
        raise TypeError(f"EngineConfig field of type {annotation!r} has no flag type: extend _SCALARS")
    return _SCALARS[parts[0]], False


def _metavar(name: str, kind: Any) -> str:
    """``DIR`` for the model, else the value's type: what the flag takes, its meaning being in the help."""
    return "DIR" if name == "model" else {int: "N", float: "X", str: "NAME"}[kind]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m reference_engine.serve",
        description="OpenAI-compatible server (/v1/completions, /v1/models, /health, /metrics) for reference_engine.")
    engine = parser.add_argument_group("engine", "EngineConfig fields, named as vllm serve names them")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind, is_bool = _flag_type(str(f.type))
        default = None if f.default is dataclasses.MISSING else f.default
        shown = "required" if f.name == "model" else f"default: {'unset' if default is None else default}"
        help_text = f"{FIELD_DOCS[f.name]} ({shown})".replace("%", "%%")  # argparse formats help with %
        if is_bool:
            engine.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            engine.add_argument(flag, dest=f.name, type=kind, default=default, required=f.name == "model",
                                metavar=_metavar(f.name, kind), help=help_text)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                        help="interface to bind (default: 127.0.0.1, local only)")
    server.add_argument("--port", type=int, default=8000, metavar="N",
                        help="TCP port (default: 8000; 0 = any free port)")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    server.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model name in the API (default: --model)")
    server.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help=f"largest request body accepted (default: {DEFAULT_MAX_BODY_BYTES})")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                        help="log every request (default: off)")
    server.add_argument("--coalesce-stream", action=argparse.BooleanOptionalAction, default=True,
                        help="a stream that fell behind sends the tokens queued for it in one event (default); "
                             "--no-coalesce-stream: one event per engine step")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine in its own process, so HTTP work and engine steps do not share "
                             "one GIL (default: on; --no-engine-process steps it on a thread of the server)")
    server.add_argument("--engine-threads", type=int, default=None, metavar="N",
                        help="torch threads of the engine process (default: $OMP_NUM_THREADS if set, else every "
                             "core but one, left to the HTTP process)")
    server.add_argument("--bind-cpus", action=argparse.BooleanOptionalAction, default=True,
                        help="bind the engine process to as many cores as it has threads and the HTTP process to "
                             "the others, as vLLM's CPU build binds its worker (default: on, where a core is left "
                             "over; --no-bind-cpus lets the OS place both)")
    server.add_argument("--engine-malloc", choices=ALLOCATOR_CHOICES, default="auto",
                        help="the engine process's memory allocator: auto (default) preloads TCMalloc where the "
                             "system has it (libtcmalloc-minimal4), as vLLM's CPU docs ask for vLLM, else the "
                             "system's; tcmalloc demands it; system preloads nothing. Needs --engine-process")
    server.add_argument("--output-poll-us", type=int, default=None, metavar="US",
                        help="while requests are in flight, the HTTP process looks for the engine's outputs every "
                             "US microseconds instead of sleeping until the engine wakes it: the engine's step "
                             "then never pays for waking another core (default: 200; 0: always sleep and be "
                             "woken). Needs --engine-process")
    server.add_argument("--allow-reconfigure", action="store_true", default=False,
                        help="a testing and benchmarking aid: POST /kvbench/reconfigure {\"args\": [engine flags]} "
                             "replaces the idle engine with one built from those flags, in the same engine process "
                             "(409 while requests are in flight; 400 naming a bad flag, the old engine serving on). "
                             "Needs --engine-process (default: off)")
    # a testing aid, left out of --help: a front end broken on purpose (reference_engine.serve.front_end_faults)
    server.add_argument("--front-end-fault", default=None, metavar="NAME", help=argparse.SUPPRESS)
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_ARGPARSE_FLAG = re.compile(r"argument (--[\w-]+)|arguments: (--[\w-]+)")


def reconfigure_args(launched: argparse.Namespace) -> Callable[[list[str]], EngineConfig]:
    """``parse(args)``: the ``EngineConfig`` that engine flags ``args`` describe, for a server started with
    ``launched`` (its port the one it listens on). Flags not given take their defaults, ``--model`` the
    server's own; a server flag given must have the value the server runs with. Raises
    :class:`BadEngineArgs` naming the flag: argparse's own message for a bad value or an unknown flag,
    the ``ConfigError`` for a value ``EngineConfig`` refuses."""
    def parse(args: list[str]) -> EngineConfig:
        parser = build_parser()
        parser.exit_on_error = False
        server_dests = [a.dest for a in parser._actions if a.dest not in _ENGINE_FIELDS and a.dest != "help"]
        parser.set_defaults(**{dest: getattr(launched, dest) for dest in server_dests})

        def refuse(message: str) -> None:
            named = _ARGPARSE_FLAG.search(message)
            raise BadEngineArgs(next(g for g in named.groups() if g) if named else "args", message)

        parser.error = refuse  # type: ignore[method-assign]
        if any(a in ("-h", "--help") for a in args):
            raise BadEngineArgs("--help", "--help is not an engine flag")
        try:
            given = parser.parse_args(["--model", launched.model, *args])
        except argparse.ArgumentError as e:
            raise BadEngineArgs(e.argument_name or "args", f"argument {e.argument_name}: {e.message}") from None
        if given.model != launched.model:
            raise BadEngineArgs("--model", f"--model {given.model!r}: this server serves {launched.model!r}, and a "
                                           "running server cannot change its model (start another server)")
        for dest in server_dests:
            asked, running = getattr(given, dest), getattr(launched, dest)
            if asked != running:
                raise BadEngineArgs(_flag(dest), f"{_flag(dest)}={asked!r} is a server flag: this server runs with "
                                                 f"{running!r}, and only a new server can change it")
        try:
            return engine_config(given)
        except ConfigError as e:
            raise BadEngineArgs(_flag(e.field), f"{_flag(e.field)}: {e}") from None

    return parse


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags describe; raises ``ConfigError`` naming a bad field."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


class _CannotStart(Exception):
    """The engine could not be built; the message is the CLI's error line."""


def _start_engine(config: EngineConfig, *, in_own_process: bool, threads: int | None = None,
                  while_loading: Callable[[], Any] | None = None, bind_cpus: bool = False,
                  output_poll_us: int | None = None, preload: Path | None = None):
    """An ``EngineProcess`` or an ``LLMEngine`` for ``config``; raises :class:`_CannotStart` with the
    engine's ``ConfigError`` message (which names the field) or why the model could not be loaded.
    ``while_loading()`` runs while the engine process imports torch and loads the model."""
    def load_error(detail: str) -> _CannotStart:
        return _CannotStart(f"--model {config.model!r} could not be loaded: {detail}")

    if in_own_process:
        from reference_engine.serve.engine_process import (
            OUTPUT_POLL_S,
            EngineProcess,
            EngineStartError,
            default_engine_threads,
        )

        poll_s = OUTPUT_POLL_S if output_poll_us is None else output_poll_us / 1e6
        try:
            return EngineProcess.spawn(config, threads=threads or default_engine_threads(),
                                       while_loading=while_loading, bind_cpus=bind_cpus, output_poll_s=poll_s,
                                       preload=preload)
        except EngineStartError as e:
            raise (_CannotStart(str(e)) if e.kind == "config" else load_error(str(e))) from None
    from reference_engine.engine import LLMEngine

    try:
        return LLMEngine(config)
    except ConfigError as e:  # fields that relate to the model (max_model_len, budgets) are checked here
        raise _CannotStart(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise load_error(f"{type(e).__name__}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port={args.port} is invalid: expected 0..65535")
    if args.engine_threads is not None and args.engine_threads < 1:
        parser.error(f"--engine-threads={args.engine_threads} is invalid: expected an integer >= 1")
    if args.output_poll_us is not None and args.output_poll_us < 0:
        parser.error(f"--output-poll-us={args.output_poll_us} is invalid: expected an integer >= 0")
    if args.output_poll_us is not None and not args.engine_process:
        parser.error("--output-poll-us needs the engine in its own process (drop --no-engine-process)")
    if args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes={args.max_body_bytes} is invalid: expected an integer >= 1")
    if args.engine_malloc == "tcmalloc" and not args.engine_process:
        parser.error("--engine-malloc=tcmalloc needs the engine in its own process (drop --no-engine-process)")
    try:
        preload = engine_preload(args.engine_malloc) if args.engine_process else None
    except AllocatorMissing as e:
        parser.error(str(e))
    if args.allow_reconfigure and not args.engine_process:
        parser.error("--allow-reconfigure needs the engine in its own process (drop --no-engine-process)")
    try:
        config = engine_config(args)
    except ConfigError as e:
        parser.error(str(e))
    if args.front_end_fault is not None:
        from reference_engine.serve.front_end_faults import apply_front_end_fault

        try:
            apply_front_end_fault(args.front_end_fault)
        except ValueError as e:
            parser.error(str(e))

    def import_http_stack() -> None:  # only a running server needs it; imported while the engine loads
        import uvicorn  # noqa: F401

        import reference_engine.serve.app  # noqa: F401

    try:
        engine = _start_engine(config, in_own_process=args.engine_process, threads=args.engine_threads,
                               while_loading=import_http_stack, bind_cpus=args.bind_cpus,
                               output_poll_us=args.output_poll_us, preload=preload)
    except _CannotStart as e:
        parser.error(str(e))
    import_http_stack()  # imported already unless the engine runs on a thread of this process
    import uvicorn

    from reference_engine.serve.app import build_app
    info = getattr(engine, "info", None)
    if info is not None:  # an engine process: say what it steps on (a thread count decides its speed)
        print(f"reference_engine.serve: engine process steps on {info.torch_threads} torch threads, "
              f"allocator {info.allocator}", file=sys.stderr, flush=True)

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        parser.error(f"--host {args.host} --port {args.port}: cannot bind: {e}")
    sock.listen(2048)  # listening now: connections made before uvicorn starts wait in the backlog
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host

    def ready() -> None:
        print(f"{READY_PREFIX}http://{shown_host}:{port}", flush=True)

    args.port = port  # what a reconfigure's --port is compared with (--port 0 picked this one)
    app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, on_ready=ready,
                    reconfigure=reconfigure_args(args) if args.allow_reconfigure else None,
                    coalesce_stream=args.coalesce_stream)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # loop/http "auto": uvloop and httptools (dependencies) when importable, else asyncio and h11. Every
    # streamed token is an event-loop send, and the loop shares the GIL with the engine thread, so the
    # cheaper loop and HTTP writer leave more of it to the steps.
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=args.access_log, loop="auto",
                                           http="auto", timeout_graceful_shutdown=5, lifespan="on", backlog=2048))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
