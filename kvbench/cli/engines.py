"""``kvbench engines``: the engine kinds and the option keys of each (what ``--engine KIND:KEY=VALUE``
accepts); the listing itself is :func:`kvbench.engines.registry.usage`."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError


def add_command(subparsers: Any) -> None:
    """Add ``engines`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "engines", help="list the engine kinds and each kind's option keys",
        description="List every engine kind (kvbench's own and those other packages register in "
                    "the 'kvbench.engines' entry-point group) with its option keys: what --engine "
                    "KIND:KEY=VALUE,... accepts, in pytest and in kvbench simulate.")
    p.add_argument("kind", nargs="?", metavar="KIND", help="only this kind (or MODULE:CLASS)")
    p.set_defaults(handler=_cmd_engines)


def _cmd_engines(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.engines.registry import EngineSpecError, adapter_class, usage

    if args.kind is not None:
        try:
            adapter_class(args.kind)
        except EngineSpecError as e:
            raise CLIError(f"{e}; kvbench engines lists the kinds") from None
    print(usage(args.kind), file=out)
    return EXIT_OK
