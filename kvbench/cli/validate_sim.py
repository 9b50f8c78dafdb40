"""``kvbench validate-sim``: the simulator against the reference engine, leave-one-out (the face of
:mod:`kvbench.sim.validation`; docs/simulator.md#validation-against-the-engine)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, EXIT_REGRESSION, CLIError, writable_folder

#: the exit status when a count differs: the simulator did not schedule as the engine did
EXIT_COUNTS_DIFFER = EXIT_REGRESSION


def add_command(subparsers: Any) -> None:
    """Add ``validate-sim`` to the ``kvbench`` command's subparsers."""
    p = subparsers.add_parser(
        "validate-sim", help="the simulator against the reference engine on this machine: each quick scenario "
        "measured, then simulated with a cost model fitted on the others",
        description="Serve each quick scenario on the reference engine (step clock, rounds interleaved), fit the "
                    "simulator's cost model to the intervals between served steps leaving the scenario out, "
                    "simulate the scenario (sim, clock=step) with that fit, and print measured (the median of the "
                    "rounds [min-max]) against simulated output throughput, p50/p99 TTFT and p99 TBT per result, "
                    "with the error beside the rounds' spread, and whether every count (preemptions by mode, "
                    "recomputed tokens) is equal.",
        epilog="Exit status: 0 every count equal; 1 a count differs; 2 a usage or file error.")
    p.add_argument("--scenario", action="append", metavar="NAME",
                   help="repeatable: only these scenarios (default: all; with one, it is fitted on itself)")
    p.add_argument("--repeats", type=int, default=2, help="measured rounds (default %(default)s: gives the spread)")
    p.add_argument("--warmup", type=int, default=1, help="rounds served first and thrown away (default "
                   "%(default)s: a process's first round ran up to 2x slower, torch and the allocator warming up)")
    p.add_argument("--profile-out", metavar="PROFILE.json", help="also save the profile fitted on every scenario")
    p.add_argument("--out", metavar="DIR", help="also write DIR/results.json and DIR/report.html (its 'Simulator "
                   "vs measured' section); created if need be, files overwritten")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """``kvbench validate-sim``: validate, print the comparison, write what ``--out`` asks for."""
    from kvbench.sim.validation import check_scenarios, validate

    if args.repeats < 1 or args.warmup < 0:
        raise CLIError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    try:
        names = check_scenarios(args.scenario or [])
    except ValueError as e:
        raise CLIError(f"--scenario: {e}") from None
    out_dir = writable_folder("--out", args.out) if args.out else None  # before minutes of serving
    if args.profile_out and not Path(args.profile_out).parent.is_dir():
        raise CLIError(f"--profile-out {args.profile_out!r}: the folder {str(Path(args.profile_out).parent)!r} "
                       "does not exist")
    import torch

    from kvbench.models.builtin import builtin_checkpoint

    torch.set_num_threads(1)  # the engine as the benchmarks serve it on this machine

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    found = validate(str(builtin_checkpoint("tiny")), names, args.repeats, args.warmup,
                     keep_results=out_dir is not None, profile_out=args.profile_out, say=say)
    print(found.text(), file=out)
    if out_dir is not None and found.results is not None:
        from kvbench.report.render import write_report  # jinja2 and charts load only when needed

        try:
            report = write_report(found.results, out_dir)
        except OSError as e:
            raise CLIError(f"cannot write the results and report into --out {args.out!r}: {e}") from e
        print(f"results and report (section 'Simulator vs measured') written to {report}", file=out)
    return EXIT_OK if found.counts_equal else EXIT_COUNTS_DIFFER
