"""The ``kvbench`` command: reports, gates and merges of results files, the simulator, a demo.

Nothing here re-runs a benchmark: ``report``, ``compare`` and ``merge`` read results files only.

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
    kvbench validate-sim [--scenario NAME ...] [--repeats N] [--warmup N] [--profile-out FILE] [--out DIR]
    kvbench predict [--engines reference,vllm] [--rounds N] [--json OUT] [--small]
    kvbench admission-sweep [--surge NAME] [--scale quick|full] [--repeats N] [--engine SPEC] HEADROOM:PACING ...
    kvbench measure-gpu [--out DIR] [--dry-run] [size flags]

``report`` re-renders the HTML report of a results file (by default over the report.html beside it, which
was rendered from the same file); ``compare`` gates one run against another; ``merge`` joins the
results.json of shards or runs made on several machines; ``engines`` lists the engine kinds and the
option keys of each (what ``--engine KIND:KEY=VALUE`` accepts); ``demo`` serves a burst on the tiny
model in both preemption modes; ``calibrate`` fits the simulator's cost model on this machine;
``simulate`` serves a workload at scale on the simulator and prints a capacity plan; ``head-to-head``
serves several engines on the same work, rounds interleaved (the commands in modules of their own:
:data:`COMMAND_MODULES`); ``ratios`` compares two engines at every point of a saved sweep;
``conformance`` prints a run's verdicts as a Markdown table (these two read results files only);
``validate-sim`` and ``predict`` check the simulator against the reference engine and against real
engines; ``admission-sweep`` serves one surge under admission settings against static admission;
``measure-gpu`` measures the reference engine's CUDA paths against the memory-bandwidth roofline.

Exit status: 0 success (no regression); 1 ``compare`` found regressions or baseline results missing
from the current run (each is named); 2 usage or file errors (message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvbench import __version__
from kvbench.bench import gate
from kvbench.bench.results import Results, ResultsError

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2

#: the commands that live in a module of their own in this package, in the order ``--help`` lists them:
#: each module has ``add_command(subparsers)``, which adds its parser with a ``handler`` default
#: (``handler(args, out) -> exit status``, raising :class:`CLIError` for a usage or file problem)
COMMAND_MODULES: tuple[str, ...] = ("measure_gpu", "head_to_head", "ratios", "conformance",
                                   "validate_sim", "predict", "admission_sweep")


class CLIError(Exception):
    """A usage or file problem: reported on stderr, exit status 2."""


def _load(path: str, what: str) -> Results:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"{what} {path!r} does not exist or is not a file")
    try:
        return Results.load(p)
    except ResultsError as e:
        raise CLIError(str(e)) from e
    except OSError as e:
        raise CLIError(f"cannot read {what} {path!r}: {e}") from e


# --------------------------------------------------------------------------------------------
# kvbench report


def _cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.report.render import plan_href, render_report, write_text_file  # jinja2, charts: only when needed

    results = _load(args.results, "results file")
    baseline = _load(args.baseline, "baseline file") if args.baseline else None
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
    baseline = _load(args.baseline, "baseline file")
    current = _load(args.current, "current results file")
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
    parts = [(path, _load(path, "results file")) for path in args.results]
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


def _cmd_engines(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.engines.registry import EngineSpecError, adapter_class, usage

    if args.kind is not None:
        try:
            adapter_class(args.kind)
        except EngineSpecError as e:
            raise CLIError(f"{e}; kvbench engines lists the kinds") from None
    print(usage(args.kind), file=out)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.demo import run_demo

    if args.requests < 1 or args.blocks < 19:
        raise CLIError("--requests must be >= 1 and --blocks >= 19 (the largest demo request needs 19 blocks)")
    return run_demo(out, num_requests=args.requests, num_gpu_blocks=args.blocks)


# --------------------------------------------------------------------------------------------
# kvbench calibrate / simulate (the capacity-planning simulator, kvbench.sim.adapter)


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    """``"32,192,512"`` as integers; CLIError naming ``flag`` otherwise."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None


#: ``kvbench calibrate``'s design flags, by the ``Design`` field each sets
_CALIBRATE_FLAGS = {"contexts": "--contexts", "decode_batches": "--batches", "prefills": "--prefills",
                    "heldout_contexts": "--heldout", "repeats": "--repeats", "rounds": "--rounds"}


def _calibrate_flags_named(text: str) -> str:
    """``Design.contexts=...`` in an error as ``--contexts (Design.contexts)=...``: the flag the user typed."""
    for key, flag in _CALIBRATE_FLAGS.items():
        text = text.replace(f"Design.{key}=", f"{flag} (Design.{key})=")
    return text


