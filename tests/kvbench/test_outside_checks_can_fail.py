"""The checks that decide from outside (victims from stalls and counter rises, refcount safety under shared
prefixes, EOS at known positions, the whole-pool request) fail on a reference engine broken in exactly the way
each guards against, in process and over HTTP; and the victims read from outside agree with the engine's own
record where both exist. A skip or an undecided verdict counts as a defect here: the check must catch the
fault, not step aside (``assert_fails`` of ``test_checks_can_fail``)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvbench.conformance.prove import near_tie_tolerance
from kvbench.conformance.verdict import Undecided
from kvbench.core.liveness import Liveness
from kvbench.engines.registry import make_adapter, parse_engine_spec
from suites.conformance import test_bad_input, test_refcount, test_stop_conditions, test_victim
from tests.kvbench import fault_test_fixtures as _shared
from tests.kvbench.test_checks_can_fail import FAULTY, assert_fails, faulty

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
model_dir = _shared.model_dir
one_torch_thread = _shared.one_torch_thread
requests_greedy = _shared.requests_greedy
truth = _shared.truth
truth_engine = _shared.truth_engine


# ----------------------------------------------------------------------------------- victims, in process
#: in process the victims' runs go on the step clock (a step every STEP_S virtual seconds, arrivals GAP_S
#: apart): the same schedule every time, whatever the machine's load
STEP_S, GAP_S = 0.001, 0.004


def on_the_step_clock(engine: Any) -> Any:
    """``engine`` whose ``serve`` releases arrivals by engine step (its trace keeps wall-clock times)."""
    serve = engine.serve
    engine.serve = lambda requests, recorder, knobs, **kw: serve(requests, recorder, knobs, step_seconds=STEP_S)
    return engine


def test_victims_read_from_outside_are_the_engines_own(model_dir):
    """On the reference engine in process the trace holds each preemption's victim as the engine reported it:
    every group the outside reading decided names exactly those victims, and it decides some."""
    engine = make_adapter(parse_engine_spec("reference"), model_dir)
    own_serve = engine.serve
    for policy in ("fcfs", "priority"):
        seen = []

        def serve(requests, recorder, knobs, _serve=own_serve, _seen=seen):
            _serve(requests, recorder, knobs, step_seconds=STEP_S)
            _seen.append(recorder.trace)

        engine.serve = serve
        reading = test_victim.victims_from_outside(engine, policy, GAP_S)
        trace = seen[-1]
        own = sorted((t, rid) for rid, r in trace.requests.items() for t, _ in r.preemptions)
        assert [v for v in reading.stalls] and len(reading.stalls) == len(own), (reading.summary(), own)
        for verdict in reading.decided:
            lo, hi = verdict.group.at
            inside = sorted(rid for t, rid in own if lo <= t <= hi)
            assert sorted(verdict.group.victims) == inside, (verdict, own)
        assert reading.decided, reading.summary()


@pytest.mark.parametrize(("policy", "fault", "match"), [
    ("fcfs", "fcfs_oldest_victim", r"FCFS must preempt the latest admitted"),
    ("priority", "priority_most_important_victim", r"priority policy must preempt the least important"),
])
def test_victims_from_outside_fail_on_the_wrong_victim(policy, fault, match, model_dir):
    assert_fails(test_victim.victims_from_outside, match, engine=on_the_step_clock(faulty(fault, model_dir)),
                 policy=policy, gap_s=GAP_S)


# ----------------------------------------------------------------------------------- refcount, whole pool, in process
@pytest.mark.parametrize(("fault", "match"), [
    ("prefix_hit_takes_no_reference", r"differ from the ground truth"),
    ("leaks_block", r"blocks are still held after every request of the shared-prefix storm finished"),
    ("ignores_prefix_caching", r"a prefix-cache hit \(a block shared\) did not happen"),
])
def test_refcount_from_outside_fails(fault, match, model_dir, truth_engine):
    assert_fails(test_refcount.test_shared_blocks_survive_pressure_from_outside, match,
                 engine=faulty(fault, model_dir), model_dir=model_dir, truth_engine=truth_engine, near_ties=[])


@pytest.mark.parametrize(("fault", "match"), [
    ("starves_requests_at_max_model_len", r"whole-pool \(waiting"),
    ("aborts_preemption_victims", r"was not served: abort"),
])
def test_whole_pool_request_check_fails(fault, match, model_dir, requests_greedy, truth, truth_engine):
    assert_fails(test_bad_input.whole_pool_request_is_served_or_refused, match, engine=faulty(fault, model_dir),
                 requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])


def test_whole_pool_request_is_decided_on_the_reference_engine(model_dir, requests_greedy, truth, truth_engine):
    engine = make_adapter(parse_engine_spec("reference"), model_dir)
    test_bad_input.whole_pool_request_is_served_or_refused(engine, requests_greedy, truth, truth_engine, [],
                                                           near_tie_tolerance(engine))


def test_eos_checkpoint_moves_eos_onto_a_token_reached_mid_output(model_dir, truth):
    import json

    from kvbench.models.eos_checkpoint import eos_checkpoint, first_positions, pick_eos

    outputs = [o.token_ids for o in truth.outputs]
    eos = pick_eos(outputs, old_eos=2)
    assert eos is not None and eos not in (0, 1, 2)
    inside = [at for out, at in zip(outputs, first_positions(outputs, eos), strict=True)
              if at is not None and 1 <= at < len(out) - 1]
    assert len(inside) >= 3, inside
    moved = eos_checkpoint(model_dir, eos)
    assert json.loads((moved / "config.json").read_text())["eos_token_id"] == eos
    tokenizer = json.loads((moved / "tokenizer.json").read_text())
    assert tokenizer["model"]["vocab"]["<|eos|>"] == eos and tokenizer["model"]["vocab"]["\u2581t2"] == 2
    assert eos_checkpoint(model_dir, eos) == moved  # written once


# ----------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def faulty_server(model_dir, tmp_path_factory):
    """One patched reference server for every fault below (``use_fault`` before each)."""
    from kvbench.conformance.faults import FaultyServerAdapter

    engine = FaultyServerAdapter(model_dir, {"fault": "leaks_block", "log_dir": str(tmp_path_factory.mktemp("logs"))})
    yield engine
    engine.close()


def with_fault(engine: Any, fault: str) -> Any:
    engine.use_fault(fault)
    return engine


@pytest.mark.server
@pytest.mark.slow
def test_fcfs_victim_check_fails_over_http(faulty_server, requests_greedy):
    """The suite's own check: the server reports no events, so it reads the victims from outside."""
    assert_fails(test_victim.test_preemption_victim_follows_the_policy, r"FCFS must preempt the latest admitted",
                 policy="fcfs", engine=with_fault(faulty_server, "fcfs_oldest_victim"), requests_greedy=requests_greedy)


