"""Serve one surge under a few admission settings on the reference engine, side by side, and print the
trade-off against static admission (issue 11's goal: >= 5x fewer preemptions, >= 2x lower p99 TBT, at
>= 95% of static's throughput).

    python scripts/admission_points.py [--surge flash_crowd] [--scale full] [--repeats 2] HEADROOM:PACING ...

Each setting is ``HEADROOM:PACING``: the watermark's ``admission_headroom`` and its
``prefill_pacing_tokens`` (``-`` for none), e.g. ``0.2:1`` (headroom 0.2, one prompt per step beside
decodes). Static admission is always served too. Step clock, rounds interleaved (every setting once,
then again), medians of the rounds. For a point the ``preemption_policies`` scenario does not serve;
the scenario is what the report and the gate read.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvbench.bench import metrics
from kvbench.bench import scenarios as sc
from kvbench.bench.scenarios.common import MODEL_PRESETS, STEP_SECONDS, Job, serve
from kvbench.bench.scenarios.policies import goal_check
from kvbench.core.knobs import Knobs
from kvbench.engines.registry import EngineSpec, make_adapter
from kvbench.models.builtin import builtin_checkpoint

SURGES = {"evening_surge": sc.EveningSurge, "flash_crowd": sc.FlashCrowd}


def setting(text: str) -> Knobs:
    headroom, _, pacing = text.partition(":")
    try:
        knobs = Knobs(admission_policy="watermark", admission_headroom=float(headroom),
                      prefill_pacing_tokens=None if pacing in ("", "-") else int(pacing))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HEADROOM:PACING, e.g. 0.2:1 or 0.05:-") from None
    pacing_tokens = knobs.prefill_pacing_tokens
    if not 0 <= knobs.admission_headroom < 1 or (pacing_tokens is not None and pacing_tokens < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: headroom in [0, 1), pacing >= 1 tokens or '-'")
    return knobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--surge", choices=sorted(SURGES), default="flash_crowd")
    ap.add_argument("--scale", choices=sc.SCALES, default="full")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("settings", nargs="+", type=setting, metavar="HEADROOM:PACING")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model_dir = str(builtin_checkpoint(MODEL_PRESETS[args.scale]))
    model = sc.Model.from_dir(model_dir, MODEL_PRESETS[args.scale])
    (job,) = SURGES[args.surge]().plan(args.scale, model)
    static = Knobs(block_size=job.knobs.block_size, num_gpu_blocks=job.knobs.num_gpu_blocks,
                   preemption_mode="recompute", admission_policy="none")
    variants = {"static": static}
    for knobs in args.settings:
        variants[f"headroom {knobs.admission_headroom:g}, pacing {knobs.prefill_pacing_tokens or '-'}"] = \
            static.merged(knobs)
    adapter = make_adapter(EngineSpec("reference"), model_dir)
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, knobs in variants.items():
            t0 = time.perf_counter()
            trace = serve(adapter, Job(job.workload, knobs), args.surge, step_seconds=STEP_SECONDS[args.scale])
            m = metrics.summarize(trace)
            rounds[name].append(m)
            tbt = m.get("tbt_p99")
            print(f"round {r + 1} {name:28} preemptions {_f(m.get('preemptions'), '.0f')}, "
                  f"{_f(m.get('output_throughput'), '.1f')} tok/s, p99 TBT {_f(tbt and tbt * 1e3, '.0f')} ms "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    med = {name: {k: _median([m.get(k) for m in ms]) for k in ("preemptions", "output_throughput", "tbt_p99")}
           for name, ms in rounds.items()}
    print(f"\n{args.surge} at {args.scale} scale, medians of {args.repeats} (the goal judged on the medians "
          "alone; the scenario's table also weighs their spread):")
    for name, m in med.items():
        c = goal_check(med["static"], m)
        verdict = {True: "met", False: "not met", None: "undecided"}[c.met]
        print(f"  {name:28} preemptions {_f(m['preemptions'], '.0f')}, {_f(m['output_throughput'], '.1f')} tok/s "
              f"({_f(c.throughput_kept, '.2f')}x), p99 TBT {_f(m['tbt_p99'] and m['tbt_p99'] * 1e3, '.0f')} ms "
              f"({_f(c.lower_tbt, '.2f')}x lower)" + ("" if name == "static" else f", goal {verdict}"))
    return 0


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    raise SystemExit(main())
