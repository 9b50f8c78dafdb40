"""Fixtures of the storm benchmarks: the model, the engines, threads, progress bars and the runner.

Choices made here, once for every benchmark:

* **Model.** ``--kvbench-model`` if given; else the built-in ``tiny`` checkpoint at ``quick`` scale
  and ``small`` at ``full`` (:data:`kvbench.bench.scenarios.MODEL_PRESETS`). Measured on the 2-core CI
  machine: a batch-8 decode step takes 9-12 ms on ``tiny`` and 123-127 ms on ``small``, so the quick
  suite on ``small`` would blow its ten-minute budget several times over.
* **Threads.** torch's intra-op threads are pinned for the benchmarks (restored afterwards) by the
  policy in :mod:`kvbench.bench.threads`, shared with ``kvbench demo``: ``KVBENCH_TORCH_THREADS``
  if set, else 1 on CPU at both scales (on a shared 2-core machine two spinning OpenMP threads
  made steps ten times slower), else torch's default. The number is recorded in every scenario's
  parameters.
* **Progress.** A tqdm bar of requests served per benchmark, on the terminal's stderr (pytest's
  capture is suspended around each write). Shown only on a TTY; hidden with ``-q``, under xdist,
  and when ``KVBENCH_PROGRESS=0``; ``KVBENCH_PROGRESS=1`` forces it.
* **Repeats and clocks.** Every job of a scenario is served ``--benchmark-repeats`` times (3 by
  default at ``quick`` scale, 1 at ``full``: :data:`kvbench.plugin.DEFAULT_REPEATS`); results keep
  each repeat's figures, their medians and spreads (the gate's noise floor), and the number in every
  scenario's parameters.
* **One clock per session** (:mod:`kvbench.bench.clock_rule`), decided once from every ``--engine``
  given: when all of them are ``steppable`` (the reference engine), all run on the step clock
  (:data:`kvbench.bench.scenarios.common.STEP_SECONDS` virtual seconds per step): arrivals and aborts
  are released by engine step, so counts are identical every repeat and every run (exact gating),
  while times stay on the wall clock. When any is not (hf-cb's own loop thread, a server), every
  engine runs on the wall clock, the reference engine included, so every engine is ranked against
  every other on one clock. The decision is written to results.json (``clock_rule``).
* **Engines interleaved.** pytest shows one test per scenario and engine, but a scenario is served
  once per session on all its engines together (:class:`StormScheduler`): the first of its tests
  to run serves round 1 of every job on every engine (job by job, engine after engine), then
  round 2, and so on (:func:`kvbench.bench.scenarios.run_interleaved`); each test then records
  and judges its own engine's outcome. So repeat i of an engine and repeat i of the reference
  engine are measured seconds apart, and the gate's same-run ratios per repeat cancel a machine
  whose load drifts over minutes. The engines of a scenario are those whose test for it is
  selected in this session (``-k`` and shards respected) and not skipped; the first test's time
  includes the others' serving. An engine that raises while served fails only its own test.
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
from kvbench.bench.clock_rule import ClockRule, session_clock
from kvbench.bench.scenarios.common import STEP_SECONDS
from kvbench.bench.server_release import Planned, ServerRelease, function_of
from kvbench.bench.threads import pinned_torch_threads
from kvbench.engines.base import EngineAdapter
from kvbench.engines.registry import EngineSpec, adapter_class, make_adapter

#: engine options that only say how to preempt (or where to swap): scenarios that fix the mode ignore them
MODE_OPTIONS = frozenset({"preemption_mode", "swap_space", "num_cpu_blocks_override", "cpu_offload_gib"})


# --------------------------------------------------------------------------------------------
# model and engines


@pytest.fixture(scope="session")
def bench_model(kvbench_session: Any) -> sc.Model:
    if kvbench_session.model:
        return sc.Model.from_dir(kvbench_session.model)
    from kvbench.models.builtin import checkpoint_for
    from kvbench.plugin import engine_layouts

    # shaped so that every engine of the run loads it (vLLM's CPU attention: head size 32 and up)
    preset = sc.MODEL_PRESETS[kvbench_session.scale]
    return sc.Model.from_dir(checkpoint_for(engine_layouts(kvbench_session.engine_specs), preset), preset)


@pytest.fixture(scope="session")
def storm_scheduler(kvbench_session: Any, bench_model: sc.Model) -> Iterator[StormScheduler]:
    """The session's :class:`StormScheduler`; closes every adapter it made at the end of the session."""
    scheduler = StormScheduler(kvbench_session, bench_model)
    yield scheduler
    scheduler.close()


