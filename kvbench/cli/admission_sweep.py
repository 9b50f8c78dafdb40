"""``kvbench admission-sweep``: one surge under several admission settings against static admission
(the face of :mod:`kvbench.bench.admission_tradeoff`; docs/simulator.md#sweeping-admission-settings)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError


def _setting(text: str) -> Any:
    from kvbench.bench.admission_tradeoff import parse_setting

    try:
        return parse_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_command(subparsers: Any) -> None:
    """Add ``admission-sweep`` to the ``kvbench`` command's subparsers."""
    from kvbench.bench.admission_tradeoff import SURGES
    from kvbench.bench.scenarios import SCALES

    p = subparsers.add_parser(
        "admission-sweep", help="serve one surge under several admission settings (watermark headroom, prefill "
        "pacing) and print each one's trade-off against static admission",
        description="Serve one surge on an engine (the reference engine by default; step clock) with static "
                    "admission and with each HEADROOM:PACING setting (the watermark's admission_headroom and its "
                    "prefill_pacing_tokens, '-' for none), rounds interleaved, and print per setting the medians "
                    "[min-max] of preemptions, output throughput and p99 TBT, and the preemption_policies "
                    "scenario's goal against static: at least 5x fewer preemptions, 2x lower p99 TBT, 95% of the "
                    "throughput.",
        epilog="Exit status: 0 the trade-off was printed (the goal is read, not gated); 2 a usage error, or an "
               "engine that does not take the admission knobs.")
    p.add_argument("settings", nargs="+", type=_setting, metavar="HEADROOM:PACING",
                   help="e.g. 0.2:1 (headroom 0.2, one prompt token per step beside decodes) or 0.05:- (no pacing)")
    p.add_argument("--surge", choices=sorted(SURGES), default="flash_crowd", help="default %(default)s")
    p.add_argument("--scale", choices=SCALES, default="full", help="the scenarios' sizes and model (default "
                   "%(default)s: the small model, minutes per round; quick: the tiny one, seconds)")
    p.add_argument("--repeats", type=int, default=2, help="rounds, interleaved (default %(default)s)")
    p.add_argument("--engine", default="reference", metavar="SPEC", help="the engine, as pytest's --engine names "
                   "it; one that takes the admission knobs (default %(default)s)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """``kvbench admission-sweep``: build the engine, sweep, print the trade-off."""
    from kvbench.bench import scenarios as sc
    from kvbench.bench.admission_tradeoff import sweep_admission
    from kvbench.bench.scenarios.common import MODEL_PRESETS
    from kvbench.engines.registry import EngineSpecError, make_adapter, one_line, parse_engine_spec
    from kvbench.models.builtin import builtin_checkpoint

    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    try:
        spec = parse_engine_spec(args.engine)
    except EngineSpecError as e:
        raise CLIError(f"--engine: {one_line(e)}") from e
    import torch

    torch.set_num_threads(1)  # the engine as the benchmarks serve it on this machine
    preset = MODEL_PRESETS[args.scale]
    model_dir = str(builtin_checkpoint(preset))
    try:
        adapter = make_adapter(spec, model_dir)
    except (EngineSpecError, ValueError) as e:
        raise CLIError(f"--engine {args.engine!r}: {e}") from e

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        found = sweep_admission(adapter, sc.Model.from_dir(model_dir, preset), args.settings, args.surge,
                                args.scale, args.repeats, say)
    except ValueError as e:
        if getattr(e, "field", None) is None:  # not the engine refusing a knob (a bug: keep its traceback)
            raise
        raise CLIError(f"--engine {args.engine}: {e}") from e
    finally:
        adapter.close()
    print(found.text(), file=out)
    return EXIT_OK
