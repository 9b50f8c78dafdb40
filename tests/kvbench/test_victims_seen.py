"""Reading preemption victims from outside (kvbench.conformance.victims_seen) on traces made by hand: a clean
run is decided, and every ambiguity the reading can meet leaves it undecided or a group ambiguous, saying why,
never a guess."""

from __future__ import annotations

import pytest

from kvbench.conformance.victims_seen import read_victims, violations
from kvbench.core.trace import RequestTrace, StepRecord, Trace


def make_trace(streams: dict[str, tuple[float, list[float]]], preempted_at: dict[float, int],
               sampled: bool = False, end: float = 40.0) -> Trace:
    """Streams as {id: (arrival, token times)}; an engine step (or a /metrics sample) every second up to ``end``,
    the preemptions counted at the steps ``preempted_at`` names."""
    trace = Trace("hand", "victims")
    for rid, (arrival, times) in streams.items():
        trace.requests[rid] = RequestTrace(rid, arrival, 8, len(times), token_times=list(times), finished=times[-1],
                                           finish_reason="length")
    count = 0
    for k in range(1, int(end) + 1):
        count += preempted_at.get(float(k), 0)
        if sampled:
            trace.steps.append(StepRecord(float(k), 1.0, 0, 0, sampled=True, server_preemptions=count))
        else:
            trace.steps.append(StepRecord(float(k), 1.0, 0, 0, num_preempted=preempted_at.get(float(k), 0)))
    return trace


def steps(first: int, last: int) -> list[float]:
    return [float(t) for t in range(first, last + 1)]


ARRIVAL = {"a": 0, "b": 1, "c": 2}
#: a, b, c admitted one step apart; at step 11 the engine preempts c (it stalls until 20) while a and b go on
CLEAN = {"a": (0.5, steps(1, 30)), "b": (1.5, steps(2, 30)), "c": (2.5, steps(3, 10) + steps(20, 30))}