@pytest.mark.server
@pytest.mark.slow
def test_priority_victim_check_never_passes_a_wrong_victim_over_http(faulty_server, requests_greedy):
    """Under the priority policy the reference engine also preempts at admission (a waiting request more important
    than a running one takes its blocks), and after a wrong victim that churns: victims preempted and admitted
    again within one step, with no stall to see. From outside that is a run whose stalls stop lining up with the
    counter at the first wrong victim, so the check cannot decide there; it must say so, never pass (in process
    the engine's own step records decide it: ``test_victims_from_outside_fail_on_the_wrong_victim``)."""
    engine = with_fault(faulty_server, "priority_most_important_victim")
    try:
        test_victim.test_preemption_victim_follows_the_policy(policy="priority", engine=engine,
                                                              requests_greedy=requests_greedy)
    except AssertionError as e:
        assert "priority policy must preempt the least important" in str(e), e
    except Undecided as e:
        assert re.search(r"shows no stall|does not line up|was never counted|could be decided", str(e)), e
    else:
        pytest.fail("the check passed on a server that preempts the most important request")


@pytest.mark.server
@pytest.mark.slow
def test_refcount_from_outside_fails_over_http(faulty_server, model_dir, truth_engine):
    assert_fails(test_refcount.test_shared_blocks_survive_pressure_from_outside, r"differ from the ground truth",
                 engine=with_fault(faulty_server, "prefix_hit_takes_no_reference"), model_dir=model_dir,
                 truth_engine=truth_engine, near_ties=[])


