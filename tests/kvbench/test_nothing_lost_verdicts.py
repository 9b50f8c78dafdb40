"""Check 6's verdicts, decided from traces a fake engine hands the check (no engine runs): every abort that
reached a running request is accounted for, not "at least one"; a pinned abort-count failure excuses that
assertion alone, so the leak and preemption assertions still run; no confirmed abort, or a server whose blocks
cannot be read at idle, ends the check undecided, saying why, never failed and never silently passed."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from kvbench.conformance.aborts import ABORT_MARGIN, confirmed_aborts
from kvbench.conformance.expectations import Expectation
from kvbench.conformance.verdict import Undecided, pinned
from kvbench.core.trace import StepRecord, TraceRecorder
from kvbench.engines.base import EngineAdapter, GenRequest
from suites.conformance import test_nothing_lost as check6


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The checkpoint whose vocabulary the storm is drawn from (the check reads only its config.json)."""
    from kvbench.models.builtin import builtin_checkpoint

    return str(builtin_checkpoint("tiny"))


class FakeServer(EngineAdapter):
    """An engine whose ``serve`` records what ``script(workload, recorder)`` says: the trace a check reads, exactly."""

    kind = "fake-server"
    capabilities = frozenset({"recompute", "abort"})
    aborts_race_finishes = True  # as the HTTP adapters: an abort is a closed stream

    def __init__(self, script: Callable[[Any, TraceRecorder], None]):
        super().__init__("unused")
        self.script = script

    def generate(self, requests: list[GenRequest], knobs=None):
        raise NotImplementedError

    def serve(self, workload, recorder, knobs=None, progress=None):
        self.script(workload, recorder)


def storm_as_served(closes: Callable[[Any], int | None], counters: dict[str, float],
                    last_sample: tuple[int, int] = (0, 0)) -> Callable[[Any, TraceRecorder], None]:
    """Every request served whole, but the aborted ones: ``closes(request)`` is the tokens the client had when
    it closed that stream (None: it finished before its abort came). Then ``counters`` and one /metrics sample
    after the run of (running, waiting)."""
    def script(workload: Any, recorder: TraceRecorder) -> None:
        t = 0.0
        for r in workload.requests:
            recorder.arrived(r.request_id, r.arrival_time, len(r.prompt_token_ids), r.max_tokens)
            at_close = closes(r) if r.abort_at is not None else None
            got = r.max_tokens if at_close is None else at_close
            t += 0.01
            recorder.tokens(r.request_id, t, got)
            if at_close is None:
                recorder.finished(r.request_id, t, "length")
            else:
                recorder.abort_sent(r.request_id, t, at_close)
                recorder.finished(r.request_id, t, "abort")
        recorder.step(StepRecord(t=t + 0.1, duration=0.1, num_running=last_sample[0], num_waiting=last_sample[1],
                                 sampled=True))
        recorder.set_counters(counters)
    return script


def run_check(engine: EngineAdapter, model_dir: str, pin: Expectation | None = None) -> list[str]:
    """Check 6 in recompute mode on ``engine``; the claims its pin excused."""
    with pinned(pin) as scope:
        check6.test_every_request_finishes_exactly_once(mode="recompute", engine=engine, model_dir=model_dir)
    return scope.excused


VLLM_PIN = Expectation("fake-server", "every_request_finishes_exactly_once", "aborts go uncounted", "none",
                       match=r"aborts counter 0 but \d+ requests were aborted by the client")
AFTER_FIRST_TOKEN = lambda r: 1  # noqa: E731  (a close right after the first token, as the driver places it)
WHOLE = {"aborts": 8, "leaked_blocks": 0, "preemptions_recompute": 3, "preemptions_swap": 0}


def test_every_confirmed_abort_must_be_counted_not_at_least_one(model_dir):
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, {**WHOLE, "aborts": 1}))
    with pytest.raises(AssertionError, match=r"aborts counter 1 but 8 requests were aborted by the client while still "
                                             r"running"):
        run_check(engine, model_dir)


def test_a_count_above_the_closed_streams_fails(model_dir):
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, {**WHOLE, "aborts": 9}))
    with pytest.raises(AssertionError, match=r"aborts counter 9 but the client closed only 8 streams"):
        run_check(engine, model_dir)


def test_every_abort_counted_passes(model_dir):
    assert run_check(FakeServer(storm_as_served(AFTER_FIRST_TOKEN, WHOLE)), model_dir) == []


def test_a_pinned_abort_count_excuses_that_assertion_alone(model_dir):
    counters = {**WHOLE, "aborts": 0, "leaked_blocks": 3, "preemptions_recompute": 3}
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, counters))
    with pytest.raises(AssertionError, match=r"3 blocks are still held after every request finished"):
        run_check(engine, model_dir, VLLM_PIN)