def test_a_clean_run_is_decided_and_judged_by_the_policy():
    trace = make_trace(CLEAN, {11.0: 1})
    reading = read_victims(trace, "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1)
    assert reading.undecided is None, reading.undecided
    [verdict] = reading.verdicts
    assert verdict.group.victims == ("c",) and verdict.expected == ("c",) and verdict.running == ("a", "b", "c")
    assert not violations(reading, "fcfs", {"a": 0, "b": 0, "c": 0})
    # the same run under the priority policy with b the least important: c was the wrong victim
    priority = {"a": 0, "b": 2, "c": 0}
    reading = read_victims(trace, "priority", priority, ARRIVAL, total=1)
    [problem] = violations(reading, "priority", priority)
    assert "the priority policy must preempt the least important b" in problem and "preempted c" in problem


def test_the_fcfs_victim_must_be_the_latest_admitted():
    wrong = {**CLEAN, "a": (0.5, steps(1, 10) + steps(20, 30)), "c": (2.5, steps(3, 30))}  # a stalls, not c
    reading = read_victims(make_trace(wrong, {11.0: 1}), "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1)
    [problem] = violations(reading, "fcfs", {"a": 0, "b": 0, "c": 0})
    assert "FCFS must preempt the latest admitted c, but preempted a" in problem


def test_a_server_that_delivers_in_bursts_leaves_the_run_undecided():
    # every stream gets its tokens in bursts at the same moments: nobody stops while the others go on
    bursts = [5.0, 5.0, 5.0, 15.0, 15.0, 15.0, 25.0, 25.0, 25.0]
    trace = make_trace({rid: (arrival, bursts) for rid, (arrival, _) in CLEAN.items()}, {11.0: 1}, sampled=True)
    reading = read_victims(trace, "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1, jitter=0.1)
    assert reading.undecided and "delivers tokens in bursts (3.0 tokens per chunk" in reading.undecided


def test_a_stall_the_counter_does_not_count_leaves_the_run_undecided():
    reading = read_victims(make_trace(CLEAN, {}), "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=0)
    assert reading.undecided and "1 stalls" in reading.undecided and "was never counted" in reading.undecided


def test_a_stall_away_from_the_counter_rise_leaves_the_run_undecided():
    reading = read_victims(make_trace(CLEAN, {25.0: 1}), "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1)
    assert reading.undecided and "does not line up with the rise" in reading.undecided


def test_first_tokens_out_of_arrival_order_leave_the_run_undecided():
    swapped = {**CLEAN, "a": (0.5, steps(8, 30))}  # a was sent first but served after b and c
    reading = read_victims(make_trace(swapped, {11.0: 1}), "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1)
    assert reading.undecided and "out of arrival order" in reading.undecided


def test_nothing_is_judged_from_where_stalls_and_the_counter_stop_lining_up():
    # c's stall is counted at 11; a second preemption is counted at 18 with no stall (a victim preempted before
    # its first token, or twice in one stall): b's stall from 26 comes after it, and is not judged
    streams = {**CLEAN, "b": (1.5, steps(2, 26) + steps(33, 40))}
    reading = read_victims(make_trace(streams, {11.0: 1, 18.0: 1, 27.0: 1}), "fcfs", {"a": 0, "b": 0, "c": 0},
                           ARRIVAL, total=3)
    assert reading.undecided is None and reading.consistent_until == 17.0, reading
    first, second = reading.verdicts
    assert first.decided and first.group.victims == ("c",)
    assert not second.decided and "where a preemption shows no stall" in (second.ambiguous or "")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_admitted_around_the_preemption_makes_it_ambiguous(policy):
    # d arrives late and gets its first token right after the preemption: it may have been running (and the
    # latest admitted, and the least important) when b was preempted
    streams = {**CLEAN, "b": (1.5, steps(2, 10) + steps(20, 30)), "c": (2.5, steps(3, 30)),
               "d": (10.5, steps(12, 30))}
    arrival = {**ARRIVAL, "d": 3}
    priority = {"a": 0, "b": 1, "c": 0, "d": 2}
    reading = read_victims(make_trace(streams, {11.0: 1}), policy, priority, arrival, total=1)
    assert reading.undecided is None, reading.undecided
    [verdict] = reading.verdicts
    assert not verdict.decided and "d" in (verdict.ambiguous or ""), verdict
    assert not violations(reading, policy, priority)  # an ambiguous group is never judged


def test_victims_preempted_in_one_step_are_judged_as_a_group():
    streams = {**CLEAN, "b": (1.5, steps(2, 10) + steps(20, 30)), "d": (3.5, steps(4, 10) + steps(22, 30))}
    arrival = {**ARRIVAL, "d": 3}
    trace = make_trace({**streams, "c": (2.5, steps(3, 30))}, {11.0: 2})
    reading = read_victims(trace, "fcfs", dict.fromkeys(arrival, 0), arrival, total=2)
    [verdict] = reading.verdicts
    # b and d went together, but the two latest admitted were c and d
    assert set(verdict.group.victims) == {"b", "d"} and set(verdict.expected or ()) == {"c", "d"}
    [problem] = violations(reading, "fcfs", dict.fromkeys(arrival, 0))
    assert "FCFS must preempt the latest admitted" in problem


def test_peak_kv_counts_what_the_streams_held_at_once():
    from kvbench.conformance.victims_seen import peak_kv_tokens

    # prompts of 8 tokens; at t=30 every stream is still going: a has 30 tokens, b 29, c 19 (c's stall counts too)
    assert peak_kv_tokens(make_trace(CLEAN, {11.0: 1})) == 3 * 8 + 30 + 29 + 19
    # streams one after another never hold more than the largest of them
    apart = {"a": (0.5, steps(1, 10)), "b": (10.5, steps(11, 20)), "c": (20.5, steps(21, 30))}
    assert peak_kv_tokens(make_trace(apart, {})) == 8 + 10


def test_a_counter_that_counts_at_the_resume_is_read_too():
    # c stalls from 10 to 20; the engine counts the preemption when c gives output again (at 20), as vLLM does
    trace = make_trace(CLEAN, {20.0: 1})
    reading = read_victims(trace, "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1)
    assert reading.undecided is None and reading.counted == "when the victim resumes", reading
    [verdict] = reading.verdicts
    assert verdict.decided and verdict.right
    # counted at neither end: nothing is read
    assert read_victims(make_trace(CLEAN, {15.0: 1}), "fcfs", {"a": 0, "b": 0, "c": 0}, ARRIVAL, total=1).undecided
