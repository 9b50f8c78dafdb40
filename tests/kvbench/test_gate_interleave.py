"""The runner the gate's ratios rely on: engines' repeats served in the same rounds, steppable
engines in lockstep on their own clocks, and a broken engine failing only itself."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.scenarios.common import SANITY_CLAIM
from kvbench.bench.workloads import Workload
from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import StepRecord
from kvbench.drivers.lockstep import Baton, serve_lockstep
from kvbench.drivers.step_loop import StepReport, drive
from kvbench.engines.base import DEFAULT_KNOBS, EngineAdapter

MODEL = sc.Model("/nonexistent", "tiny", 512, 1024)


def workload(name: str, n: int = 2, tokens: int = 3) -> Workload:
    reqs = [WorkloadRequest(f"{name}-{i}", [1, 2, 3], tokens, 0.0) for i in range(n)]
    return Workload(name, reqs, None, {"name": name})


class TwoJobs(sc.Scenario):
    """Two tiny jobs; the judge claims only that every request finished."""

    name = "two_jobs"
    sizes = {"quick": None}  # noqa: RUF012

    def plan(self, scale, model):
        return [sc.Job(workload("job1"), DEFAULT_KNOBS, mode="a"), sc.Job(workload("job2"), DEFAULT_KNOBS, mode="b")]

    def parameters(self, scale, model):
        return {"scale": scale}

    def judge(self, served, scale, model):
        outcome = self.outcome(scale, model)
        outcome.entries = [sc.ResultEntry(s.trace, s.job.mode) for s in served]
        outcome.claims = {SANITY_CLAIM: all(sc.all_finished(s.trace) for s in served)}
        return outcome


class FakeTime:
    """A stand-in for the ``time`` module of :mod:`kvbench.drivers.lockstep` whose ``perf_counter``
    moves only when a fake step says so: durations are then exact, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Engine:
    """A steppable engine: every running request gets one token per step; each step logs its name
    and takes ``step_s``: slept, or added to ``fake_time`` when one is given."""

    def __init__(self, name: str, log: list[str], step_s: float, fake_time: FakeTime | None = None):
        self.name, self.log, self.step_s, self.fake_time = name, log, step_s, fake_time
        self.left: dict[str, int] = {}

    def submit(self, request: Any) -> None:
        self.left[request.request_id] = request.max_tokens

    def abort(self, request_id: str) -> None:  # pragma: no cover - no aborts here
        self.left.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.left)

    def step(self) -> StepReport:
        self.log.append(self.name)
        if self.fake_time is not None:
            self.fake_time.now += self.step_s
        else:
            time.sleep(self.step_s)
        new = dict.fromkeys(self.left, 1)
        for rid in new:
            self.left[rid] -= 1
        done = {rid: "length" for rid, n in self.left.items() if n == 0}
        for rid in done:
            del self.left[rid]
        return StepReport(new, done, [], [], [], StepRecord(0.0, 0.0, len(self.left), 0))


class FakeAdapter(EngineAdapter):
    """Serves through the step driver (``steppable``) or, with ``steppable=False``, the same loop but
    declared unsteppable; logs "serve <job>" and every step; ``fail_on`` a job name raises there."""

    kind = "fake"
    capabilities = frozenset()

    def __init__(self, name: str, log: list[str], *, steppable: bool = True, step_s: float = 0.0,
                 fail_on: str | None = None, fake_time: FakeTime | None = None):
        super().__init__("/nonexistent", name=name)
        self.log, self.steppable, self.step_s, self.fail_on = log, steppable, step_s, fail_on
        self.fake_time = fake_time

    def generate(self, requests, knobs=DEFAULT_KNOBS):  # pragma: no cover - not used
        raise NotImplementedError

    def serve(self, workload, recorder, knobs=DEFAULT_KNOBS, step_seconds=None) -> None:
        self.log.append(f"serve {self.name} {workload.name}")
        if workload.name == self.fail_on:
            raise RuntimeError(f"{self.name} broke on {workload.name}")
        drive(_Engine(self.name, self.log, self.step_s, self.fake_time), workload.requests, recorder,
              step_seconds=step_seconds)


