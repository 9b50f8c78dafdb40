"""``kvbench predict``: the simulator against real engines (the reference engine, vLLM's CPU server):
calibrate, predict, measure, compare (the face of :mod:`kvbench.sim.predict_engines`;
docs/simulator.md#predicting-a-real-engine-vllm-the-reference-engine)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any, TextIO

from kvbench.cli import EXIT_OK, CLIError


def add_command(subparsers: Any) -> None:
    """Add ``predict`` to the ``kvbench`` command's subparsers."""
    from kvbench.launch.placement import SPIN_QUIET_S

    p = subparsers.add_parser(
        "predict", help="the simulator against real engines: calibrate each, predict the preemption storm and the "
        "evening surge, measure them, compare",
        description="For each engine (reference: in process; vllm: vLLM's CPU server, found by kvbench's peers), on "
                    "the tiny model with head size 32 and the same knobs (block size 32, a 64-block pool, chunked "
                    "prefill, 512-token budget, 32 sequences, recompute): calibrate a simulator profile (one pass "
                    "per measured round), serve the preemption storm's sweep and the evening surge (quick sizes) on "
                    "the engine in interleaved rounds and on the simulator configured like it, and print predicted "
                    "against the median of the rounds [min-max], the error beside the rounds' spread, and the knee.",
        epilog="Exit status: 0 the comparison was printed (it is read, not gated); 2 a usage or file error, or "
               "--engines includes vllm and kvbench's vLLM peer is not set up (scripts/peers.sh).")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds; each also holds one calibration pass "
                   "per engine (default %(default)s)")
    p.add_argument("--engines", default="reference,vllm", metavar="NAME,...",
                   help="comma-separated, among reference and vllm (default %(default)s)")
    p.add_argument("--json", metavar="OUT.json", help="also write every figure, profile and summary here")
    p.add_argument("--no-client-fit-reference", dest="client_fit_reference", action="store_false",
                   help="skip the cross-check: the reference engine also calibrated client-side, as vLLM is")
    p.add_argument("--no-front-end", dest="front_end", action="store_false",
                   help="predict vLLM without the fitted front end (its engine alone)")
    p.add_argument("--vllm-helper-cores", choices=("engine", "free"), default="engine",
                   help="vLLM's EngineCore scheduler bound to its worker's core (engine, the default: the front end "
                        "keeps the other core) or left where vLLM puts it (free: vLLM as it starts); the server "
                        "adapter's helper_cores option")
    p.add_argument("--cool-down", type=float, default=SPIN_QUIET_S, metavar="SECONDS",
                   help="quiet before each engine's round: vLLM's scheduler and worker spin for a second after their "
                        "last step, on the core the next engine measured runs on (default %(default)g)")
    p.add_argument("--small", action="store_true", help="small calibration designs (a few cells, short decodes): a "
                   "quick look at the whole pipeline, not figures to publish")
    p.add_argument("--log-dir", metavar="DIR", help="where the vLLM server's log goes (default: a temporary folder)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """``kvbench predict``: check the options, find vLLM's peer if asked for, run, print, write ``--json``."""
    from kvbench.sim.predict_engines import PredictOptions, predict_engines, report

    try:
        options = PredictOptions(engines=tuple(e.strip() for e in args.engines.split(",") if e.strip()),
                                 rounds=args.rounds, client_fit_reference=args.client_fit_reference,
                                 front_end=args.front_end, vllm_helper_cores=args.vllm_helper_cores,
                                 log_dir=args.log_dir, cool_down_s=args.cool_down, small=args.small,
                                 command=_command_line(args))
    except ValueError as e:  # name the flag the user typed, not the field
        for field, flag in (("engines", "--engines"), ("rounds", "--rounds"), ("cool_down_s", "--cool-down")):
            if str(e).startswith(f"{field}="):
                raise CLIError(f"{flag}: {e}") from None
        raise CLIError(str(e)) from None
    json_path = Path(args.json) if args.json else None
    if json_path is not None and not json_path.parent.is_dir():  # before minutes of serving
        raise CLIError(f"--json {args.json!r}: the folder {str(json_path.parent)!r} does not exist")
    if "vllm" in options.engines:  # before minutes of calibrating the reference engine
        from kvbench.launch.peers import PeerMissing, find_vllm

        try:
            find_vllm()
        except PeerMissing as e:
            raise CLIError(f"--engines includes vllm: {e}\n(or pass --engines reference)") from None

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    result = predict_engines(options, say)
    print(report(result), file=out)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(result, indent=1))
        except OSError as e:
            raise CLIError(f"cannot write --json {args.json!r}: {e}") from e
        print(f"every figure written to {json_path}", file=out)
    return EXIT_OK


def _command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out (the printed report's header)."""
    words = ["kvbench", "predict", "--rounds", str(args.rounds), "--engines", args.engines,
             "--vllm-helper-cores", args.vllm_helper_cores, "--cool-down", f"{args.cool_down:g}"]
    words += [flag for flag, on in (("--no-client-fit-reference", not args.client_fit_reference),
                                    ("--no-front-end", not args.front_end), ("--small", args.small)) if on]
    return shlex.join(words)
