"""``kvbench validate-sim``: the simulator against the reference engine, side by side in one run.

1. **Measure**: each chosen quick scenario is served on the reference engine (step clock, 10 ms per
   step, wall-clock timings), ``repeats`` rounds interleaved (every scenario once, then again), after
   ``warmup`` rounds thrown away, with each engine step's shape (what the scheduler handed the runner)
   recorded beside the trace.
2. **Fit what the driver sees**: the cost model's coefficients plus a per-request term are fitted to
   the *interval* from one step's end to the next (the engine step plus the driver's per-step work and
   the releases before the step), not to ``LLMEngine.step()`` timed alone, which misses the host-side
   share of a served step (docs/simulator.md#calibration).
3. **Simulate, leaving the scenario out**: scenario X runs on ``sim`` (``clock=step``, so the same
   requests are released before the same steps and every count must equal the reference engine's)
   with a profile fitted on every *other* scenario's steps of this same run; with one scenario chosen,
   on its own steps (said in the output).

:func:`validate` returns a :class:`Validation`: per result and timing metric the measured rounds, the
simulated value, the error against the rounds' median and the rounds' spread
(:func:`kvbench.bench.repeats.relative_range`: how far one measurement is from another here, the floor
under any simulator's error on this machine); whether every count (preemptions by mode, recomputed
tokens) is equal. With ``keep_results`` it also holds kvbench's own results of the run (``kvbench
validate-sim --out DIR`` writes them with their report): per scenario the reference engine's rounds and
the leave-one-out simulation, the latter under the one engine name :data:`SIM_ENGINE` (marked simulated,
clock=step), so the report's "Simulator vs measured" section shows the comparison.
Figures: docs/journal/measurements.md#the-simulator.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.bench import metrics, repeats
from kvbench.bench import scenarios as sc
from kvbench.bench.formatting import fmt_figure, fmt_median_range, fmt_share
from kvbench.bench.results import Results
from kvbench.engines.registry import EngineSpec, make_adapter, parse_engine_spec
from kvbench.sim.calibration import base_profile, interval_samples, recording
from reference_engine.costs import CostModel, load_model_shape
from reference_engine.sim.calibrate import Design, IntervalSample, fit_intervals, interval_errors

TIMES = ("output_throughput", "ttft_p50", "ttft_p99", "tbt_p99")
COUNTS = ("preemptions_recompute", "preemptions_swap", "recomputed_tokens")
STEP_SECONDS = 0.01
#: the scale every scenario is served at (sizes that run in seconds on a CPU)
SCALE = "quick"
#: the simulated engine's name in the results written: one name for every scenario's leave-one-out fit
SIM_ENGINE = "sim:hardware=fitted-leave-one-out,clock=step"


@dataclass(frozen=True)
class Comparison:
    """One figure of one result: the measured rounds, the simulated value, and (times) the error
    against the rounds' median and the rounds' spread; (counts) whether simulated equals measured."""

    result: str
    metric: str
    rounds: tuple[float | None, ...]
    simulated: float | None

    @property
    def is_count(self) -> bool:
        return self.metric in COUNTS

    @property
    def measured(self) -> float | None:
        """The median of the rounds: one round carries its own jitter, which no simulator can match."""
        return repeats.median(self.rounds)

    @property
    def error(self) -> float | None:
        m, s = self.measured, self.simulated
        return abs(s - m) / abs(m) if m and s is not None else None

    @property
    def rounds_range(self) -> float | None:
        return repeats.relative_range(self.rounds)

    @property
    def equal(self) -> bool:
        return self.measured == self.simulated


@dataclass
class Validation:
    """What :func:`validate` found: every comparison, per scenario the fit's summary line."""

    scenarios: list[str]
    rounds: int
    comparisons: list[Comparison] = field(default_factory=list)
    fits: dict[str, str] = field(default_factory=dict)
    #: kvbench's results of the run (``keep_results``): the rounds and the simulation, for the report
    results: Results | None = None

    @property
    def counts_equal(self) -> bool:
        """Every count of every result equal on the step clock (the simulator runs the engine's scheduler)."""
        return all(c.equal for c in self.comparisons if c.is_count)

    def median_error(self, metric: str | None = None) -> float | None:
        """Median relative error of the timing metric ``metric`` (None: every timing metric pooled)."""
        return repeats.median([c.error for c in self._times(metric)])

    def median_rounds_range(self, metric: str | None = None) -> float | None:
        """Median rounds' spread of ``metric`` (None: pooled), the noise beside :meth:`median_error`."""
        return repeats.median([c.rounds_range for c in self._times(metric)])

    def _times(self, metric: str | None) -> list[Comparison]:
        return [c for c in self.comparisons if not c.is_count and (metric is None or c.metric == metric)]

    def text(self) -> str:
        """Every comparison as a table per scenario, then the medians and the counts' verdict."""
        header = f"{'result [mode]':40} {'metric':22} {'measured median [min-max]':>34} {'simulated':>11} " \
                 f"{'spread':>7} {'error':>7}"
        lines: list[str] = []
        for name in self.scenarios:
            lines += ["", f"{name}: {self.fits.get(name, '')}", header]
            for c in (c for c in self.comparisons if c.result.split(" [")[0] == name):
                measured = fmt_median_range([v for v in c.rounds if v is not None], "{:,.4g}")
                verdict = ("equal" if c.equal else "DIFFER") if c.is_count else fmt_share(c.error, "-")
                spread = "" if c.is_count else fmt_share(c.rounds_range, "-")
                simulated = fmt_figure(c.simulated, "{:,.4g}", "-")
                lines.append(f"{c.result:40} {c.metric:22} {measured:>34} {simulated:>11} {spread:>7} "
                             f"{verdict:>7}")
        lines += ["", f"median relative error over every result (simulated vs the median of {self.rounds} measured "
                  "rounds | the rounds' spread, (max - min) / median):"]
        for key in TIMES:
            error, rounds_range = fmt_share(self.median_error(key), "-"), fmt_share(self.median_rounds_range(key), "-")
            lines.append(f"  {key:22} {error:>8} | {rounds_range:>8}  "
                         f"({len([c for c in self._times(key) if c.error is not None])} results)")
        pooled_error, pooled_range = fmt_share(self.median_error(), "-"), fmt_share(self.median_rounds_range(), "-")
        lines.append(f"  {'all timing metrics':22} {pooled_error:>8} | {pooled_range:>8}")
        lines.append(f"counts (preemptions by mode, recomputed tokens) equal on the step clock: {self.counts_equal}")
        return "\n".join(lines)