def _cmd_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.sim.calibration import Design, calibrate_profile, fit_problems

    if args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    design_args: dict[str, Any] = {}
    for key, flag in _CALIBRATE_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            design_args[key] = value if isinstance(value, int) else _int_list(flag, value)
    try:
        design = Design(**design_args)
    except ValueError as e:
        raise CLIError(_calibrate_flags_named(str(e))) from None
    model = args.model
    if model is None:
        from kvbench.models.builtin import builtin_checkpoint

        model = str(builtin_checkpoint("tiny"))

    def progress(line: str) -> None:
        print(f"  {line}", file=out, flush=True)

    print(f"calibrating on {model}: {len(design.cells())} cells x {design.rounds} rounds to serve, fitted to served "
          "step intervals",
          file=out, flush=True)
    try:
        result, path = calibrate_profile(model, args.output, name=args.name, design=design,
                                         torch_threads=args.threads, progress=progress, force=args.force)
    except ValueError as e:  # a cell that does not fit the model, an existing file, a fit that explains nothing
        raise CLIError(_calibrate_flags_named(str(e))) from None
    print(result.summary(), file=out)
    for problem in fit_problems(result.profile.fit):
        print(f"kvbench: warning: {problem} (saved anyway: --force)", file=sys.stderr)
    print(f"profile written to {path}\nplan capacity with it: {_simulate_command(path, args.model)}", file=out)
    return EXIT_OK


def _simulate_command(profile: Path, model: str | None) -> str:
    """The ``kvbench simulate`` command line that plans on a calibrated ``profile`` for ``model`` (None: the
    built-in tiny model, simulate's default too): ``--fit-lengths`` when the model's context is too
    short for the default workload's requests."""
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint
    from kvbench.sim.simulate import fit_length_scale

    spec = f"sim:hardware={profile}" + (f",model={model}" if model is not None else "")
    shape = make_adapter(parse_engine_spec(spec), str(builtin_checkpoint("tiny"))).model_shape
    fit = " --fit-lengths" if fit_length_scale("evening_surge", shape.max_position_embeddings) < 1.0 else ""
    return f"kvbench simulate --engine {shlex.quote(spec)}{fit}"


