"""``kvbench results-page``: docs/results.md generated from results files.

The command's face only; the page is :mod:`kvbench.report.results_tables`'s. Nothing is re-run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError, load_results


def _cmd_results_page(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.report.results_tables import Source, results_page

    sources = [Source(path, load_results(path, "results file")) for path in args.results]
    try:
        page = results_page(sources)
    except ValueError as e:
        raise CLIError(str(e)) from e
    if args.output in (None, "-"):
        out.write(page)
        return EXIT_OK
    target = Path(args.output)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page, encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot write -o {args.output!r}: {e}") from e
    print(f"results page written to {target} ({len(page.splitlines())} lines from {len(sources)} results files)",
          file=out)
    return EXIT_OK


def add_command(subparsers: Any) -> None:
    """Add ``kvbench results-page`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "results-page", help="docs/results.md from results files: conformance, headlines, engines, simulator",
        description="Write the results page (Markdown) from RESULTS.json files: the conformance matrix (the newest "
                    "verdict per engine and check among the files), each benchmark run's headlines with their "
                    "noise, engine against engine, and the simulator against the engine it simulates, each table "
                    "with the command, commit and machine of its run. A section no file holds is left out, not "
                    "written empty. Reads the results files only.",
        epilog="Exit status: 0; 2 a usage or file error, or files that hold no table at all.")
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="results files written by kvbench runs")
    p.add_argument("-o", "--output", metavar="PAGE.md", help="where to write the page (default: standard output)")
    p.set_defaults(handler=_cmd_results_page)