@pytest.fixture(scope="session")
def bench_engine(engine_spec: EngineSpec, storm_scheduler: StormScheduler) -> EngineAdapter:
    """The adapter for ``engine_spec`` on the benchmark model (one per spec, shared by the benchmarks)."""
    return storm_scheduler.adapter(engine_spec)


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


def skip_reason(scenario: sc.Scenario, adapter: EngineAdapter, spec: EngineSpec,
                specs: list[EngineSpec]) -> str | None:
    """Why ``scenario`` does not run on this engine (the reason its test is skipped with), or None."""
    missing = [c for c in scenario.needs if c not in adapter.capabilities]
    if missing:
        return f"{adapter.name} lacks capability {', '.join(missing)}"
    for knob in scenario.knobs_needed:
        if knob in adapter.unsupported_knobs:
            return f"{adapter.name} cannot set {knob}: {adapter.unsupported_knobs[knob]}"
    if not scenario.engine_mode_matters:
        earlier = same_as_earlier(spec, specs)
        if earlier is not None:
            return (f"{scenario.name} does not depend on the engine's preemption mode: measured already on "
                    f"{earlier.name}")
    return None


class StormScheduler:
    """Serves every scenario once per session on all its engines, interleaved, and hands each
    engine's test its outcome (see the module docstring, "Engines interleaved").

    Contract: :meth:`outcome` for (test item, scenario) serves the scenario, on its first call, on
    every engine of :meth:`engines_for`, and returns this item's engine's :class:`~kvbench.bench.
    scenarios.Outcome` (re-raising what serving that engine raised); later calls for the other
    engines return theirs without serving again. An outcome is handed out once and then dropped.
    """

    def __init__(self, ks: Any, model: sc.Model):
        self.ks = ks
        self.model = model
        self._adapters: dict[str, EngineAdapter] = {}  # by spec name (specs are not hashable)
        #: stops the servers of engines no later test needs (kvbench.bench.server_release), made at the first test
        self.release: ServerRelease | None = None
        self._runs: dict[tuple[str, str], dict[str, sc.Outcome | Exception]] = {}
        #: the session's one clock, from every --engine given (not from a scenario's selection), so that
        #: every scenario of the run is measured on the same clock
        self.clock: ClockRule = session_clock(
            {spec.name: bool(getattr(adapter_class(spec.kind), "steppable", False)) for spec in ks.engine_specs},
            STEP_SECONDS[ks.scale])

    def adapter(self, spec: EngineSpec) -> EngineAdapter:
        """The one adapter of ``spec`` on the benchmark model, made on first use."""
        if spec.name not in self._adapters:
            adapter = make_adapter(spec, self.model.path)
            adapter.configure_run(liveness=self.ks.liveness)
            self._adapters[spec.name] = adapter
        return self._adapters[spec.name]

    def engines_for(self, item: pytest.Item, scenario: sc.Scenario) -> list[EngineSpec]:
        """The specs, in ``--engine`` order, whose test of the same function as ``item`` is selected in
        this session and not skipped for ``scenario``."""
        specs = self.ks.engine_specs
        selected = {getattr(_spec_of(other), "name", None) for other in item.session.items
                    if other.path == item.path and getattr(other, "originalname", None) == item.originalname}
        return [spec for spec in specs if spec.name in selected
                and skip_reason(scenario, self.adapter(spec), spec, specs) is None]

    def outcome(self, item: pytest.Item, spec: EngineSpec, scenario: sc.Scenario,
                progress_for: Callable[[int, str], contextlib.AbstractContextManager]) -> sc.Outcome:
        """``spec``'s outcome of ``scenario``, serving it on every engine first if nobody has yet.
        ``progress_for(total, description)`` opens a progress bar for the serving."""
        key = (item.nodeid.split("[")[0], scenario.name)
        if key not in self._runs:
            engines = self.engines_for(item, scenario)
            if spec.name not in {s.name for s in engines}:  # not among the selected (a direct call): alone
                engines = [spec]
            scale, repeats = self.ks.scale, self.ks.repeats
            total = scenario.num_requests(scale, self.model) * repeats * len(engines)
            names = ", ".join(s.name for s in engines)
            with progress_for(total, f"{scenario.name} [{names}]") as progress:
                self._runs[key] = sc.run_interleaved(
                    scenario, {s.name: self.adapter(s) for s in engines}, self.model, scale, progress,
                    repeats=repeats, step_seconds=self.clock.step_seconds)
            self._release_for(item).mark_served(item.nodeid)
        runs = self._runs[key]
        if spec.name not in runs:  # selected after its scenario was served (not expected): serve it alone
            runs[spec.name] = sc.run_interleaved(scenario, {spec.name: self.adapter(spec)}, self.model,
                                                 self.ks.scale, None, repeats=self.ks.repeats,
                                                 step_seconds=self.clock.step_seconds)[spec.name]
        outcome = runs.pop(spec.name)
        if not runs:
            del self._runs[key]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def release_after(self, item: pytest.Item, ran: bool) -> list[str]:
        """After ``item``'s test (``ran``: it passed or failed, so its scenario was served): stop the servers of
        the engines no later test of the session needs (:mod:`kvbench.bench.server_release`); returns those
        engines. Not under xdist, whose workers run tests in the order the controller sends them."""
        if hasattr(item.config, "workerinput"):
            return []
        release = self._release_for(item)
        if ran:
            release.mark_served(item.nodeid)
        return release.after(item.nodeid, self._adapters)

    def _release_for(self, item: pytest.Item) -> ServerRelease:
        """The session's :class:`ServerRelease`, planned from its tests in run order on first use."""
        if self.release is None:
            self.release = ServerRelease([(i.nodeid, Planned(function_of(i.nodeid), getattr(_spec_of(i), "name", None)))
                                          for i in item.session.items])
        return self.release

    def close(self) -> None:
        """Close every adapter made (servers an adapter started are stopped by its ``close``)."""
        adapters, self._adapters = list(self._adapters.values()), {}
        for adapter in adapters:
            adapter.close()


