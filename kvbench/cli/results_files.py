"""``kvbench report``, ``kvbench compare`` and ``kvbench merge``: the commands that read results files only.

Nothing here re-runs a benchmark: ``report`` re-renders the HTML report of a results file, ``compare``
gates one run against another (:mod:`kvbench.bench.gate`), ``merge`` joins the results.json of shards or
runs made on several machines (:mod:`kvbench.bench.merge`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvbench.bench import gate
from kvbench.bench.results import Results
from kvbench.cli import EXIT_OK, EXIT_REGRESSION, CLIError, load_results


def add_command(subparsers: Any) -> None:
    """Add ``report``, ``compare`` and ``merge`` to the ``kvbench`` parser's subparsers, in that order."""
    p = subparsers.add_parser(
        "report", help="render report.html from a results file",
        description="Render the self-contained HTML report of RESULTS.json, by default over the "
                    "report.html beside it (a rendering of the same file).")
    p.add_argument("results", metavar="RESULTS.json")
    p.add_argument("--baseline", metavar="B.json", help="also show deltas against this results file")
    p.add_argument("-o", "--output", metavar="OUT.html", help="where to write (default: report.html next to "
                   "RESULTS.json, replaced if it exists)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUT.html given with -o if it exists")
    p.set_defaults(handler=_cmd_report)

    p = subparsers.add_parser(
        "compare", help="gate: compare two results files against thresholds",
        description="Compare CURRENT against BASELINE, matched per (scenario, engine, mode): "
                    "counts from step-clock runs exactly, times as same-run ratios to the reference "
                    "engine beyond a noise floor. Exit 1 if any threshold is crossed or a baseline "
                    "result is missing from CURRENT.",
        epilog="Threshold syntax NAME:[+|-]NUMBER[%], e.g. throughput:-10% (fail if it drops "
               "more than 10%), p99_tbt:+20% (fail if it rises more than 20%), preemptions:+0 "
               "(fail on any increase). Short names: " + ", ".join(sorted(gate.SHORT_NAMES))
               + "; pNN_ttft/tbt/tpot/e2e and any metric key also work. Prefix abs: (abs:throughput:"
               "-10%) gates that time on its absolute value.")
    p.add_argument("baseline", metavar="BASELINE.json", help="the reference run (A)")
    p.add_argument("current", metavar="CURRENT.json", help="the run under test (B)")
    p.add_argument("-t", "--threshold", action="append", metavar="EXPR",
                   help="repeatable; default: " + " ".join(gate.DEFAULT_THRESHOLDS).replace("%", "%%"))
    p.add_argument("--gate-absolute", action="store_true",
                   help="gate times on their absolute values, not as ratios to the reference engine of the same run")
    p.add_argument("--noise-k", type=float, default=gate.NOISE_K, metavar="K",
                   help="a change of a time must exceed K pooled spreads of the repeats (default %(default)g)")
    p.add_argument("--html", metavar="OUT.html", help="also write the two runs side by side as one self-contained "
                   "HTML page (the verdict, both runs' headlines, every key metric of each with its change)")
    p.set_defaults(handler=_cmd_compare)

    p = subparsers.add_parser(
        "merge", help="merge results files (shards run on several machines) into one, with a report",
        description="Merge the results.json of shards (pytest --kvbench-shard I/N on each machine) or "
                    "of separate runs into one results file, each result keeping the machine it was "
                    "measured on. Refuses files of different schema versions or scenario sizes "
                    "(--benchmark-scale), the same result or shard twice, and one engine name with "
                    "different options, naming the files.")
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="the files to merge; a shard writes "
                   "<report-dir>/<run>-shardIofN/results.json")
    p.add_argument("-o", "--output", required=True, metavar="MERGED.json", help="the merged results file")
    p.add_argument("--report", metavar="DIR", help="also write DIR/report.html (with a machine column) and "
                                                    "DIR/results.json")
    p.add_argument("-f", "--force", action="store_true", help="overwrite MERGED.json if it exists")
    p.set_defaults(handler=_cmd_merge)


# --------------------------------------------------------------------------------------------
# kvbench report


