"""``kvbench head-to-head``: several engines on the same closed-loop work, rounds interleaved.

The command's face only; the run and its table are :mod:`kvbench.bench.interleaved_rounds`', whose rounds the
benchmark suite's head-to-head scenario serves too (:mod:`kvbench.bench.scenarios.closed_loop`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, EXIT_REGRESSION, CLIError, int_list
from kvbench.launch.placement import SPIN_QUIET_S


def _checkpoints(names: list[str], contenders: list) -> dict[str, Path]:
    """``--model`` values -> checkpoint folders: a built-in preset in a shape every engine loads
    (vLLM's CPU build: head size 32 or more), a preset with its head size named (``tiny-hd32``), or a
    folder with a ``config.json``."""
    from kvbench.bench.interleaved_rounds import checkpoint_layouts
    from kvbench.models.builtin import builtin_checkpoint, checkpoint_for
    from kvbench.models.random_llama import PRESETS

    out: dict[str, Path] = {}
    for name in names:
        preset, _, head_dim = name.rpartition("-hd")
        if preset in PRESETS and head_dim.isdigit():
            out[name] = builtin_checkpoint(preset, head_dim=int(head_dim))
        elif name in PRESETS:
            try:
                out[name] = checkpoint_for(checkpoint_layouts(contenders), name)
            except ValueError as e:
                raise CLIError(f"--model {name}: {e}") from e
        elif (Path(name) / "config.json").is_file():
            out[name] = Path(name)
        else:
            raise CLIError(f"--model {name!r}: neither a built-in checkpoint ({', '.join(PRESETS)}, or one of them "
                           "with its head size named: tiny-hd32) nor a folder with a config.json")
    return out


def _command_line(args: argparse.Namespace) -> str:
    """The command that runs this head-to-head again, every setting spelled out (for the record's header)."""
    words = ["kvbench", "head-to-head"]
    for engine in args.engine or []:
        words += ["--engine", engine]
    for model in args.model or ["tiny"]:
        words += ["--model", model]
    for dtype in args.dtype or []:
        words += ["--dtype", dtype]
    for knob in args.knob:
        words += ["--knob", knob]
    for flag in ("concurrency", "rounds", "requests", "prompt", "output", "max_num_seqs", "max_num_batched_tokens",
                 "block_size", "metrics_interval", "cool_down", "threads"):
        words += [f"--{flag.replace('_', '-')}", f"{getattr(args, flag)}"]
    return shlex.join(words + (["--quick"] if args.quick else []))


def _cmd_head_to_head(args: argparse.Namespace, out: TextIO) -> int:
    from kvbench.bench import interleaved_rounds as h2h

    if args.report:
        try:
            record = json.loads(Path(args.report).read_text())
            print(h2h.report(record, args.baseline), file=out)
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CLIError(f"--report {args.report!r}: not a head-to-head record ({type(e).__name__}: {e})") from e
        except ValueError as e:
            raise CLIError(str(e)) from e
        return EXIT_REGRESSION if h2h.failures(record) else EXIT_OK
    try:
        contenders = h2h.parse_contenders(args.engine or [])
        names = [c.name for c in contenders]
        if args.baseline is not None and args.baseline not in names:
            raise ValueError(f"--baseline {args.baseline!r}: not an engine of this run (engines: {', '.join(names)})")
        concurrency = (64,) if args.quick else int_list("--concurrency", args.concurrency)
        setup = h2h.Setup(concurrency=concurrency, rounds=2 if args.quick else args.rounds,
                          requests=args.requests, prompt=args.prompt, output=args.output,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size, cool_down=args.cool_down, threads=args.threads,
                          metrics_interval=args.metrics_interval, dtypes=tuple(args.dtype or ()),
                          knob_overrides=h2h.parse_knob_overrides(args.knob, names))
        for dtype in setup.dtypes:  # a dtype an engine cannot take, before minutes of serving
            for contender in contenders:
                h2h.with_dtype(contender, dtype)
    except ValueError as e:  # EngineSpecError included: its message is a usage text
        raise CLIError(str(e)) from e
    models = args.model or ["tiny"]
    checkpoints = _checkpoints(models[:1] if args.quick else models, contenders)
    json_path = Path(args.json) if args.json else None
    if json_path is not None and not json_path.parent.is_dir():  # before minutes of serving
        raise CLIError(f"--json {args.json!r}: the folder {str(json_path.parent)!r} does not exist")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvbench-head-to-head-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    record = h2h.head_to_head(contenders, checkpoints, setup, log_dir=log_dir,
                              command=_command_line(args),
                              progress=lambda line: print(line, file=out, flush=True))
    print(h2h.report(record, args.baseline), file=out)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(record, indent=1))
        except OSError as e:
            raise CLIError(f"cannot write --json {args.json!r}: {e}") from e
        print(f"record written to {json_path} (kvbench head-to-head --report {json_path} renders it again)",
              file=out)
    return EXIT_REGRESSION if h2h.failures(record) else EXIT_OK


def add_command(subparsers: Any) -> None:
    """Add ``kvbench head-to-head`` to the ``kvbench`` parser's subparsers."""
    p = subparsers.add_parser(
        "head-to-head", help="several engines on the same closed-loop work, rounds interleaved, ratios per round",
        description="Serve the same closed-loop workload (token-id prompts, greedy, every request PROMPT + OUTPUT "
                    "tokens) on every --engine under the same knobs (block size, a pool that holds every running "
                    "request, max_num_seqs, max_num_batched_tokens, max_model_len = prompt + output, prefix caching "
                    "off; a knob an engine cannot set is left out for it), each engine warmed up once per checkpoint "
                    "and kept for every concurrency and round. Rounds are interleaved (the engines' order rotates) "
                    "and every ratio is taken within a round, shown as median [min-max] over the rounds; each "
                    "launched server's thread settings are read back and printed. Nothing asserts a time.",
        epilog="Exit status: 0; 1 when an engine did not finish every request of a job, gave a request another "
               "number of output tokens than asked, or, in float32, agreed with the first engine's greedy outputs "
               "on fewer than half the requests (each named); 2 a usage or file error. Example: kvbench "
               "head-to-head --engine inproc=reference --engine ref-server=server:preset=reference --engine "
               "vllm=server:preset=vllm --model small")
    p.add_argument("--engine", action="append", metavar="[LABEL=]SPEC",
                   help="an engine, as pytest's --engine names it (kvbench engines lists the kinds), optionally "
                        "labelled for the table and --knob (vllm=server:preset=vllm); repeatable")
    p.add_argument("--baseline", metavar="ENGINE", help="the engine the ratios divide by (default: the first)")
    p.add_argument("--model", action="append", metavar="NAME|DIR",
                   help="a built-in checkpoint (tiny, small: in a head size every engine takes; tiny-hd32: that "
                        "head size) or a checkpoint folder; repeatable (default tiny)")
    p.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="run every engine in this dtype (float32, bfloat16...): its dtype option, or --dtype in a "
                        "launched server's args; repeatable, one pass each (default: as each spec says)")
    p.add_argument("--concurrency", default="16,64", metavar="N,N,...",
                   help="requests in flight, one cell each (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, interleaved (default %(default)s)")
    p.add_argument("--requests", type=int, default=128, help="requests per job (default %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of every request (default %(default)s)")
    p.add_argument("--output", type=int, default=64, help="output tokens of every request (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the same on every engine (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the same prefill budget on every engine (default %(default)s: vLLM's CPU server default)")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size on every engine (default %(default)s: vLLM's CPU build takes multiples of 32)")
    p.add_argument("--knob", action="append", default=[], metavar="ENGINE:KEY=VALUE",
                   help="a knob of one engine set apart from the others' (e.g. ref512:max_num_batched_tokens=512); "
                        "repeatable")
    p.add_argument("--metrics-interval", type=float, default=0.1, metavar="S",
                   help="seconds between each server's /metrics samples during a run, unless its spec sets "
                        "metrics_interval (0: none; default %(default)g)")
    p.add_argument("--cool-down", type=float, default=SPIN_QUIET_S, metavar="S",
                   help=f"seconds of quiet before each timed job (default {SPIN_QUIET_S:g}: longer than the 1 s "
                        "vLLM's scheduler and worker spin after their last step, on the cores the next engine uses)")
    p.add_argument("--threads", choices=("default", "matched"), default="default",
                   help="default: each engine as it starts by itself; matched: the reference engine (in process "
                        "and as a server) on nproc - 1 torch threads, as many as vLLM's CPU worker binds")
    p.add_argument("--quick", action="store_true", help="the first --model only, concurrency 64, 2 rounds")
    p.add_argument("--log-dir", metavar="DIR", help="the servers' logs (default: a new temporary folder)")
    p.add_argument("--json", metavar="OUT.json", help="also save the record (figures, settings, threads seen)")
    p.add_argument("--report", metavar="RECORD.json", help="only print the table of a saved --json record "
                   "(with --baseline: against another engine of it); runs nothing")
    p.set_defaults(handler=_cmd_head_to_head)
