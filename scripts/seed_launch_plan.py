"""Ship the launch plan this machine recorded for a peer preset as kvbench's own (the seed a first run on any
machine is ordered by: :func:`kvbench.plugin.launch_order.seed_plan`).

    python scripts/seed_launch_plan.py --engine server:preset=vllm

Run the conformance suite on that engine (alone, on the built-in checkpoint, with this kvbench) first:

    pytest suites/conformance --engine server:preset=vllm --kvbench-expectations vllm

The seed goes to ``kvbench/plugin/launch_plans/<preset>.json`` with the engine's name in each test id as
``{engine}``; the plan names no path of this machine (the checkpoint, the cache and kvbench are placeholders).
Refresh it when the checks change how they size their launches: a stale seed costs a first run its starts
ahead, never a verdict.
"""

from __future__ import annotations

import argparse
import sys

from kvbench.engines.registry import EngineSpecError, parse_engine_spec
from kvbench.plugin.launch_order import plan_path, seed_from, seed_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="the engine spec the suite ran on, e.g. server:preset=vllm")
    args = parser.parse_args(argv)
    try:
        spec = parse_engine_spec(args.engine)
    except EngineSpecError as e:
        parser.error(str(e))
    dest = seed_path(spec)
    if dest is None:
        parser.error(f"{spec.name}: only an engine started from a preset (preset=..., no cmd=) has a seed plan")
    source = plan_path(spec, None, [spec])
    try:
        tests = seed_from(source, spec, dest)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{dest}: {tests} tests, from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