def test_a_storm_that_did_not_preempt_over_http_is_undecided_never_passed(model_dir):
    """A server's arrivals spread with the machine's load, so its storm may not preempt: then nothing was proved
    (undecided, with the reason), the pinned abort count excused as before, and never a pass."""
    counters = {**WHOLE, "aborts": 0, "preemptions_recompute": 0}
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, counters))
    with pytest.raises(Undecided, match=r"the storm preempted nothing on .* in this run"):
        run_check(engine, model_dir, VLLM_PIN)


def test_a_pinned_abort_count_with_the_rest_whole_is_the_expected_failure(model_dir):
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, {**WHOLE, "aborts": 0}))
    excused = run_check(engine, model_dir, VLLM_PIN)
    assert len(excused) == 1 and excused[0].startswith("aborts counter 0 but 8 requests were aborted by the client")


def test_no_confirmed_abort_is_undecided_never_failed(model_dir):
    """Every request finished before its abort came (a fast engine): nothing the engine did with aborts can be
    judged, and its aborts counter of 0 is no failure."""
    engine = FakeServer(storm_as_served(lambda r: None, {**WHOLE, "aborts": 0}))
    with pytest.raises(Undecided, match=r"none of the 8 aborts the workload asked for could be confirmed"):
        run_check(engine, model_dir)


def test_a_close_near_a_requests_end_is_not_a_confirmed_abort(model_dir):
    engine = FakeServer(storm_as_served(lambda r: r.max_tokens - 1, {**WHOLE, "aborts": 0}))
    with pytest.raises(Undecided, match=r"none of the 8 aborts .* \(8 sent; confirmed: closed after its first token"):
        run_check(engine, model_dir)


def test_a_server_still_holding_requests_leaves_the_leak_undecided_not_dropped(model_dir):
    counters = {k: v for k, v in WHOLE.items() if k != "leaked_blocks"}
    engine = FakeServer(storm_as_served(AFTER_FIRST_TOKEN, counters, last_sample=(2, 1)))
    with pytest.raises(Undecided, match=r"still held 2 running and 1 waiting request\(s\) at the last /metrics sample"):
        run_check(engine, model_dir)


def test_confirmed_aborts_by_each_rule():
    from kvbench.core.requests import WorkloadRequest

    requests = [WorkloadRequest(f"r{i}", [5], 40, 0.0, abort_at=0.02 if i < 3 else None) for i in range(4)]
    recorder = TraceRecorder("e", "s")
    trace = recorder.trace
    for r in requests:
        recorder.arrived(r.request_id, 0.0, 1, r.max_tokens)
    recorder.abort_sent("r0", 0.1, 1)  # far from its end: confirmed
    recorder.abort_sent("r1", 0.1, 40 - ABORT_MARGIN + 1)  # near it: sent, not confirmed
    recorder.finished("r2", 0.1, "abort")  # no close recorded: the engine ended it
    seen = confirmed_aborts(trace, requests, races=True)
    assert (seen.asked, seen.sent, seen.confirmed) == (("r0", "r1", "r2"), ("r0", "r1"), ("r0",))
    trace.step_seconds = 0.005  # the step clock: 0.02 s is 4 steps, fewer than the 40 tokens each needs
    assert confirmed_aborts(trace, requests, races=False).confirmed == ("r0", "r1", "r2")
    trace.step_seconds = None  # the wall clock in process: what the adapter reports aborted
    assert confirmed_aborts(trace, requests, races=False).confirmed == ("r2",)
    assert re.search("half its max_tokens", confirmed_aborts(trace, requests, races=True).how)


def test_a_storm_whose_aborts_all_missed_is_served_again_and_each_try_judged(model_dir):
    """Over HTTP a try in which no close landed on a running request is served again (up to prove.TIMED_TRIES), and
    the try that confirmed aborts is the one judged; three such tries end undecided saying so. A try whose outputs
    fail ends the check there: a failure is never served again."""
    from kvbench.conformance.prove import TIMED_TRIES

    tries: list[int] = []

    def script(closes_by_try):
        def serve(workload, recorder):
            tries.append(1)
            storm_as_served(closes_by_try[min(len(tries), len(closes_by_try)) - 1], WHOLE)(workload, recorder)
        return serve

    assert run_check(FakeServer(script([lambda r: None, AFTER_FIRST_TOKEN])), model_dir) == []
    assert len(tries) == 2
    tries.clear()
    with pytest.raises(Undecided, match=rf"could be confirmed .*in each of {TIMED_TRIES} tries"):
        run_check(FakeServer(script([lambda r: None])), model_dir)
    assert len(tries) == TIMED_TRIES
    tries.clear()
    lost = FakeServer(script([lambda r: None]))
    lost.serve = lambda workload, recorder, knobs=None, progress=None: (tries.append(1), None)[1]  # nothing served
    with pytest.raises(AssertionError, match="requests went missing"):
        run_check(lost, model_dir)
    assert len(tries) == 1