@pytest.mark.server
@pytest.mark.slow
def test_whole_pool_request_check_fails_over_http(faulty_server, requests_greedy, truth, truth_engine):
    engine = with_fault(faulty_server, "starves_requests_at_max_model_len")
    engine.configure_run(liveness=Liveness(stall_steps=200, stall_seconds=10.0))
    try:
        assert_fails(test_bad_input.whole_pool_request_is_served_or_refused, r"whole-pool", engine=engine,
                     requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])
    finally:
        engine.configure_run(liveness=Liveness())


@pytest.mark.server
@pytest.mark.slow
def test_eos_check_fails_over_http_on_a_server_that_ignores_eos(model_dir, requests_greedy, truth, truth_engine,
                                                                tmp_path):
    """The EOS check runs the engine again on its own checkpoint: a server of the same fault on that model."""
    engine = make_adapter(parse_engine_spec(f"{FAULTY.replace('Reference', 'Server')}:fault=ignores_eos,"
                                            f"log_dir={tmp_path}"), model_dir)
    try:
        assert_fails(test_stop_conditions.test_stop_condition_holds_under_pressure,
                     r"(?s)finish reasons differ.*expected 'stop'", condition="eos", engine=engine,
                     requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference_server(model_dir, tmp_path_factory):
    from kvbench.engines.registry import make_adapter, parse_engine_spec

    logs = tmp_path_factory.mktemp("logs")
    engine = make_adapter(parse_engine_spec(f"server:preset=reference,log_dir={logs}"), model_dir)
    yield engine
    engine.close()


@pytest.mark.server
@pytest.mark.slow
def test_victim_check_tries_again_when_a_try_reads_nothing_for_the_moment(reference_server, requests_greedy,
                                                                           monkeypatch):
    """A try left undecided by the moment (here: a reading that says the server wrote in bursts) is served again
    on the same server, and the next try decides; a reading undecided in every try stays undecided, saying how
    many tries."""
    from kvbench.conformance import victims_seen
    from kvbench.core.evidence import collecting, evidence_of, proven_of

    real = victims_seen.read_victims
    calls: list[int] = []

    def bursty(times: int):
        def read(*args, **kwargs):
            calls.append(1)
            reading = real(*args, **kwargs)
            if len(calls) <= times:
                reading.undecided = "the server delivers tokens in bursts (made up for this test)"
            return reading
        return read

    monkeypatch.setattr(test_victim, "read_victims", bursty(1))
    properties: list[tuple[str, Any]] = []
    with collecting(properties):
        test_victim.test_preemption_victim_follows_the_policy(policy="fcfs", engine=reference_server,
                                                              requests_greedy=requests_greedy)
    assert evidence_of(properties)["victim_tries"] == 2 and "victims_seen" in proven_of(properties), properties

    calls.clear()
    monkeypatch.setattr(test_victim, "read_victims", bursty(test_victim.TRIES))
    every_try = rf"in bursts \(made up for this test\) \(in each of {test_victim.TRIES} tries\)"
    with pytest.raises(Undecided, match=every_try):
        test_victim.test_preemption_victim_follows_the_policy(policy="fcfs", engine=reference_server,
                                                              requests_greedy=requests_greedy)


def test_undecided_tries_say_each_reason_where_they_differ():
    """Three tries undecided for two reasons are reported as such, never as the last reason 'in each of 3 tries'."""
    from suites.conformance.test_victim import tries_said

    assert tries_said(["bursts"]) == "bursts"
    assert tries_said(["bursts", "bursts"]) == "bursts (in each of 2 tries)"
    assert tries_said(["bursts", "no overlap", "no overlap"]) == "try 1: bursts; try 2: no overlap; try 3: no overlap"
