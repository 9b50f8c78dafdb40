"""The ``kvbench`` command: results files (report, gate, merge, read), engines served and measured, the simulator.

    kvbench report RESULTS.json [--baseline B.json] [-o OUT.html] [--force]
    kvbench compare BASELINE.json CURRENT.json [--threshold EXPR ...] [--gate-absolute] [--noise-k K] [--html OUT]
    kvbench merge RESULTS.json ... -o MERGED.json [--report DIR] [--force]
    kvbench engines [KIND]
    kvbench demo [--requests N] [--blocks N]
    kvbench calibrate [--model DIR] [-o PROFILE.json] [design flags]
    kvbench simulate [--engine SPEC] [--workload NAME] [--requests N] [--sweep KNOB=V,V,...] [--report DIR]
    kvbench head-to-head --engine [LABEL=]SPEC ... [--model NAME] [--dtype D] [--knob ENGINE:KEY=VALUE] [--json OUT]
    kvbench ratios RESULTS.json [--baseline ENGINE] [--engine ENGINE] [--at-least RATIO]
    kvbench conformance RESULTS.json [--footnotes]
    kvbench results-page RESULTS.json ... [-o PAGE.md]
    kvbench validate-sim [--scenario NAME ...] [--repeats N] [--warmup N] [--profile-out FILE] [--out DIR]
    kvbench predict [--engines reference,vllm] [--rounds N] [--json OUT] [--small]
    kvbench admission-sweep [--surge NAME] [--scale quick|full] [--repeats N] [--engine SPEC] HEADROOM:PACING ...
    kvbench measure-gpu [--out DIR] [--dry-run] [size flags]

``report`` re-renders the HTML report of a results file (by default over the report.html beside it, which
was rendered from the same file); ``compare`` gates one run against another; ``merge`` joins the
results.json of shards or runs made on several machines (these three read results files only:
:mod:`kvbench.cli.results_files`); ``engines`` lists the engine kinds and the option keys of each (what
``--engine KIND:KEY=VALUE`` accepts: :mod:`kvbench.cli.engines`); ``demo`` serves a burst on the tiny model
in both preemption modes (:mod:`kvbench.cli.preemption_demo`); ``calibrate`` fits the simulator's cost
model on this machine and ``simulate`` serves a workload at scale on the simulator and prints a capacity
plan (:mod:`kvbench.cli.simulator`); ``head-to-head`` serves several engines on the same work, rounds
interleaved; ``ratios`` compares two engines at every point of a saved sweep; ``conformance`` prints a
run's verdicts as a Markdown table; ``results-page`` writes docs/results.md from results files (these three
read results files only); ``validate-sim`` and ``predict`` check the simulator against the reference engine
and against real engines; ``admission-sweep`` serves one surge under admission settings against static
admission; ``measure-gpu`` measures the reference engine's CUDA paths against the memory-bandwidth roofline.
Each command lives in a module of this package (:data:`COMMAND_MODULES`); this module holds only what they
share: :class:`CLIError`, the exit statuses, :func:`load_results`, :func:`writable_folder`,
:func:`build_parser` and :func:`main`.

Three groups: results files (``report``, ``compare``, ``merge``, ``ratios``, ``conformance``,
``results-page`` read what a run wrote and re-run nothing); engines (``engines`` lists the kinds; ``demo``,
``head-to-head``, ``admission-sweep``, ``measure-gpu`` build and serve them); the simulator (``calibrate``,
``simulate``, ``validate-sim``, ``predict``).

Exit status: 0 success; 1 the command's check failed (``compare``: a regression or a baseline result missing
from the current run; each command's ``--help`` says what its check is, and each failure is named); 2 usage or
file errors (message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from kvbench import __version__
from kvbench.bench.results import Results, ResultsError

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2

#: the modules of this package that each add commands, in the order ``kvbench --help`` lists them: each has
#: ``add_command(subparsers)``, which adds its parser(s) with a ``handler`` default (``handler(args, out) ->
#: exit status``, raising :class:`CLIError` for a usage or file problem)
COMMAND_MODULES: tuple[str, ...] = ("results_files", "engines", "preemption_demo", "simulator", "head_to_head",
                                   "ratios", "conformance", "results_page", "validate_sim", "predict",
                                   "admission_sweep", "measure_gpu")

#: what a command's parser sets as its ``handler`` default
Handler = Callable[[argparse.Namespace, TextIO], int]


class CLIError(Exception):
    """A usage or file problem: reported on stderr, exit status 2."""


def load_results(path: str, what: str) -> Results:
    """The results file at ``path``; CLIError naming it as ``what`` ("results file", "baseline file") and the
    reason when it is missing, unreadable or not a results file."""
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"{what} {path!r} does not exist or is not a file")
    try:
        return Results.load(p)
    except ResultsError as e:
        raise CLIError(str(e)) from e
    except OSError as e:
        raise CLIError(f"cannot read {what} {path!r}: {e}") from e


def int_list(flag: str, text: str) -> tuple[int, ...]:
    """``"32,192,512"`` (empty items skipped) as integers; :class:`CLIError` naming ``flag`` otherwise. Ranges
    are the caller's to check, with the field's own words."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None


def writable_folder(flag: str, text: str) -> Path:
    """``text`` as a folder that exists (created if need be) and can be written; CLIError naming ``flag``
    and the reason otherwise. Commands call it before minutes of work, not after."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"{flag} {text!r}: cannot create the folder: {e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {text!r}: the folder is not writable")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbench`` parser: every command of :data:`COMMAND_MODULES`, in that order."""
    parser = argparse.ArgumentParser(
        prog="kvbench",
        description="kvbench's command line, three groups. Results files (read only, nothing re-runs an "
                    "engine): report, compare, merge, ratios, conformance, results-page. Engines (listed, then "
                    "served here): engines, demo, head-to-head, admission-sweep, measure-gpu. The simulator: "
                    "calibrate, simulate, validate-sim, predict. The conformance checks and the benchmarks run "
                    "under pytest (pytest suites/ [--benchmark] [--engine SPEC ...]).",
        epilog="Exit status: 0 success; 1 the command's check failed (see kvbench COMMAND --help); 2 a usage or "
               "file error.")
    parser.add_argument("--version", action="version", version=f"kvbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvbench.cli.{name}").add_command(sub)
    return parser


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """The commands ``parser`` (from :func:`build_parser`) accepts, in the order ``--help`` lists them."""
    # argparse keeps its subparsers only on a private list; this is the one place that reads it
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to ``sys.exit``)."""
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2, message printed)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_usage(sys.stderr)
        print(f"kvbench: error: a command is required ({', '.join(command_names(parser))})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args, out)
    except CLIError as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