def _cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.report.render import plan_href, render_report, write_text_file  # jinja2, charts: only when needed

    results = load_results(args.results, "results file")
    baseline = load_results(args.baseline, "baseline file") if args.baseline else None
    target = Path(args.output) if args.output else Path(args.results).with_name("report.html")
    # The report beside RESULTS.json is a rendering of that same file: re-rendering it is what the command is
    # for. Another existing file named with -o may be anything: ask first.
    if args.output and target.exists() and not args.force:
        raise CLIError(f"{target} exists; pass --force to overwrite it, or -o to write elsewhere")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        html = render_report(results, baseline, plan_href=plan_href(target.parent))
        write_text_file(target, html)
    except OSError as e:
        raise CLIError(f"cannot write report {str(target)!r}: {e}") from e
    print(f"report written to {target} ({len(html.encode('utf-8')) / 1024:,.0f} KiB, from {args.results}"
          + (f", baseline {args.baseline}" if args.baseline else "") + ")", file=out)
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# kvbench compare


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table, columns padded to their widest cell (first two left-aligned)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _cmd_compare(args: argparse.Namespace, out: TextIO) -> int:
    expressions = args.threshold or list(gate.DEFAULT_THRESHOLDS)
    try:
        thresholds = gate.parse_thresholds(expressions)
    except gate.ThresholdError as e:
        raise CLIError(str(e)) from e
    if args.noise_k < 0:
        raise CLIError(f"--noise-k must be >= 0, got {args.noise_k}")
    baseline = load_results(args.baseline, "baseline file")
    current = load_results(args.current, "current results file")
    if not gate.common_keys(current, baseline):  # a gate that compares nothing must not pass silently
        raise CLIError(f"nothing to compare: {args.baseline} and {args.current} share no (scenario, engine)")
    verdict = gate.gate(current, baseline, thresholds, absolute=args.gate_absolute, noise_k=args.noise_k)
    rows = [[d.scenario, d.engine + (f" [{d.mode}]" if d.mode else ""), d.metric, d.basis,
             gate.format_value(d.baseline), gate.format_value(d.current), gate.format_change(d),
             gate.format_value(d.noise) if d.noise else "-", str(d.threshold),
             "REGRESSION" if d.regressed else ("noise" if d.within_noise else "ok")] for d in verdict.deltas]
    print(f"baseline: {args.baseline}\ncurrent:  {args.current}\nthresholds: {', '.join(map(str, thresholds))}"
          f"\ntimes: {'absolute' if args.gate_absolute else 'same-run ratios to the reference engine'}; "
          f"noise floor {args.noise_k:g} x pooled spread of repeats\n", file=out)
    if rows:
        print(format_table(rows, ["scenario", "engine", "metric", "basis", "baseline", "current", "change", "noise",
                                  "threshold", "status"]), file=out)
    else:
        print("no thresholded metric is present in both files", file=out)
    for note in verdict.notes:
        print(f"note: {note}", file=out)
    if args.html:
        _write_compare_html(args, baseline, current, verdict, thresholds, out)
    if verdict.failed:
        print(f"\n{verdict.summary()}:", file=out)
        for line in verdict.failure_lines():
            print(f"  {line}", file=out)
        return EXIT_REGRESSION
    print("\nno regressions", file=out)
    return EXIT_OK


def _write_compare_html(args: argparse.Namespace, baseline: Results, current: Results, verdict: gate.Verdict,
                        thresholds: Sequence[gate.Threshold], out: TextIO) -> None:
    from kvbench.report.compare import render_compare  # jinja2 loads only when needed
    from kvbench.report.render import write_text_file

    target = Path(args.html)
    html = render_compare(baseline, current, verdict, baseline_path=args.baseline, current_path=args.current,
                          thresholds=", ".join(map(str, thresholds)))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_file(target, html)
    except OSError as e:
        raise CLIError(f"cannot write --html {args.html!r}: {e}") from e
    print(f"side by side written to {target}", file=out)


# --------------------------------------------------------------------------------------------
# kvbench merge


def _cmd_merge(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.bench.merge import MergeError, machine_count, merge_results

    target = Path(args.output)
    if target.exists() and not args.force:
        raise CLIError(f"{target} exists; pass --force to overwrite it, or -o to write elsewhere")
    if any(Path(r).resolve() == target.resolve() for r in args.results):
        raise CLIError(f"-o {target} is one of the inputs; write the merge elsewhere")
    parts = [(path, load_results(path, "results file")) for path in args.results]
    try:
        merged = merge_results(parts)
    except MergeError as e:
        raise CLIError(str(e)) from e
    try:
        merged.save(target)
    except OSError as e:
        raise CLIError(f"cannot write {str(target)!r}: {e}") from e
    print(f"merged {len(parts)} results files ({', '.join(args.results)}) from {machine_count(merged)} machine(s) "
          f"into {target}: {sum(len(sc['results']) for sc in merged.scenarios)} scenario results, "
          f"{len(merged.conformance)} conformance results", file=out)
    for note in merged.data["merge"]["notes"]:
        print(f"note: {note}", file=out)
    if args.report:
        from kvbench.report.render import write_report

        try:
            report = write_report(merged, Path(args.report))
        except OSError as e:
            raise CLIError(f"cannot write the report into {args.report!r}: {e}") from e
        print(f"report written to {report}", file=out)
    return EXIT_OK
