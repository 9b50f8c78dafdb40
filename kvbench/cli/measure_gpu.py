"""``kvbench measure-gpu``: the reference engine's CUDA paths against the memory-bandwidth roofline.

    kvbench measure-gpu [--out DIR] [--dry-run] [--device D] [--model 1b|tiny] [--dtype T] [--batches N,N,...]
                        [--context N] [--decode-steps N] [--copy-mib N] [--no-storm]

What is measured, and how, is :mod:`kvbench.bench.gpu_measure`'s docstring; ``scripts/gpu_check.sh``
runs this on a lent GPU machine. Exit status: 0 done; 1 the storm did not show its claims; 2 a usage
problem, or CUDA asked for where there is none (``--dry-run`` rehearses on CPU).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, EXIT_REGRESSION, CLIError, int_list

#: each flag that sets a :class:`~kvbench.bench.gpu_measure.Settings` field, by the field's name
_FLAGS = {"device": "--device", "model": "--model", "dtype": "--dtype", "batches": "--batches",
          "context": "--context", "decode_steps": "--decode-steps", "copy_mib": "--copy-mib"}


def _flag_named(text: str) -> str:
    """``decode_steps=0: ...`` (a Settings error) as ``--decode-steps 0: ...``: the flag the user typed."""
    for key, flag in _FLAGS.items():
        if text.startswith(f"{key}="):
            return f"{flag} {text[len(key) + 1:]}"
    return text


def _cmd_measure_gpu(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.bench.gpu_measure import NoCudaDevice, Settings, measure, summary_lines

    given: dict[str, Any] = {key: getattr(args, key) for key in _FLAGS}
    if given["batches"] is not None:
        given["batches"] = int_list("--batches", given["batches"])
    try:
        settings = Settings.for_run(args.out, dry_run=args.dry_run, storm=not args.no_storm, **given)
    except ValueError as e:
        raise CLIError(_flag_named(str(e))) from None
    from kvbench.report.render import write_report  # jinja2 and charts load only when needed

    try:
        raw, results = measure(settings, out)
    except NoCudaDevice as e:
        raise CLIError(f"--device {settings.device}: {e}") from None
    try:
        report = write_report(results, settings.out)
    except OSError as e:
        raise CLIError(f"cannot write the report into --out {str(settings.out)!r}: {e}") from e
    print(f"written: {settings.out / 'results.json'}, {report}", "", *summary_lines(raw), sep="\n", file=out)
    return EXIT_REGRESSION if (raw.get("storm") or {}).get("failures") else EXIT_OK


def add_command(subparsers: Any) -> None:
    """Add ``measure-gpu`` to the ``kvbench`` parser's subcommands."""
    p = subparsers.add_parser(
        "measure-gpu", help="measure the reference engine's CUDA paths against the memory-bandwidth roofline",
        description="On a CUDA device: the device's copy bandwidth, a ~1B-parameter bf16 Llama's decode step at "
                    "each batch size against the bandwidth roofline (torch and Triton attention), and the "
                    "preemption storm on the device; written to OUT/results.json (kvbench report and compare "
                    "read it), OUT/report.html and OUT/gpu_measure.json. --dry-run runs every step on CPU at "
                    "tiny sizes. Nothing asserts a time.",
        epilog="Exit status: 0 done; 1 the storm did not show its claims; 2 a usage error or no CUDA device.")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), metavar="DIR",
                   help="output folder, created if need be (default: $OUT, else gpu-out)")
    p.add_argument("--dry-run", action="store_true", help="run every step on CPU at tiny sizes (no GPU needed)")
    p.add_argument("--device", help="torch device (default: cuda; cpu with --dry-run)")
    p.add_argument("--model", help="checkpoint shape: 1b or tiny (default: 1b; tiny with --dry-run)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16 (default: bfloat16; float32 with --dry-run)")
    p.add_argument("--batches", metavar="N,N,...", help="decode batch sizes (default 1,16,64; 1,4 with --dry-run)")
    p.add_argument("--context", type=int, help="prompt tokens per request (default 1024; 48 with --dry-run)")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per batch (default 20; 3 with --dry-run)")
    p.add_argument("--copy-mib", type=int, help="size of the bandwidth copy (default 2048; 16 with --dry-run)")
    p.add_argument("--no-storm", action="store_true", help="skip the preemption storm")
    p.set_defaults(handler=_cmd_measure_gpu)