def test_rounds_serve_each_job_on_every_engine_before_the_next_job():
    log: list[str] = []
    adapters = {n: FakeAdapter(n, log, steppable=False) for n in ("A", "B")}
    result = sc.run_interleaved(TwoJobs(), adapters, MODEL, "quick", repeats=2)
    serves = [line for line in log if line.startswith("serve")]
    assert serves == ["serve A job1", "serve B job1", "serve A job2", "serve B job2"] * 2
    for name in ("A", "B"):
        outcome = result[name]
        assert isinstance(outcome, sc.Outcome) and len(outcome.repeats) == 2
        assert outcome.interleaved == ("A", "B") and not outcome.failures()


def test_steppable_engines_take_turns_step_by_step():
    log: list[str] = []
    adapters = {n: FakeAdapter(n, log) for n in ("A", "B")}
    sc.run_interleaved(TwoJobs(), adapters, MODEL, "quick", repeats=1, step_seconds=0.01)
    steps = [line for line in log if not line.startswith("serve")]
    # each job: 3 steps per engine, alternating A B A B A B
    assert steps == ["A", "B"] * 6


def test_each_engine_is_timed_on_its_own_clock(monkeypatch: pytest.MonkeyPatch):
    """B's slow steps are not A's time: A's trace measures only A's own steps.

    The lockstep clock reads a fake ``perf_counter`` that only the engines' steps move (A's take no
    time, B's 50 ms each), so the durations are exact: with real sleeps a loaded machine could
    stall A's own steps for as long as B's and the comparison would say nothing."""
    import kvbench.drivers.lockstep as lockstep

    fake = FakeTime()
    monkeypatch.setattr(lockstep, "time", fake)
    log: list[str] = []
    adapters = {"A": FakeAdapter("A", log, step_s=0.0, fake_time=fake),
                "B": FakeAdapter("B", log, step_s=0.05, fake_time=fake)}
    result = sc.run_interleaved(TwoJobs(), adapters, MODEL, "quick", repeats=1, step_seconds=0.01)
    a, b = (result[n].entries[0].trace for n in ("A", "B"))
    assert fake.now == pytest.approx(2 * 3 * 0.05)  # both jobs' B steps ran on the fake clock
    assert b.duration == pytest.approx(3 * 0.05)  # B's three steps
    assert a.duration == pytest.approx(0.0, abs=1e-9)  # A never waits its 3 x 50 ms for B inside its own time
    first_token_gaps = [r.token_times[0] - r.arrival for r in a.requests.values()]
    assert max(first_token_gaps) == pytest.approx(0.0, abs=1e-9)


def test_a_broken_engine_fails_only_itself():
    log: list[str] = []
    adapters = {"A": FakeAdapter("A", log, fail_on="job2"), "B": FakeAdapter("B", log)}
    result = sc.run_interleaved(TwoJobs(), adapters, MODEL, "quick", repeats=2, step_seconds=0.01)
    assert isinstance(result["A"], RuntimeError) and "A broke on job2" in str(result["A"])
    assert isinstance(result["B"], sc.Outcome) and len(result["B"].repeats) == 2
    assert [line for line in log if line.startswith("serve A")] == ["serve A job1", "serve A job2"]  # dropped after
    with pytest.raises(RuntimeError, match="A broke on job2"):
        sc.run(TwoJobs(), FakeAdapter("A", [], fail_on="job2"), MODEL, "quick", repeats=1)


def test_recorded_results_say_which_engines_shared_the_rounds():
    from kvbench.bench.results import Results

    log: list[str] = []
    adapters = {n: FakeAdapter(n, log) for n in ("A", "B")}
    result = sc.run_interleaved(TwoJobs(), adapters, MODEL, "quick", repeats=2, step_seconds=0.01)
    results = Results()
    sc.record(result["A"], results, {"name": "A", "kind": "fake"})
    entry = results.scenario("two_jobs")["results"][0]
    assert entry["clock"]["interleaved"] == ["A", "B"] and len(entry["repeats"]) == 2
    assert entry["clock"]["exact_counts"] is True


