"""Fixtures of the storm benchmarks: the model, the engines, threads, progress bars and the runner.

Choices made here, once for every benchmark:

* **Model.** ``--kvbench-model`` if given; else the built-in ``tiny`` checkpoint at ``quick`` scale
  and ``small`` at ``full`` (:data:`kvbench.bench.scenarios.MODEL_PRESETS`). Measured on the 2-core CI
  machine: a batch-8 decode step takes 9-12 ms on ``tiny`` and 123-127 ms on ``small``, so the quick
  suite on ``small`` would blow its ten-minute budget several times over.
* **Threads.** torch's intra-op threads are pinned for the benchmarks (restored afterwards) by the
  policy in :mod:`kvbench.bench.threads`, shared with ``kvbench demo``: ``KVBENCH_TORCH_THREADS``
  if set, else 1 at ``quick`` scale on CPU (on a shared 2-core machine two spinning OpenMP threads
  made steps ten times slower), else torch's default. The number is recorded in every scenario's
  parameters.
* **Progress.** A tqdm bar of requests served per benchmark, on the terminal's stderr (pytest's
  capture is suspended around each write). Shown only on a TTY; hidden with ``-q``, under xdist,
  and when ``KVBENCH_PROGRESS=0``; ``KVBENCH_PROGRESS=1`` forces it.
* **Repeats and clocks.** Every job of a scenario is served ``--benchmark-repeats`` times (3 by
  default); results keep each repeat's figures, their medians and spreads (the gate's noise
  floor). A ``steppable`` engine (the reference engine) runs on the step clock
  (:data:`kvbench.bench.scenarios.base.STEP_SECONDS` virtual seconds per step): arrivals and aborts are
  released by engine step, so its counts are identical every repeat and every run, while its
  times stay on the wall clock. Other engines (hf-cb's own loop thread) run on the wall clock.
* **One measurement per engine configuration.** A scenario that sets the preemption mode itself
  (or never preempts) runs once per engine kind and options: an ``--engine`` that differs from an
  earlier one only in its preemption mode or swap space is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.scenarios.base import STEP_SECONDS
from kvbench.bench.threads import pinned_torch_threads
from kvbench.engines.registry import EngineSpec, make_adapter
from kvbench.plugin import require

#: engine options that only say how to preempt (or where to swap): scenarios that fix the mode ignore them
MODE_OPTIONS = frozenset({"preemption_mode", "swap_space", "num_cpu_blocks_override", "cpu_offload_gib"})


# --------------------------------------------------------------------------------------------
# model and engines


@pytest.fixture(scope="session")
def bench_model(kvbench_session: Any) -> sc.Model:
    if kvbench_session.model:
        return sc.Model.from_dir(kvbench_session.model)
    from kvbench.checkpoints import builtin_checkpoint

    preset = sc.MODEL_PRESETS[kvbench_session.scale]
    return sc.Model.from_dir(builtin_checkpoint(preset), preset)


@pytest.fixture(scope="session")
def bench_engine(request: pytest.FixtureRequest, engine_spec: EngineSpec, bench_model: sc.Model, model_dir: str):
    """The adapter for ``engine_spec`` on the benchmark model (the plugin's ``engine`` when they agree)."""
    if os.path.realpath(bench_model.path) == os.path.realpath(model_dir):
        yield request.getfixturevalue("engine")
        return
    adapter = make_adapter(engine_spec, bench_model.path)
    yield adapter
    adapter.close()


@pytest.fixture
def pinned_threads(kvbench_session: Any) -> Iterator[int]:
    """torch's threads pinned by the policy ``kvbench demo`` shares (:mod:`kvbench.bench.threads`)."""
    with pinned_torch_threads(kvbench_session.scale) as threads:
        yield threads


# --------------------------------------------------------------------------------------------
# progress bars


class _TerminalStream:
    """A file for tqdm that writes to the real stderr, suspending pytest's capture for each write."""

    def __init__(self, capman: Any):
        self.capman = capman
        self.encoding = getattr(sys.__stderr__, "encoding", None) or "utf-8"

    def _suspended(self) -> contextlib.AbstractContextManager:
        return self.capman.global_and_fixture_disabled() if self.capman else contextlib.nullcontext()

    def write(self, text: str) -> int:
        with self._suspended():
            sys.stderr.write(text)
            sys.stderr.flush()
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        with self._suspended():
            return sys.stderr.isatty()


def progress_enabled(config: pytest.Config, stream: _TerminalStream) -> bool:
    forced = os.environ.get("KVBENCH_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    if hasattr(config, "workerinput") or config.get_verbosity() < 0:
        return False
    return stream.isatty()


@contextlib.contextmanager
def progress_bar(config: pytest.Config, total: int, desc: str) -> Iterator[Callable[[int], None] | None]:
    """A callable advancing a bar of ``total`` requests, or None when bars are off."""
    stream = _TerminalStream(config.pluginmanager.getplugin("capturemanager"))
    if not progress_enabled(config, stream):
        yield None
        return
    from tqdm import tqdm

    stream.write("\n")  # off the line pytest is writing the test's name on
    bar = tqdm(total=total, desc=desc, unit="req", file=stream, leave=False, ncols=100, mininterval=0.5)
    try:
        yield bar.update
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------
# the runner


def same_as_earlier(spec: EngineSpec, specs: list[EngineSpec]) -> EngineSpec | None:
    """An ``--engine`` before ``spec`` with the same kind and options, preemption options aside."""
    def key(s: EngineSpec) -> tuple:
        return s.kind, sorted((k, v) for k, v in s.options.items() if k not in MODE_OPTIONS)

    for earlier in specs:
        if earlier == spec:
            return None
        if key(earlier) == key(spec):
            return earlier
    return None


@pytest.fixture
def run_storm(request: pytest.FixtureRequest, bench_engine: Any, bench_model: sc.Model, engine_spec: EngineSpec,
              kvbench_session: Any, kvbench_results: Any, pinned_threads: int) -> Callable[[sc.Scenario], sc.Outcome]:
    """``run_storm(scenario)``: skip if the engine cannot run it, serve it, record it, assert its claims."""

    def run(scenario: sc.Scenario) -> sc.Outcome:
        require(bench_engine, *scenario.needs)
        for knob in scenario.knobs_needed:
            if knob in bench_engine.unsupported_knobs:
                pytest.skip(f"{bench_engine.name} cannot set {knob}: {bench_engine.unsupported_knobs[knob]}")
        if not scenario.engine_mode_matters:
            earlier = same_as_earlier(engine_spec, kvbench_session.engine_specs)
            if earlier is not None:
                pytest.skip(f"{scenario.name} does not depend on the engine's preemption mode: measured already on "
                            f"{earlier.name}")
        scale, repeats = kvbench_session.scale, kvbench_session.repeats
        total = scenario.num_requests(scale, bench_model) * repeats
        with progress_bar(request.config, total, f"{scenario.name} [{bench_engine.name}]") as progress:
            outcome = sc.run(scenario, bench_engine, bench_model, scale, progress, repeats=repeats,
                             step_seconds=STEP_SECONDS[scale])
        outcome.parameters["torch_threads"] = pinned_threads
        outcome.parameters["repeats"] = repeats
        outcome.parameters["clock"] = ("wall" if outcome.step_seconds is None else
                                       f"step ({outcome.step_seconds:g} s per engine step)")
        sc.record(outcome, kvbench_results, bench_engine.describe(), slos=kvbench_session.slos)
        assert not outcome.failures(), outcome.explain()
        return outcome

    return run
