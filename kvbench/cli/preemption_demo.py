"""``kvbench demo``: a burst on the tiny model under memory pressure, once per preemption mode (the face of
:mod:`kvbench.demo`)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from kvbench.cli import CLIError


def add_command(subparsers: Any) -> None:
    """Add ``demo`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "demo", help="serve a burst on the tiny model under memory pressure, in both "
        "preemption modes, and print what was preempted and what it cost",
        description="Serve a burst of requests on the built-in tiny model with a KV pool too small "
                    "for them, once per preemption mode (recompute, swap), and print what was "
                    "preempted and what it cost.")
    p.add_argument("--requests", type=int, default=32, help="requests in the burst (default %(default)s)")
    p.add_argument("--blocks", type=int, default=48, help="device KV pool in blocks of 16 tokens "
                   "(default %(default)s; at least 19)")
    p.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.demo import run_demo

    if args.requests < 1 or args.blocks < 19:
        raise CLIError("--requests must be >= 1 and --blocks >= 19 (the largest demo request needs 19 blocks)")
    return run_demo(out, num_requests=args.requests, num_gpu_blocks=args.blocks)