def check_scenarios(names: Sequence[str]) -> list[str]:
    """``names`` (empty: every scenario) checked against the scenarios; ValueError naming an unknown
    one and the known ones."""
    unknown = [n for n in names if n not in sc.SCENARIOS]
    if unknown:
        raise ValueError(f"scenario {unknown[0]!r} is unknown; expected one of {', '.join(sc.SCENARIOS)}")
    return list(dict.fromkeys(names)) or list(sc.SCENARIOS)


def validate(model_dir: str, names: Sequence[str] = (), rounds: int = 2, warmup: int = 1,
             keep_results: bool = False, profile_out: str | Path | None = None,
             say: Callable[[str], None] = print) -> Validation:
    """Measure, fit leaving each scenario out, simulate it, compare (see the module docstring).

    ``rounds`` >= 1 measured rounds (2 or more give the spread), ``warmup`` >= 0 rounds served first and
    thrown away (a process's first round ran up to 2x slower: torch and the allocator warming up).
    ``keep_results``: also fill :attr:`Validation.results` (what ``--out`` renders). ``profile_out``: also
    save the profile fitted on every scenario there. ValueError for a bad count or an unknown scenario,
    before anything is served."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    names = check_scenarios(names)
    say(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    base = base_profile(model_dir, Design(), "served-fit")  # peak rates and swap terms, as kvbench calibrate
    cost = CostModel(load_model_shape(model_dir), base)
    model = sc.Model.from_dir(model_dir, "tiny")

    for r in range(warmup):  # neither fitted nor compared
        for name in names:
            t0 = time.perf_counter()
            sc.run(sc.SCENARIOS[name], make_adapter(EngineSpec("reference"), model_dir), model, SCALE,
                   step_seconds=STEP_SECONDS)
            say(f"warm-up {r + 1}: {name} in {time.perf_counter() - t0:.0f} s")

    measured, samples, described = _measure(model_dir, model, names, rounds, say)
    results = Results(device="cpu") if keep_results else None
    if results is not None:  # every round: the results keep each repeat and their medians
        for name in names:
            first = measured[name][0]
            first.repeats = measured[name]
            sc.record(first, results, described)

    found = Validation(names, rounds, results=results)
    folder = tempfile.mkdtemp(prefix="kvbench-validate-sim-")
    for name in names:
        others = [s for n in names if n != name for s in samples[n]]
        coefficients = fit_intervals(cost, others or samples[name])
        profile = base.with_coefficients(coefficients, name=f"fit-without-{name}")
        held = interval_errors(CostModel(cost.model, profile), samples[name])
        path = profile.save(os.path.join(folder, f"{name}.json"))
        sim = make_adapter(parse_engine_spec(f"sim:hardware={path},clock=step"), model_dir)
        simulated = sc.run(sc.SCENARIOS[name], sim, model, SCALE, step_seconds=STEP_SECONDS)
        if results is not None:
            # one engine for every scenario, though each scenario's profile is its own leave-one-out fit
            sc.record(simulated, results, {
                **sim.describe(), "name": SIM_ENGINE, "simulated": True, "clock": "step",
                "hardware": "fitted-leave-one-out",
                "hardware_source": "kvbench validate-sim: each scenario fitted on every other's served steps",
                "options": {"hardware": "fitted-leave-one-out", "clock": "step"}})
        c = coefficients
        found.fits[name] = (
            f"fitted {'without it' if others else 'on itself (the only scenario chosen)'}: fixed "
            f"{c.fixed_s * 1e3:.2f} ms, per seq {c.per_seq_s * 1e6:.0f} us, "
            f"per request {c.per_request_s * 1e6:.0f} us, "
            f"dense x{c.dense:.2f}, attention x{c.attention:.2f}, memory x{c.memory:.2f}; its own step intervals: "
            f"median error {fmt_share(statistics.median(held) if held else None, '-')}")
        for j, s_entry in enumerate(simulated.entries):
            served = [metrics.summarize(run.entries[j].trace) for run in measured[name]]
            s = metrics.summarize(s_entry.trace)
            label = f"{name} [{measured[name][0].entries[j].mode or '-'}]"
            for key in TIMES + COUNTS:
                found.comparisons.append(Comparison(label, key, tuple(m.get(key) for m in served), s.get(key)))
    if profile_out is not None:
        fitted = base.with_coefficients(fit_intervals(cost, [s for v in samples.values() for s in v]),
                                        name="this-machine-served", source="kvbench validate-sim: served steps")
        say(f"profile fitted on every scenario written to {fitted.save(profile_out)}")
    return found


def _measure(model_dir: str, model: sc.Model, names: list[str], rounds: int, say: Callable[[str], None]
             ) -> tuple[dict[str, list[Any]], dict[str, list[IntervalSample]], dict[str, Any]]:
    """``rounds`` interleaved rounds of every scenario on the reference engine, recording step shapes:
    (outcomes per scenario, interval samples per scenario, the engine's description)."""
    measured: dict[str, list[Any]] = {n: [] for n in names}
    samples: dict[str, list[IntervalSample]] = {n: [] for n in names}
    described: dict[str, Any] = {}
    for r in range(rounds):
        for name in names:
            real = recording(make_adapter(EngineSpec("reference"), model_dir))
            t0 = time.perf_counter()
            outcome = sc.run(sc.SCENARIOS[name], real, model, SCALE, step_seconds=STEP_SECONDS)
            say(f"round {r + 1}: {name} measured in {time.perf_counter() - t0:.0f} s (load {os.getloadavg()[0]:.1f})")
            measured[name].append(outcome)
            described = described or real.describe()
            runs = list(real.shape_runs)  # one per engine built; a sweep's points are not entries
            for entry in outcome.entries:
                shapes = next((run for run in runs if len(run) == len(entry.trace.steps)), None)
                if shapes is None:
                    say(f"  {name}: no engine's steps match an entry of {len(entry.trace.steps)} steps; "
                        "left out of the fit")
                    continue
                runs.remove(shapes)
                samples[name] += interval_samples(entry.trace, shapes, name)
    return measured, samples, described
