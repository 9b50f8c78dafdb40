"""``kvbench conformance``: a run's conformance verdicts as a Markdown table.

The command's face only; the table is :mod:`kvbench.report.conformance_table`'s. Nothing is re-run.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError, load_results
from kvbench.report.conformance_table import conformance_table


def _cmd_conformance(args: argparse.Namespace, out: TextIO) -> int:
    results = load_results(args.results, "results file")
    try:
        table = conformance_table(results.conformance, footnotes=args.footnotes)
    except ValueError as e:
        raise CLIError(f"{args.results}: {e}") from e
    print(table, file=out)
    return EXIT_OK


def add_command(subparsers: Any) -> None:
    """Add ``kvbench conformance`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "conformance", help="a run's conformance verdicts as a Markdown table (check x engine)",
        description="Print the conformance verdicts of RESULTS.json as a Markdown table: one row per check, one "
                    "column per engine. A cell is the verdict (passed, FAILED, expected failure, skipped) and, for "
                    "anything but a pass, the reason the record gives (the skip's reason, the pinned cause, the "
                    "failure's first line). Reads the results file only.",
        epilog="Exit status: 0; 2 a usage or file error, or a results file without conformance records.")
    p.add_argument("results", metavar="RESULTS.json", help="a results file written by pytest suites/conformance")
    p.add_argument("--footnotes", action="store_true", help="reasons as numbered notes under the table, so that "
                   "the table stays narrow")
    p.set_defaults(handler=_cmd_conformance)
