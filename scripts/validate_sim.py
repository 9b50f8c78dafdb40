"""Validate the simulator against the reference engine, side by side in one run.

    python scripts/validate_sim.py [--scenario NAME ...] [--repeats N] [--warmup N] [--profile-out FILE] [--out DIR]

1. Measure: every quick scenario is served on the reference engine (step clock, 10 ms per step,
   wall-clock timings), ``--repeats`` rounds interleaved (every scenario once, then again), with each
   engine step's shape (what the scheduler handed the runner) recorded beside the trace.
2. Fit what the driver sees: the cost model's coefficients plus a per-request term are fitted to
   the *interval* from one step's end to the next (the engine step plus the driver's per-step work:
   recording, events, the watchdog; plus the releases before the step), not to ``LLMEngine.step()``
   timed alone, which missed a consistent ~4x.
3. Simulate, leaving the scenario out: scenario X runs on ``sim`` (``clock=step``, so the same
   requests are released before the same steps and every count must equal the reference engine's)
   with a profile fitted on every *other* scenario's steps of this same run. No separate
   calibration minutes or hours away, and no fit on X's own data.

Prints measured (the median of the rounds) vs simulated output throughput, p50/p99 TTFT, p99 TBT per
result, with the simulator's error beside the spread between the first two rounds of the same run
(how far one measurement is from another here: the floor under any simulator's error on this
machine), the median absolute error per metric and overall, and whether every count (preemptions by
mode, recomputed tokens) is equal. Exit status 1 if a count differs.

``--out DIR`` also writes ``DIR/results.json`` and ``DIR/report.html`` (kvbench's own results file and
report): per scenario the reference engine's rounds (their medians and spreads) and the leave-one-out
simulation, the latter
under the one engine name :data:`SIM_ENGINE` (marked simulated, clock=step), so the report's
"Simulator vs measured" section shows the comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from kvbench.bench import metrics, repeats
from kvbench.bench import scenarios as sc
from kvbench.bench.results import Results
from kvbench.engines.registry import EngineSpec, make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint
from kvbench.report.render import write_report
from kvbench.sim.calibration import base_profile, interval_samples, recording
from reference_engine.costs import CostModel, load_model_shape
from reference_engine.sim.calibrate import Design, IntervalSample, fit_intervals, interval_errors

TIMES = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99")
COUNTS = ("preemptions_recompute", "preemptions_swap", "recomputed_tokens")
STEP_SECONDS = 0.01
#: the simulated engine's name in ``--out``'s results: one name for every scenario's leave-one-out fit
SIM_ENGINE = "sim:hardware=fitted-leave-one-out,clock=step"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", action="append", help="only these scenarios (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="measurement rounds (default 2: gives the spread)")
    ap.add_argument("--profile-out", help="also save the profile fitted on every scenario here")
    ap.add_argument("--warmup", type=int, default=1, help="rounds served first and thrown away (default 1: the "
                    "first round in a process ran up to 2x slower, torch and allocator warming up)")
    ap.add_argument("--out", metavar="DIR", help="also write results.json and report.html (with its "
                    "'Simulator vs measured' section) into DIR")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    import torch

    torch.set_num_threads(1)
    model_dir = str(builtin_checkpoint("tiny"))
    names = args.scenario or list(sc.SCENARIOS)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    base = base_profile(model_dir, Design(), "served-fit")  # peak rates and swap terms, as kvbench calibrate
    cost = CostModel(load_model_shape(model_dir), base)
    model = sc.Model.from_dir(model_dir, "tiny")

    for r in range(args.warmup):  # neither fitted nor compared
        for name in names:
            t0 = time.perf_counter()
            sc.run(sc.SCENARIOS[name], make_adapter(EngineSpec("reference"), model_dir), model, "quick",
                   step_seconds=STEP_SECONDS)
            print(f"warm-up {r + 1}: {name} in {time.perf_counter() - t0:.0f} s", flush=True)

    # 1. measure, rounds interleaved
    measured: dict[str, list] = {n: [] for n in names}
    results = Results(device="cpu") if args.out else None
    samples: dict[str, list[IntervalSample]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            real = recording(make_adapter(EngineSpec("reference"), model_dir))
            t0 = time.perf_counter()
            outcome = sc.run(sc.SCENARIOS[name], real, model, "quick", step_seconds=STEP_SECONDS)
            print(f"round {r + 1}: {name} measured in {time.perf_counter() - t0:.0f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            measured[name].append(outcome)
            if r == 0:
                described = real.describe()
            runs = list(real.shape_runs)  # one per engine built; a sweep's points are not entries
            for entry in outcome.entries:
                shapes = next((r for r in runs if len(r) == len(entry.trace.steps)), None)
                if shapes is None:
                    print(f"  {name}: no engine's steps match an entry of {len(entry.trace.steps)} steps; "
                          "left out of the fit", flush=True)
                    continue
                runs.remove(shapes)
                samples[name] += interval_samples(entry.trace, shapes, name)

    if results is not None:  # every round: the results keep each repeat and their medians, as printed below
        for name in names:
            first = measured[name][0]
            first.repeats = measured[name]
            sc.record(first, results, described)

    # 2 + 3. fit leaving each scenario out, simulate it
    errors: dict[str, list[float]] = {k: [] for k in TIMES}
    spreads: dict[str, list[float]] = {k: [] for k in TIMES}
    counts_equal = True
    folder = tempfile.mkdtemp()
    header = f"{'scenario [mode]':40} {'metric':20} {'median':>11} {'round 2':>11} {'simulated':>11} " \
             f"{'spread':>7} {'error':>7}"
    for name in names:
        others = [s for n in names if n != name for s in samples[n]] or samples[name]
        coefficients = fit_intervals(cost, others)
        profile = base.with_coefficients(coefficients, name=f"fit-without-{name}")
        held = interval_errors(CostModel(cost.model, profile), samples[name])
        path = profile.save(os.path.join(folder, f"{name}.json"))
        sim = make_adapter(parse_engine_spec(f"sim:hardware={path},clock=step"), model_dir)
        simulated = sc.run(sc.SCENARIOS[name], sim, model, "quick", step_seconds=STEP_SECONDS)
        if results is not None:
            # one engine for every scenario, though each scenario's profile is its own leave-one-out fit
            sc.record(simulated, results, {
                **sim.describe(), "name": SIM_ENGINE, "simulated": True, "clock": "step",
                "hardware": "fitted-leave-one-out",
                "hardware_source": "scripts/validate_sim.py: each scenario fitted on every other's served steps",
                "options": {"hardware": "fitted-leave-one-out", "clock": "step"}})
        c = coefficients
        print(f"\n{name}: fitted without it: fixed {c.fixed_s * 1e3:.2f} ms, per seq {c.per_seq_s * 1e6:.0f} us, "
              f"per request {c.per_request_s * 1e6:.0f} us, dense x{c.dense:.2f}, attention x{c.attention:.2f}, "
              f"memory x{c.memory:.2f}; its own step intervals: median error "
              f"{_pct(statistics.median(held)) if held else '-'}\n{header}", flush=True)
        runs = measured[name]
        for j, s_entry in enumerate(simulated.entries):
            rounds = [metrics.summarize(run_.entries[j].trace) for run_ in runs]
            # the median of the rounds: one round carries its own jitter, which no simulator can match
            m, first, again = repeats.aggregate(rounds)[0], rounds[0], rounds[1] if len(rounds) > 1 else {}
            s = metrics.summarize(s_entry.trace)
            label = f"{name} [{runs[0].entries[j].mode or '-'}]"
            for key in TIMES:
                a, b, a1, a2 = m.get(key), s.get(key), first.get(key), again.get(key)
                err = abs(b - a) / a if a and b is not None else None
                spread = abs(a2 - a1) / a1 if a1 and a2 is not None else None
                if err is not None:
                    errors[key].append(err)
                if spread is not None:
                    spreads[key].append(spread)
                print(f"{label:40} {key:20} {_f(a):>11} {_f(a2):>11} {_f(b):>11} {_pct(spread):>7} {_pct(err):>7}")
            for key in COUNTS:
                a, b = m.get(key), s.get(key)
                counts_equal &= a == b
                print(f"{label:40} {key:20} {_f(a):>11} {'':>11} {_f(b):>11} {'':>7} "
                      f"{'equal' if a == b else 'DIFFER':>7}")
    print(f"\nmedian absolute relative error over every result (simulated vs the median of {args.repeats} "
          "measured rounds | round 2 vs round 1):")
    for key in TIMES:
        print(f"  {key:22} {_med(errors[key]):>8} | {_med(spreads[key]):>8}  ({len(errors[key])} results)")
    every, spread = [e for v in errors.values() for e in v], [e for v in spreads.values() for e in v]
    print(f"  {'all timing metrics':22} {_med(every):>8} | {_med(spread):>8}")
    print(f"counts (preemptions by mode, recomputed tokens) equal on the step clock: {counts_equal}")
    if args.profile_out:
        fitted = base.with_coefficients(fit_intervals(cost, [s for v in samples.values() for s in v]),
                                        name="this-machine-served", source="scripts/validate_sim.py: served steps")
        print(f"profile fitted on every scenario written to {fitted.save(args.profile_out)}")
    if results is not None:
        print(f"results and report (section 'Simulator vs measured') written to {write_report(results, args.out)}")
    return 0 if counts_equal else 1


def _med(values: list[float]) -> str:
    return _pct(statistics.median(values)) if values else "-"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:,.4g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


if __name__ == "__main__":
    sys.exit(main())
