"""``kvbench calibrate`` and ``kvbench simulate``: the capacity-planning simulator's commands.

``calibrate`` fits the simulator's step cost model on this machine (:mod:`kvbench.sim.calibration`) and
prints the ``simulate`` command that plans with the profile; ``simulate`` serves a workload at scale on
the sim engine (:mod:`kvbench.sim.simulate`) and prints a capacity plan (:mod:`kvbench.sim.capacity_plan`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError, int_list, writable_folder


def sim_workloads() -> tuple[str, ...]:
    """The workloads ``kvbench simulate --workload`` accepts."""
    from kvbench.sim.simulate import WORKLOADS

    return tuple(WORKLOADS)


def add_command(subparsers: Any) -> None:
    """Add ``calibrate`` and ``simulate`` to the ``kvbench`` parser's subparsers, in that order."""
    p = subparsers.add_parser(
        "calibrate", help="fit the simulator's step cost model to the reference engine as kvbench "
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

    p = subparsers.add_parser(
        "simulate", help="simulate a workload at scale on a sim engine; a capacity plan",
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
            design_args[key] = value if isinstance(value, int) else int_list(flag, value)
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
    print(f"profile written to {path}\nplan capacity with it: {simulate_command(path, args.model)}", file=out)
    return EXIT_OK


def simulate_command(profile: Path, model: str | None) -> str:
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
    report_dir = writable_folder("--report", args.report) if args.report else None  # before minutes of simulating
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