def test_baton_rotation_and_leaving():
    baton = Baton(["A", "B", "C"])
    baton.wait_turn("A")  # A holds it: returns at once
    baton.pass_on("A")
    baton.leave("B")  # B leaves while holding it: C is next
    baton.wait_turn("C")
    baton.pass_on("B")  # not the holder: nothing moves
    baton.wait_turn("C")


def test_serve_lockstep_hands_back_each_participants_exception():
    def ok(recorder):
        recorder.step(StepRecord(0.0, 0.0, 0, 0))

    def broken(recorder):
        raise ValueError("nope")

    out = serve_lockstep({"A": ("A", "s", ok), "B": ("B", "s", broken)})
    assert len(out["A"].steps) == 1 and isinstance(out["B"], ValueError)


def test_step_delay_option_is_a_validated_testing_aid():
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    ReferenceAdapter.validate_options({"step_delay_ms": "5", "preemption_mode": "swap"})
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match="step_delay_ms"):
            ReferenceAdapter.validate_options({"step_delay_ms": bad})
    adapter = ReferenceAdapter("/nonexistent", {"step_delay_ms": "5"})
    assert adapter.step_delay == pytest.approx(0.005)
    assert adapter.engine_config().model == "/nonexistent"  # not an EngineConfig field: left out of it
    assert ReferenceAdapter("/nonexistent").step_delay == 0


# ------------------------------------------------------------------------------------------------
# the benchmarks' scheduler: one interleaved serving per scenario, shared by its engines' tests


class _Item:
    """What StormScheduler reads of a pytest item: path, function name, engine param, the session's items."""

    def __init__(self, spec, session, name: str = "test_two_jobs"):
        from types import SimpleNamespace

        self.path, self.originalname, self.session = "suites/benchmarks/test_storms.py", name, session
        self.callspec = SimpleNamespace(params={"engine_spec": spec})
        self.nodeid = f"{self.path}::{name}[{spec.name}]"


def _scheduler(monkeypatch, log: list[str], specs):
    from types import SimpleNamespace

    import suites.benchmarks.conftest as bench

    monkeypatch.setattr(bench, "make_adapter", lambda spec, path: FakeAdapter(spec.name, log))
    ks = SimpleNamespace(engine_specs=specs, scale="quick", repeats=2, liveness=None)
    return bench.StormScheduler(ks, MODEL)


def _no_bar(total, desc):
    import contextlib

    return contextlib.nullcontext(None)


def test_a_scenario_is_served_once_on_all_its_selected_engines(monkeypatch):
    from types import SimpleNamespace

    from kvbench.engines.registry import parse_engine_spec

    specs = [parse_engine_spec("reference"), parse_engine_spec("reference:preemption_mode=swap")]
    log: list[str] = []
    scheduler = _scheduler(monkeypatch, log, specs)
    session = SimpleNamespace(items=[])
    items = [_Item(s, session) for s in specs]
    session.items = items
    first = scheduler.outcome(items[0], specs[0], TwoJobs(), _no_bar)
    served = [line for line in log if line.startswith("serve")]
    assert served == [f"serve {n} {j}" for _ in range(2) for j in ("job1", "job2") for n in (s.name for s in specs)]
    assert first.interleaved == tuple(s.name for s in specs)
    second = scheduler.outcome(items[1], specs[1], TwoJobs(), _no_bar)
    assert [line for line in log if line.startswith("serve")] == served  # taken, not served again
    assert len(second.repeats) == 2 and not scheduler._runs  # handed out once, then dropped


def test_a_deselected_engine_is_not_served(monkeypatch):
    from types import SimpleNamespace

    from kvbench.engines.registry import parse_engine_spec

    specs = [parse_engine_spec("reference"), parse_engine_spec("reference:preemption_mode=swap")]
    log: list[str] = []
    scheduler = _scheduler(monkeypatch, log, specs)
    session = SimpleNamespace(items=[])
    session.items = [_Item(specs[1], session)]  # -k selected only the swap engine's test
    outcome = scheduler.outcome(session.items[0], specs[1], TwoJobs(), _no_bar)
    assert {line.split()[1] for line in log if line.startswith("serve")} == {specs[1].name}
    assert outcome.interleaved == ()
