"""The release rule every timed driver shares (:mod:`kvbench.drivers.release`), and the HTTP driver
following it against a fake streaming client (no server: the rule, not the network, is under test)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_client import Completion
from kvbench.drivers.http_driver import run_serve
from kvbench.drivers.release import ReleaseSchedule, step_index
from tests.kvbench.test_step_clock import Req


def ids(releases) -> list[str]:
    return [r.request_id for r in releases]


# ------------------------------------------------------------------------------------------ the schedule
def test_open_loop_releases_by_arrival_point_in_workload_order():
    reqs = [Req("late", 0.3), Req("a", 0.0), Req("b", 0.1), Req("b2", 0.1)]
    schedule = ReleaseSchedule(reqs, to_point=lambda t: step_index(t, 0.1))
    assert ids(schedule.release_due(0)) == ["a"]
    assert schedule.next_point() == 1
    assert ids(schedule.release_due(0)) == [], "nothing is released twice or early"
    out = schedule.release_due(2)
    assert ids(out) == ["b", "b2"] and [r.at for r in out] == [1, 1], "released at their own point, not now"
    assert schedule.next_point() == 3 and not schedule.done
    assert ids(schedule.release_due(3)) == ["late"] and schedule.next_point() is None
    for rid in ("a", "b", "b2"):
        schedule.finished(rid)
    assert not schedule.done, "'late' is still in flight"
    schedule.finished("late")
    assert schedule.done


def test_closed_loop_releases_when_a_slot_frees_at_that_moment():
    schedule = ReleaseSchedule([Req(f"c{i}", 0.0) for i in range(5)], concurrency=2)
    first = schedule.release_due(0.5)
    assert ids(first) == ["c0", "c1"] and [r.at for r in first] == [0.5, 0.5]
    assert schedule.release_due(0.7) == [] and schedule.next_point() is None
    schedule.finished("c1")
    nxt = schedule.release_due(0.9)
    assert ids(nxt) == ["c2"] and nxt[0].at == 0.9
    schedule.finished("nobody")  # unknown ids free no slot
    assert schedule.release_due(1.0) == []


def test_aborts_come_due_after_the_release_point_once_and_only_in_flight():
    schedule = ReleaseSchedule([Req("a", 0.2, abort_at=0.25), Req("b", 0.2, abort_at=0.05), Req("c", 0.0)],
                               to_point=lambda t: step_index(t, 0.1))
    assert schedule.release_due(0) and schedule.aborts_due(10) == []
    released = {r.request_id: r for r in schedule.release_due(2)}
    assert released["a"].abort_due == 2 + 2 and released["b"].abort_due == 2 + 0, "abort_at on the same clock"
    assert schedule.aborts_due(1) == []
    assert schedule.aborts_due(2) == ["b"] and schedule.aborts_due(2) == []
    schedule.finished("a")
    assert schedule.aborts_due(9) == [], "a finished request is not aborted"


def test_planned_hands_every_open_loop_release_once_and_refuses_the_closed_loop():
    schedule = ReleaseSchedule([Req("b", 0.2, abort_at=0.1), Req("a", 0.1)])
    plan = schedule.planned()
    assert [(r.request_id, r.at, r.abort_due) for r in plan] == [("a", 0.1, None), ("b", 0.2, pytest.approx(0.3))]
    assert schedule.release_due(1.0) == [] and schedule.planned() == []
    with pytest.raises(ValueError, match="closed-loop"):
        ReleaseSchedule([Req("a", 0.0)], concurrency=1).planned()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_concurrency_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"concurrency must be None \(open loop\) or an int >= 1"):
        ReleaseSchedule([], concurrency=bad)


# ------------------------------------------------------------------------------ the HTTP driver's releases
class FakeStreams:
    """A CompletionClient stand-in: each request streams ``max_tokens`` tokens ``gap`` seconds apart.
    Logs when each stream opened (on the driver's clock) and how many were open at once."""

    def __init__(self, gap: float = 0.01):
        self.gap = gap
        self.opened: dict[str, float] = {}
        self.cancelled: list[str] = []
        self.open = self.peak = 0

    def body(self, prompt_token_ids, max_tokens: int, *, stream: bool, **_: Any) -> dict[str, Any]:
        return {"rid": prompt_token_ids[0], "max_tokens": max_tokens}

    async def stream(self, body: dict[str, Any], on_tokens, clock, started: asyncio.Event) -> Completion:
        rid = body["rid"]
        self.opened[rid] = clock()
        self.open += 1
        self.peak = max(self.peak, self.open)
        started.set()
        try:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(self.gap)
                on_tokens(clock(), [7])
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.open -= 1
        return Completion([7] * body["max_tokens"], "length")


def _reqs(arrivals: list[float], **kw: Any) -> list[Req]:
    return [Req(f"r{i}", t, prompt_token_ids=(f"r{i}",), **kw) for i, t in enumerate(arrivals)]


def test_http_open_loop_never_sends_before_the_arrival_and_records_the_arrival_time():
    client, recorder = FakeStreams(), TraceRecorder("fake", "open")
    reqs = _reqs([0.06, 0.0, 0.03, 0.03])
    stats = run_serve(client, reqs, recorder, poll_interval=None)
    trace = recorder.finish()
    for r in reqs:
        assert client.opened[r.request_id] >= r.arrival_time
        assert trace.requests[r.request_id].arrival == r.arrival_time
        assert trace.requests[r.request_id].finish_reason == "length"
    assert stats.requests == 4 and stats.tokens == 12


def test_http_closed_loop_keeps_the_concurrency_and_releases_on_finishes():
    client, recorder = FakeStreams(gap=0.005), TraceRecorder("fake", "closed")
    done: list[int] = []
    run_serve(client, _reqs([0.0] * 7), recorder, concurrency=3, poll_interval=None, progress=done.append)
    trace = recorder.finish()
    assert client.peak == 3 and len(done) == 7
    first_finish = min(r.finished for r in trace.requests.values())
    later = sorted(r.arrival for r in trace.requests.values())[3:]
    assert all(t >= first_finish for t in later), "the fourth request waits for a slot"


def test_http_closed_loop_refuses_a_finish_that_releases_two(monkeypatch: pytest.MonkeyPatch):
    """A slot takes one request per finish; were a schedule to let out two, the second would go to no task
    (never sent, never finished): the driver says so rather than lose it."""
    from kvbench.drivers import http_driver

    class TwoSlotsPerFinish(ReleaseSchedule):
        def finished(self, request_id: str) -> None:
            super().finished(request_id)
            self.concurrency = (self.concurrency or 0) + 1  # a rule that frees a slot more than it took

    monkeypatch.setattr(http_driver, "ReleaseSchedule", TwoSlotsPerFinish)
    with pytest.raises(RuntimeError, match=r"closed loop: one finish released 2 requests \(r1, r2\)"):
        run_serve(FakeStreams(gap=0.001), _reqs([0.0] * 4), TraceRecorder("fake", "closed"), concurrency=1,
                  poll_interval=None)


def test_http_abort_closes_the_stream_at_release_plus_abort_at():
    client, recorder = FakeStreams(gap=0.01), TraceRecorder("fake", "abort")
    reqs = [Req("x", 0.02, abort_at=0.05, prompt_token_ids=("x",), max_tokens=50),
            Req("y", 0.0, prompt_token_ids=("y",), max_tokens=2)]
    run_serve(client, reqs, recorder, poll_interval=None)
    x = recorder.finish().requests["x"]
    assert x.finish_reason == "abort" and client.cancelled == ["x"]
    assert x.finished >= 0.02 + 0.05 and 0 < len(x.token_times) < 50