_RAN = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Note a test that passed or failed (rather than skipped): its scenario was served."""
    report = yield
    if report.when == "call" and not report.skipped:
        item.stash[_RAN] = True
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the servers no later benchmark test needs (:meth:`StormScheduler.release_after`)."""
    scheduler = (getattr(item, "funcargs", None) or {}).get("storm_scheduler")
    if isinstance(scheduler, StormScheduler):
        scheduler.release_after(item, item.stash.get(_RAN, False))


def _spec_of(item: pytest.Item) -> EngineSpec | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("engine_spec") if callspec is not None else None


@pytest.fixture
def run_storm(request: pytest.FixtureRequest, storm_scheduler: StormScheduler, bench_model: sc.Model,
              engine_spec: EngineSpec, kvbench_session: Any, kvbench_results: Any,
              pinned_threads: int) -> Callable[[sc.Scenario], sc.Outcome]:
    """``run_storm(scenario)``: skip if the engine cannot run it, else take its outcome from the
    interleaved serving of the scenario (:class:`StormScheduler`), record it, assert its claims."""

    def run(scenario: sc.Scenario) -> sc.Outcome:
        adapter = storm_scheduler.adapter(engine_spec)
        reason = skip_reason(scenario, adapter, engine_spec, kvbench_session.engine_specs)
        if reason:
            pytest.skip(reason)
        outcome = storm_scheduler.outcome(request.node, engine_spec, scenario,
                                          lambda total, desc: progress_bar(request.config, total, desc))
        outcome.parameters["torch_threads"] = pinned_threads
        outcome.parameters["repeats"] = kvbench_session.repeats
        outcome.parameters["clock"] = ("wall" if outcome.step_seconds is None else
                                       f"step ({outcome.step_seconds:g} s per engine step)")
        kvbench_results.data["clock_rule"] = storm_scheduler.clock.to_dict()
        if outcome.interleaved:
            outcome.parameters["interleaved"] = ", ".join(outcome.interleaved)
        sc.record(outcome, kvbench_results, adapter.describe(), slos=kvbench_session.slos)
        assert not outcome.failures(), outcome.explain()
        return outcome

    return run
