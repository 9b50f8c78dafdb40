"""Validate the simulator against the reference engine, side by side in one run.

    python scripts/validate_sim.py [--profile PROFILE.json] [--scenario NAME ...]

Calibrates a profile on this machine (or takes ``--profile``), then serves every quick scenario on
the reference engine (step clock, 10 ms per step, wall-clock timings) and on ``sim`` with that profile
and ``clock=step``: the same requests are released before the same steps, so the scheduler makes the
same decisions and every count must be equal; the times differ only by how well the cost model
prices each step. Prints measured vs simulated output throughput, p50/p99 TTFT, p99 TBT,
preemptions by mode and recomputed tokens per result, and the median absolute relative error of
the timing metrics. Timings on a shared machine carry its load: read them with the load average
printed at the start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from kvbench.bench import metrics
from kvbench.bench import scenarios as sc
from kvbench.checkpoints import builtin_checkpoint
from kvbench.engines.registry import EngineSpec, make_adapter, parse_engine_spec

TIMES = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99")
COUNTS = ("preemptions_recompute", "preemptions_swap", "recomputed_tokens")
STEP_SECONDS = 0.01


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="a calibrated profile (default: calibrate now)")
    ap.add_argument("--scenario", action="append", help="only these scenarios (default: all)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model_dir = str(builtin_checkpoint("tiny"))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    profile = args.profile
    if profile is None:
        from kvbench.engines.sim import calibrate_profile

        profile = os.path.join(tempfile.mkdtemp(), "this-machine.json")
        t0 = time.perf_counter()
        print(calibrate_profile(model_dir, profile), flush=True)
        print(f"(calibration took {time.perf_counter() - t0:.0f} s)", flush=True)
    model = sc.Model.from_dir(model_dir, "tiny")
    real = make_adapter(EngineSpec("reference"), model_dir)
    sim = make_adapter(parse_engine_spec(f"sim:hardware={profile},clock=step"), model_dir)
    errors: dict[str, list[float]] = {k: [] for k in TIMES}
    counts_equal = True
    header = f"{'scenario [mode]':40} {'metric':22} {'measured':>12} {'simulated':>12} {'error':>8}"
    names = args.scenario or list(sc.SCENARIOS)
    for name in names:
        scenario = sc.SCENARIOS[name]
        t0 = time.perf_counter()
        measured = sc.run(scenario, real, model, "quick", step_seconds=STEP_SECONDS)
        t1 = time.perf_counter()
        simulated = sc.run(scenario, sim, model, "quick", step_seconds=STEP_SECONDS)
        t2 = time.perf_counter()
        print(f"\n{name}: reference {t1 - t0:.0f} s, sim {t2 - t1:.1f} s (wall)\n{header}", flush=True)
        for m_entry, s_entry in zip(measured.entries, simulated.entries, strict=True):
            m, s = metrics.summarize(m_entry.trace), metrics.summarize(s_entry.trace)
            label = f"{name} [{m_entry.mode or '-'}]"
            for key in TIMES:
                a, b = m.get(key), s.get(key)
                err = abs(b - a) / a if a and b is not None else None
                if err is not None:
                    errors[key].append(err)
                print(f"{label:40} {key:22} {_f(a):>12} {_f(b):>12} {_pct(err):>8}")
            for key in COUNTS:
                a, b = m.get(key), s.get(key)
                same = a == b
                counts_equal &= same
                print(f"{label:40} {key:22} {_f(a):>12} {_f(b):>12} {'equal' if same else 'DIFFER':>8}")
    print("\nmedian absolute relative error of the timing metrics over every result:")
    for key, errs in errors.items():
        print(f"  {key:22} {_pct(statistics.median(errs)) if errs else '-':>8}  ({len(errs)} results)")
    every = [e for errs in errors.values() for e in errs]
    print(f"  {'all timing metrics':22} {_pct(statistics.median(every)) if every else '-':>8}")
    print(f"counts (preemptions by mode, recomputed tokens) equal on the step clock: {counts_equal}")
    return 0 if counts_equal else 1


def _f(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


if __name__ == "__main__":
    sys.exit(main())
