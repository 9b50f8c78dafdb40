"""``kvbench ratios``: one engine against another at every point of a sweep, from a results file.

The command's face only; the ratios are :mod:`kvbench.bench.point_ratios`'. Nothing is re-run.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from kvbench.bench import gate
from kvbench.bench.point_ratios import DEFAULT_METRICS, below, known_metrics, point_ratios, ratios_table, sweep_engines
from kvbench.cli import EXIT_OK, EXIT_REGRESSION, CLIError, load_results


def _cmd_ratios(args: argparse.Namespace, out: TextIO) -> int:
    results = load_results(args.results, "results file")
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if not metrics:
        raise CLIError(f"--metrics: expected metric names separated by commas, got {args.metrics!r}")
    if args.at_least is not None and not args.at_least > 0:
        raise CLIError(f"--at-least must be a ratio > 0 (e.g. 0.9), got {args.at_least}")
    try:
        baseline = args.baseline or gate.reference_engine_name(results)
        if baseline is None:
            raise ValueError("--baseline: these results have no engine of kind reference; name the baseline "
                             f"(engines: {', '.join(results.engine_names())})")
        known = known_metrics(results, args.scenario, args.sweep)
        unknown = [m for m in metrics if m not in known]
        if unknown:
            raise ValueError(f"--metrics: unknown metric key(s) {', '.join(map(repr, unknown))}; known keys: "
                             f"{', '.join(known)}")
        engines = args.engine or [e for e in sweep_engines(results, args.scenario, args.sweep) if e != baseline]
        if not engines:
            raise ValueError(f"--engine: {args.scenario!r} has points of {baseline!r} only; nothing to compare")
        tables = [(engine, point_ratios(results, args.scenario, baseline, engine, metrics, sweep=args.sweep,
                                        mode=args.mode)) for engine in engines]
    except ValueError as e:
        raise CLIError(str(e)) from e
    status = EXIT_OK
    for i, (engine, ratios) in enumerate(tables):
        print(("\n" if i else "") + ratios_table(ratios, baseline, engine), file=out)
        if not ratios:
            print(f"no point of {args.scenario!r} has {', '.join(metrics)} for both {baseline} and {engine}",
                  file=out)
            if args.at_least is not None:  # a gate that compared nothing has shown nothing: it fails
                status = EXIT_REGRESSION
                print(f"--at-least {args.at_least:g}: nothing was compared for {engine} against {baseline}, so "
                      "nothing shows it at least that far", file=out)
        if args.at_least is not None:
            for r in below(ratios, args.at_least):
                status = EXIT_REGRESSION
                print(f"below {args.at_least:g}: {engine}, {r.metric} at {r.x:g}"
                      + (f" ({r.mode})" if r.mode else "") + f": {r.median_round_ratio:.2f}", file=out)
    return status


def add_command(subparsers: Any) -> None:
    """Add ``kvbench ratios`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "ratios", help="one engine against another at every point of a sweep, round by round",
        description="For each point of a scenario's sweep that both engines served, and each metric: the ratio of "
                    "the engines' medians and the ratio round by round (repeat i against repeat i: the engines of "
                    "a point are served interleaved), as median [min-max], beside each engine's own rounds' range "
                    "(max - min as a share of the median), so that noise and a real gap are told apart. > 1 means "
                    "the engine is ahead: throughputs engine/baseline, times baseline/engine. Reads the results "
                    "file only.",
        epilog="Exit status: 0; 1 when --at-least is given and a point's median round ratio is below it (each such "
               "point is named) or an engine had no point to compare (said so); 2 a usage or file error, an "
               "unknown --metrics key among them.")
    p.add_argument("results", metavar="RESULTS.json", help="a results file written by pytest --benchmark")
    p.add_argument("--scenario", default="preemption_storm", help="the scenario whose sweep is compared "
                   "(default %(default)s)")
    p.add_argument("--sweep", metavar="NAME", help="which of the scenario's sweeps (default: its first)")
    p.add_argument("--mode", metavar="MODE", help="only the points of this variant (e.g. swap); default: every "
                   "mode, each point on its own row")
    p.add_argument("--baseline", metavar="ENGINE", help="the engine compared against (default: the reference "
                   "engine of the run)")
    p.add_argument("--engine", action="append", metavar="ENGINE", help="the engine compared, as the results name "
                   "it (e.g. server:preset=reference); repeatable; default: every other engine of the sweep")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS), metavar="M,M,...",
                   help="metric keys (default %(default)s)")
    p.add_argument("--at-least", type=float, metavar="RATIO", help="exit 1 when a point's median round ratio is "
                   "below RATIO (e.g. 0.9: the engine within 10%% of the baseline at every point)")
    p.set_defaults(handler=_cmd_ratios)
