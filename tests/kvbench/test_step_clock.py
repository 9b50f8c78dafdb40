"""The step clock: arrivals and aborts released by engine step, so counts repeat exactly run to run."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvbench.bench.workloads import Aborts, StepSurge, Uniform, WorkloadSpec
from kvbench.core.counters import COUNTER_SPECS
from kvbench.core.trace import StepRecord, Trace, TraceRecorder
from kvbench.drivers.step_loop import StepReport, drive, step_index, workload_clock
from kvbench.engines.base import Knobs
from kvbench.engines.inprocess.reference import ReferenceAdapter

#: a Poisson storm with aborts into a pool far too small: preempts a lot, in a timing-sensitive way
SPEC = WorkloadSpec("storm", 12, Uniform(16, 64), Uniform(8, 24), StepSurge(((0.05, 80.0), (0.1, 200.0))),
                    aborts=Aborts(0.25, (0.02, 0.1)), seed=7)
KNOBS = Knobs(block_size=16, num_gpu_blocks=9)
#: counters the schedule fixes (all but wall-clock seconds, such as swap_seconds)
SCHEDULE_COUNTERS = [s.name for s in COUNTER_SPECS if s.unit != "seconds"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread, as the quick benchmarks run: on a shared 2-core machine more only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def per_request(trace: Trace) -> dict[str, tuple]:
    """What the gate counts per request: preemption modes in order, finish reason, tokens produced."""
    return {rid: (tuple(mode for _, mode in r.preemptions), r.finish_reason, len(r.token_times))
            for rid, r in sorted(trace.requests.items())}


def serve(adapter: ReferenceAdapter, workload, knobs: Knobs, step_seconds: float | None) -> Trace:
    recorder = TraceRecorder(adapter.name, "t")
    adapter.serve(workload, recorder, knobs, step_seconds=step_seconds)
    return recorder.finish()


@pytest.fixture(scope="module")
def adapter(tiny_ckpt: str) -> ReferenceAdapter:
    return ReferenceAdapter(tiny_ckpt)


@pytest.fixture(scope="module")
def workload(tiny_ckpt: str):
    return SPEC.build(512)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_workload_twice_gives_identical_counts(adapter, workload, mode):
    knobs = Knobs(block_size=16, num_gpu_blocks=9, num_cpu_blocks=4, preemption_mode=mode)
    first = serve(adapter, workload, knobs, step_seconds=0.01)
    second = serve(adapter, workload, knobs, step_seconds=0.01)
    # the mechanism fired: otherwise identical counts would prove nothing
    assert first.counters[f"preemptions_{mode}"] > 0
    assert sum(r.finish_reason == "abort" for r in first.requests.values()) > 0
    assert {c: first.counters[c] for c in SCHEDULE_COUNTERS if c in first.counters} == \
        {c: second.counters[c] for c in SCHEDULE_COUNTERS if c in second.counters}
    assert per_request(first) == per_request(second)
    assert [(s.virtual_t, s.num_running, s.num_waiting, s.num_preempted) for s in first.steps] == \
        [(s.virtual_t, s.num_running, s.num_waiting, s.num_preempted) for s in second.steps]
    # timings keep the wall clock: steps take real time, and the trace says which clock released them
    assert first.step_seconds == 0.01 and all(s.duration > 0 for s in first.steps)


# ------------------------------------------------------------------------------------------------
# the driver's release and abort rules, on a fake engine that records what it saw before each step


@dataclass
class Req:
    request_id: str
    arrival_time: float
    abort_at: float | None = None
    prompt_token_ids: tuple = (1, 2)
    max_tokens: int = 3
    priority: int = 0


@dataclass
class Fake:
    """Each request needs ``max_tokens`` steps; logs (step, event) pairs."""

    log: list[tuple[int, str]] = field(default_factory=list)
    left: dict[str, int] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    steps: int = 0

    def submit(self, r) -> None:
        self.log.append((self.steps, f"submit {r.request_id}"))
        self.left[r.request_id] = r.max_tokens

    def abort(self, rid: str) -> None:
        self.log.append((self.steps, f"abort {rid}"))
        self.aborted.append(rid)

    def has_work(self) -> bool:
        return bool(self.left)

    def step(self) -> StepReport:
        finished = {rid: "abort" for rid in self.aborted if rid in self.left}
        for rid in finished:
            del self.left[rid]
        self.aborted.clear()
        tokens = {rid: 1 for rid in self.left}
        for rid in tokens:
            self.left[rid] -= 1
        finished.update({rid: "length" for rid, n in self.left.items() if n == 0})
        for rid in finished:
            self.left.pop(rid, None)
        self.steps += 1
        return StepReport(tokens, finished, [], [], [], StepRecord(0.0, 0.0, len(self.left), 0))


def test_arrivals_and_aborts_are_released_by_step_index():
    requests = [Req("a", 0.0), Req("b", 0.025), Req("c", 0.03, abort_at=0.015), Req("late", 1.0)]
    engine, recorder = Fake(), TraceRecorder("fake", "t")
    drive(engine, requests, recorder, step_seconds=0.01)
    # engine steps executed so far, at each event: the idle gap before "late" costs no step
    assert engine.log == [(0, "submit a"), (2, "submit b"), (3, "submit c"), (4, "abort c"), (5, "submit late")]
    trace = recorder.trace
    assert trace.requests["c"].finish_reason == "abort"
    assert trace.requests["late"].finish_reason == "length"
    # the idle gap before "late" is jumped, not slept: its step runs at virtual time 1.0
    assert [s.virtual_t for s in trace.steps][-3:] == pytest.approx([1.0, 1.01, 1.02])
    to_workload = workload_clock(trace)
    assert to_workload(trace.requests["late"].arrival) == pytest.approx(1.0)
    assert to_workload(trace.requests["c"].finished) == pytest.approx(0.04)


def test_step_index_and_bad_step_seconds():
    assert [step_index(t, 0.1) for t in (0.0, 0.05, 0.1, 0.3, 0.39)] == [0, 0, 1, 3, 3]
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_seconds"):
            drive(Fake(), [], TraceRecorder("f", "t"), step_seconds=bad)


def test_wall_clock_trace_maps_to_itself():
    trace = Trace("e", "s", steps=[StepRecord(0.5, 0.1, 1, 0)])
    assert workload_clock(trace)(0.3) == 0.3