def _cmd_simulate(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.engines.registry import EngineSpecError, make_adapter, one_line, parse_engine_spec
    from kvbench.sim import simulate as sim
    from kvbench.sim.capacity_plan import capacity_plan

    try:
        spec = parse_engine_spec(args.engine)
    except EngineSpecError as e:
        raise CLIError(one_line(e)) from e
    if spec.kind != "sim":
        raise CLIError(f"--engine {args.engine!r}: kvbench simulate runs the sim engine (sim:hardware=...,model=...)")
    try:
        sweep = sim.parse_sweep(args.sweep or [])
    except ValueError as e:
        raise CLIError(str(e)) from e
    report_dir = _writable_folder("--report", args.report) if args.report else None  # before minutes of simulating
    from kvbench.models.builtin import builtin_checkpoint

    adapter = make_adapter(spec, str(builtin_checkpoint("tiny")))
    shape = adapter.model_shape
    build, needs = sim.WORKLOADS[args.workload]
    requests = args.requests if args.requests is not None else (10_000 if args.workload == "evening_surge" else 1600)
    if requests < 1:
        raise CLIError(f"--requests must be >= 1, got {requests}")
    positions = shape.max_position_embeddings
    scale = sim.fit_length_scale(args.workload, positions)
    if scale < 1.0 and not args.fit_lengths:
        raise CLIError(f"--workload {args.workload} does not fit {shape.name} (max_position_embeddings {positions}): "
                       f"its longest request is {sim.longest_request(args.workload):,} tokens. Name a model with a "
                       f"longer context (--engine ...,model=llama-3-8b), or add --fit-lengths to serve the workload's "
                       f"shape with every length x{scale:.3g}")
    try:
        workload = build(requests, vocab_size=shape.vocab_size, max_model_len=positions, seed=args.seed,
                         length_scale=scale)
    except ValueError as e:  # the workload's lengths do not fit the model (a small config.json)
        raise CLIError(f"--workload {args.workload} does not fit {shape.name} "
                       f"(max_position_embeddings {positions}): {e}") from e
    print(f"simulating {len(workload.requests):,} requests of {args.workload} at scale on {adapter.name} "
          f"({shape.name} on {adapter.profile.name}; times are simulated seconds)", file=out)
    if scale < 1.0:
        print(f"--fit-lengths: every prompt, output and shared prefix x{scale:.3g} (rounded down) so the longest "
              f"request fits {shape.name}'s {positions:,} positions; arrival rates unchanged", file=out)
    base = sim.DEFAULT_KNOBS.merged(needs)
    try:
        for warning in sim.check_sweep(adapter, sweep, base):
            print(f"kvbench: warning: {warning}", file=sys.stderr)
    except ValueError as e:
        raise CLIError(str(e)) from e
    try:
        if sweep:
            runs = sim.run_sweep(adapter, workload, sweep, base, progress=lambda r: print(
                f"  ran {r.knobs} in {r.wall_seconds:.1f} s", file=out))
        else:
            runs = [sim.simulate(adapter, workload, base)]
    except ValueError as e:
        if getattr(e, "field", None) is None:  # not the engine's ConfigError (a bug: keep its traceback)
            raise
        # the engine refused its configuration on building (e.g. the model's weights fill the profile's memory)
        raise CLIError(f"--engine {args.engine}: {e}") from e
    print(sim.format_runs(runs), file=out)
    plan = capacity_plan(runs, adapter, args.preemption_budget, workload)
    print(plan.text(), file=out)
    if report_dir is not None:
        from kvbench.report.plan_report import write_plan_report  # jinja2 and charts load only when needed
        from kvbench.sim.capacity_plan import PlanDocument, SimulationSetup

        doc = PlanDocument(SimulationSetup.of(args.engine, adapter, workload, sweep, base), runs, plan)
        try:
            html, data = write_plan_report(doc, report_dir)
        except OSError as e:
            raise CLIError(f"cannot write the capacity plan into --report {args.report!r}: {e}") from e
        print(f"capacity plan written to {html} and {data}", file=out)
    return EXIT_OK


def _writable_folder(flag: str, text: str) -> Path:
    """``text`` as a folder that exists (created if need be) and can be written; CLIError naming ``flag``
    and the reason otherwise."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"{flag} {text!r}: cannot create the folder: {e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {text!r}: the folder is not writable")
    return path


# --------------------------------------------------------------------------------------------
# parser


Handler = Callable[[argparse.Namespace, TextIO], int]


def sim_workloads() -> tuple[str, ...]:
    from kvbench.sim.simulate import WORKLOADS

    return tuple(WORKLOADS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench",
        description="kvbench's command line: re-render reports, gate and merge results files (these read files "
                    "only), list the engine kinds and their options, run a demo, calibrate and run the "
                    "capacity-planning simulator. The checks and benchmarks themselves run under pytest "
                    "(pytest suites/ [--benchmark] [--engine SPEC ...]).",
        epilog="Exit status: 0 success; 1 compare found a regression; 2 a usage or file error.")
    parser.add_argument("--version", action="version", version=f"kvbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("report", help="render report.html from a results file",
                       description="Render the self-contained HTML report of RESULTS.json, by default over the "
                                   "report.html beside it (a rendering of the same file).")
    p.add_argument("results", metavar="RESULTS.json")
    p.add_argument("--baseline", metavar="B.json", help="also show deltas against this results file")
    p.add_argument("-o", "--output", metavar="OUT.html", help="where to write (default: report.html next to "
                   "RESULTS.json, replaced if it exists)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUT.html given with -o if it exists")
    p.set_defaults(handler=_cmd_report)

    p = sub.add_parser("compare", help="gate: compare two results files against thresholds",
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

    p = sub.add_parser("merge", help="merge results files (shards run on several machines) into one, with a report",
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

    p = sub.add_parser("engines", help="list the engine kinds and each kind's option keys",
                       description="List every engine kind (kvbench's own and those other packages register in "
                                   "the 'kvbench.engines' entry-point group) with its option keys: what --engine "
                                   "KIND:KEY=VALUE,... accepts, in pytest and in kvbench simulate.")
    p.add_argument("kind", nargs="?", metavar="KIND", help="only this kind (or MODULE:CLASS)")
    p.set_defaults(handler=_cmd_engines)

    p = sub.add_parser("demo", help="serve a burst on the tiny model under memory pressure, in both "
                       "preemption modes, and print what was preempted and what it cost",
                       description="Serve a burst of requests on the built-in tiny model with a KV pool too small "
                                   "for them, once per preemption mode (recompute, swap), and print what was "
                                   "preempted and what it cost.")
    p.add_argument("--requests", type=int, default=32, help="requests in the burst (default %(default)s)")
    p.add_argument("--blocks", type=int, default=48, help="device KV pool in blocks of 16 tokens "
                   "(default %(default)s; at least 19)")
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser("calibrate", help="fit the simulator's step cost model to the reference engine as kvbench "
                       "serves it on this machine, and save a hardware profile",
                       description="Serve the reference engine through kvbench's driver (step clock) over a designed "
                                   "set of batch shapes: for each context x decode batch cell, the decodes run alone, "
                                   "then a prefill of each size joins them for one step. Every step's shape and the "
                                   "interval from the previous step's end to its end (engine step + the driver's "
                                   "per-step work + releases) are recorded; the cost model's coefficients plus a "
                                   "per-request term are fitted by non-negative least squares in seconds on the cells "
                                   "outside --heldout. Swap copies are timed separately (1-64 blocks). Prints "
                                   "progress per cell, then the fit's error (median and p90 relative error per "
                                   "interval, R²) on the fitted and the held-out cells; the same figures are saved in "
                                   "the profile's \"fit\", and the kvbench simulate command that plans with the "
                                   "profile. It refuses to overwrite PROFILE.json, or to save a fit that explains "
                                   "too little (R² below 0.3), without --force.")
    p.add_argument("--model", metavar="DIR", help="checkpoint to calibrate on (default: the built-in tiny model)")
    p.add_argument("-o", "--output", default="profiles/this-machine.json", metavar="PROFILE.json",
                   help="where to save the profile (default %(default)s)")
    p.add_argument("--name", default="this-machine", help="the profile's name (default %(default)s)")
    p.add_argument("-f", "--force", action="store_true", help="overwrite PROFILE.json if it exists, and save a fit "
                   "whose R² (fitted or held-out cells) is below 0.3 (refused otherwise, saying why)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--contexts", metavar="N,N,...", help="context tokens of the decodes, one cell row each "
                   "(default 32,192,512)")
    p.add_argument("--batches", dest="decode_batches", metavar="N,N,...", help="decode batch sizes (default 1,8,24)")
    p.add_argument("--prefills", metavar="N,N,...", help="prefill tokens joining the decodes (default 16,96,384)")
    p.add_argument("--heldout", dest="heldout_contexts", metavar="N,...", help="contexts held out of the fit to "
                   "measure its error; each one of --contexts (default 192)")
    p.add_argument("--repeats", type=int, help="joins per prefill size per cell (default 3)")
    p.add_argument("--rounds", type=int, help="times every cell is served, rounds interleaved (default 5)")
    p.set_defaults(handler=_cmd_calibrate)

    p = sub.add_parser("simulate", help="simulate a workload at scale on a sim engine; a capacity plan",
                       description="Serve a workload (the evening surge by default) at production scale on the "
                                   "simulator (the reference "
                                   "engine's scheduler on a cost model's clock) once, or once per combination of a "
                                   "--sweep, and print the headline figures and a capacity plan.")
    p.add_argument("--engine", default="sim:hardware=h200,model=llama-3-8b", metavar="SPEC",
                   help="a sim engine spec (default %(default)s)")
    p.add_argument("--workload", choices=sorted(sim_workloads()), default="evening_surge",
                   help="evening_surge (default) or mixed_victims (short and long victims for preemption_mode=auto; "
                        "prefix caching on)")
    p.add_argument("--requests", type=int, default=None, help="default 10,000 (evening_surge) or 1,600 (mixed_victims)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument("--fit-lengths", action="store_true",
                   help="when the model's context is shorter than the workload's longest request, scale every "
                        "length (prompts, outputs, shared prefixes) by one factor so it fits; arrivals unchanged "
                        "(without it such a model is refused)")
    p.add_argument("--sweep", action="append", metavar="KNOB=V,V,...",
                   help="e.g. max_num_seqs=64,128,256,num_gpu_blocks=4000,8000,preemption_mode=swap,recompute")
    p.add_argument("--preemption-budget", type=float, default=0.01, metavar="PER_REQUEST",
                   help="preemptions per request the pool must keep under (default %(default)g)")
    p.add_argument("--report", metavar="DIR", help="also write DIR/plan.html (the capacity plan with charts, "
                   "self-contained) and DIR/plan.json (the runs and the plan); created if need be, files overwritten")
    p.set_defaults(handler=_cmd_simulate)

    for name in COMMAND_MODULES:
        importlib.import_module(f"kvbench.cli.{name}").add_command(sub)
    return parser


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
        print("kvbench: error: a command is required (report, compare, merge, engines, demo, calibrate, simulate)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args, out)
    except CLIError as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
