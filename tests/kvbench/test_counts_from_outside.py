"""Counts held from outside: ceilings as well as floors, counts told once never compared with themselves,
what the client saw against the engine's counters, and chunked prefill proven from a confirmed token
budget. Each new assertion is shown failing on an engine broken in exactly its way, in process and over
HTTP where the count exists there (the preemption total is read only from a server's ``/metrics``)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import replace

import pytest
from _pytest.outcomes import Failed, Skipped

from kvbench.conformance.chunking import chunked_prefill_from_outside
from kvbench.conformance.metrics_truth import (
    client_view_counts,
    hits_over_ceiling,
    prefix_hit_ceiling,
    told_twice,
    told_twice_disagreements,
)
from kvbench.conformance.prove import near_tie_tolerance
from kvbench.conformance.verdict import Undecided
from kvbench.core.counters import Counters
from kvbench.core.requests import GenOutput, GenRequest, GenResult
from kvbench.drivers.server_metrics import MetricsSnapshot, cumulative_counters
from kvbench.drivers.server_settings import knobs_from_server_info
from kvbench.engines.registry import make_adapter, parse_engine_spec
from suites.conformance import test_equivalence, test_metrics_truth
from tests.kvbench import fault_test_fixtures as _shared
from tests.kvbench.test_checks_can_fail import FAULTY, assert_fails

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
model_dir = _shared.model_dir
one_torch_thread = _shared.one_torch_thread
requests_greedy = _shared.requests_greedy
truth = _shared.truth
truth_engine = _shared.truth_engine


def _result(outputs: list[GenOutput], **counters) -> GenResult:
    return GenResult(outputs, Counters.from_dict(counters))


# --------------------------------------------------------------------------- prefix hits: the ceiling
def test_the_ceiling_counts_shared_blocks_once_per_admission():
    shared = [7] * 8  # two whole blocks of 4
    requests = [GenRequest("a", [*shared, 1, 2], 2), GenRequest("b", [*shared, 3, 4], 2),
                GenRequest("c", [9, 9, 9, 9, 9], 2)]  # shares nothing with the others
    outs = [GenOutput("a", [5, 6], "length", 0), GenOutput("b", [5, 6], "length", 0),
            GenOutput("c", [5, 6], "length", 0)]
    # a and b may each reuse the other's two blocks (whichever ran first); c nothing
    assert prefix_hit_ceiling(requests, _result(outs), block_size=4) == 16
    # a preempted twice may also re-hit its own sequence each time: 8 + 2 + 2 - 1 tokens -> two blocks
    twice = [replace(outs[0], num_preemptions=2), *outs[1:]]
    assert prefix_hit_ceiling(requests, _result(twice), block_size=4) == 16 + 2 * 8
    # without per-request counts, the run's total bounds every later admission by the longest sequence
    unsaid = [replace(o, num_preemptions=None) for o in outs]
    assert prefix_hit_ceiling(requests, _result(unsaid, preemptions_recompute=1, preemptions_swap=0), 4) == 16 + 8
    assert prefix_hit_ceiling(requests, _result(unsaid), 4) is None, "preemptions untold: no ceiling"
    over = hits_over_ceiling(_result(outs, prefix_cache_hits=24), 16)
    assert over is not None and re.search(r"prefix_cache_hits=24 exceeds the 16 tokens", over)
    assert hits_over_ceiling(_result(outs, prefix_cache_hits=16), 16) is None


# --------------------------------------------------------------------------- told twice, or once
VLLM_METRICS = textwrap.dedent("""\
    vllm:num_preemptions_total{engine="0",model_name="m"} 5
    vllm:request_num_preemptions_sum{engine="0",model_name="m"} 4
    vllm:request_num_preemptions_count{engine="0",model_name="m"} 3
    vllm:generation_tokens_total{engine="0",model_name="m"} 6
    vllm:prompt_tokens_total{engine="0",model_name="m"} 10
    vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3
    vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0
    vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0
    """)


def test_vllms_one_preemption_total_is_told_once_and_never_compared_with_itself():
    counters = cumulative_counters(MetricsSnapshot.parse(VLLM_METRICS), "recompute")
    assert (counters.preemptions_recompute, counters.preemptions_total) == (5, None), \
        "the total read as the recompute count is not offered as a second telling"
    assert counters.request_preemptions == 4 and counters.prompt_tokens == 10 and counters.finished_length == 3
    outs = [GenOutput(f"r{i}", [1, 2], "length", cached_tokens=0) for i in range(3)]
    result = GenResult(outs, counters)
    twice, once = told_twice(result)
    assert "preemptions_total" not in twice and "request_preemptions" in twice and "generated_tokens" in twice
    problems = told_twice_disagreements(result)
    assert any(re.search(r"request_preemptions=4 .* but the engine's preemption count is 5", p) for p in problems)
    # a server that keeps no per-request count tells its preemptions once, and says so
    once_only = cumulative_counters(MetricsSnapshot.parse(VLLM_METRICS.replace("request_num_preemptions",
                                                                               "unread")), "recompute")
    twice, once = told_twice(GenResult(outs, once_only))
    assert "request_preemptions" not in twice and any(w.startswith("preemptions") for w in once)
    assert not [p for p in told_twice_disagreements(GenResult(outs, once_only)) if "preemption" in p]


def test_cached_tokens_must_equal_the_hits_when_nothing_was_preempted():
    outs = [GenOutput("a", [1], "length", 0, cached_tokens=32), GenOutput("b", [1], "length", 0, cached_tokens=0)]
    calm = dict(preemptions_recompute=0, preemptions_swap=0)
    assert told_twice_disagreements(_result(outs, prefix_cache_hits=32, **calm)) == []
    problems = told_twice_disagreements(_result(outs, prefix_cache_hits=64, **calm))
    assert problems == ["prefix_cache_hits=64 but the responses' cached tokens add up to 32, in a run without "
                        "preemptions (every admission was a request's first)"]
    # after a preemption a re-admission's hits need not be in any response (vLLM's are not): at most, not equal
    preempted = [replace(outs[0], num_preemptions=1), outs[1]]
    assert told_twice_disagreements(_result(preempted, prefix_cache_hits=64, preemptions_recompute=1,
                                            preemptions_swap=0)) == []


# --------------------------------------------------------------------------- what the client saw
def test_each_client_view_disagreement_names_both_figures():
    requests = [GenRequest("a", [1] * 5, 2), GenRequest("b", [1] * 7, 2), GenRequest("c", [1] * 3, 2)]
    outs = [GenOutput("a", [4, 5], "length"), GenOutput("b", [4], "stop"),
            GenOutput("c", [], "rejected", error="too long")]  # refused: never reached the engine
    agreeing = dict(generated_tokens=3, prompt_tokens=12, finished_length=1, finished_stop=1)
    counts = client_view_counts(requests, _result(outs, **agreeing))
    assert [c.counter for c in counts] == ["generated_tokens", "prompt_tokens", "finished_length", "finished_stop"]
    assert all(c.agrees for c in counts)
    cases = {"generated_tokens": (4, r"generated_tokens=4 but the output tokens kvbench received = 3"),
             "prompt_tokens": (15, r"prompt_tokens=15 but the prompt tokens kvbench sent .* = 12"),
             "finished_length": (2, r"finished_length=2 but the requests kvbench saw finish 'length' = 1"),
             "finished_stop": (0, r"finished_stop=0 but the requests kvbench saw finish 'stop' = 1")}
    for counter, (value, message) in cases.items():
        bad = [c for c in client_view_counts(requests, _result(outs, **{**agreeing, counter: value})) if not c.agrees]
        assert len(bad) == 1 and re.search(message, bad[0].problem()), (counter, [c.problem() for c in bad])
    assert client_view_counts(requests, _result(outs)) == [], "nothing exposed, nothing compared"


# --------------------------------------------------------------------------- chunked prefill from outside
SERVER_INFO = {"vllm_config": {
    "scheduler_config": {"max_num_batched_tokens": 16, "max_num_scheduled_tokens": None, "max_num_seqs": 16,
                         "enable_chunked_prefill": True, "policy": "fcfs"},
    "cache_config": {"block_size": 32, "enable_prefix_caching": False, "num_gpu_blocks": 40},
    "model_config": {"max_model_len": 512}}}


def test_vllms_server_info_is_read_as_knobs():
    """The shape vLLM 0.32 answers ``GET /server_info?config_format=json`` with (dev mode), trimmed."""
    assert knobs_from_server_info(SERVER_INFO) == {
        "max_num_batched_tokens": 16, "enable_chunked_prefill": True, "max_num_seqs": 16, "scheduling_policy": "fcfs",
        "block_size": 32, "enable_prefix_caching": False, "num_gpu_blocks": 40, "max_model_len": 512}
    scheduled = {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": 64, "max_num_scheduled_tokens": 48}}}
    assert knobs_from_server_info(scheduled) == {"max_num_batched_tokens": 48}, "the step's budget is the smaller"
    assert knobs_from_server_info({"vllm_config": "a text dump"}) == {} and knobs_from_server_info({}) == {}


def test_a_prompt_longer_than_the_confirmed_budget_proves_chunks():
    requests = [GenRequest("long", list(range(3, 43)), 2), GenRequest("short", [3, 4, 5], 2)]
    result = _result([GenOutput("long", [1, 2], "length"), GenOutput("short", [1, 2], "length")])
    settings = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    proof = chunked_prefill_from_outside(requests, result, settings)
    assert not isinstance(proof, str) and proof.chunks_floor == {"long": 2}  # 40 tokens: 3 steps of 16 at least
    for said, why in (({"enable_chunked_prefill": True}, r"does not confirm its step's token budget"),
                      ({"max_num_batched_tokens": 16}, r"does not confirm chunked prefill on"),
                      ({**settings, "enable_chunked_prefill": False}, r"enable_chunked_prefill=False"),
                      ({**settings, "max_num_batched_tokens": 64}, r"no answered prompt needed more than")):
        reason = chunked_prefill_from_outside(requests, result, said)
        assert isinstance(reason, str) and re.search(why, reason), (said, reason)
    refused = _result([GenOutput("long", [], "rejected"), GenOutput("short", [1, 2], "length")])
    assert isinstance(chunked_prefill_from_outside(requests, refused, settings), str), "a refused prompt proves nothing"
    # a prompt another request's sequence shares whole blocks with may have been served in part from the cache
    twin = [GenRequest("a", list(range(3, 43)), 2), GenRequest("b", [*range(3, 35), 99, 98], 2)]
    both = _result([GenOutput("a", [1], "length"), GenOutput("b", [1], "length")])
    reason = chunked_prefill_from_outside(twin, both, {**settings, "block_size": 16})
    assert isinstance(reason, str) and "no answered prompt needed more" in reason, reason
    proof = chunked_prefill_from_outside(twin, both, {**settings, "block_size": 16, "enable_prefix_caching": False})
    assert not isinstance(proof, str) and proof.chunks_floor == {"a": 2, "b": 2}


# --------------------------------------------------------------------------- the checks, on engines
def faulty(fault: str, model_dir: str):
    return make_adapter(parse_engine_spec(f"{FAULTY}:fault={fault}"), model_dir)


def _suite_args(check, engine, model_dir, truth, requests_greedy, truth_engine, **more):
    import inspect

    available = {"engine": engine, "model_dir": model_dir, "truth": truth, "requests_greedy": requests_greedy,
                 "truth_engine": truth_engine, "near_ties": [], "tolerance": near_tie_tolerance(engine), **more}
    return {k: available[k] for k in inspect.signature(check).parameters}


def test_hits_counted_at_each_retry_overshoot_the_ceiling_in_process(model_dir, truth, requests_greedy,
                                                                      truth_engine):
    check = test_equivalence.test_recompute_after_preemption_reuses_cached_blocks
    engine = faulty("counts_prefix_hits_per_retry", model_dir)
    assert_fails(check, r"prefix_cache_hits=\d+ exceeds the \d+ tokens the requests can reuse",
                 **_suite_args(check, engine, model_dir, truth, requests_greedy, truth_engine))


def test_hits_counted_at_each_retry_disagree_with_the_admission_events(model_dir, requests_greedy):
    assert_fails(test_metrics_truth.test_counters_agree_with_events_and_outputs,
                 r"prefix_cache_hits=\d+ but the cached tokens of the admitted events \(one per admission\) = \d+",
                 mode="recompute+prefix", engine=faulty("counts_prefix_hits_per_retry", model_dir),
                 requests_greedy=requests_greedy)


def test_the_client_view_check_fails_on_an_overcounting_engine_in_process(model_dir, truth, requests_greedy,
                                                                          truth_engine):
    check = test_metrics_truth.test_what_the_client_saw_agrees_with_the_counters
    assert_fails(check, r"generated_tokens=\d+ but the output tokens kvbench received = \d+",
                 **_suite_args(check, faulty("overcounts_generated_tokens", model_dir), model_dir, truth,
                               requests_greedy, truth_engine))


def test_chunked_prefill_without_a_counter_or_a_confirmed_budget_is_undecided(model_dir, truth, requests_greedy,
                                                                              truth_engine):
    """An engine that counts no chunks and confirms no budget leaves the check undecided, saying why: never
    passed on matching outputs alone."""
    engine = make_adapter(parse_engine_spec("reference"), model_dir)
    generate = engine.generate
    engine.generate = lambda requests, knobs: _without_chunks(generate(requests, knobs))
    engine.confirmed_settings = lambda knobs=None: {}  # the in-process engine states its config: here it states none
    with pytest.raises(Skipped) as skipped:
        test_equivalence.test_chunked_prefill_equivalence(**_suite_args(
            test_equivalence.test_chunked_prefill_equivalence, engine, model_dir, truth, requests_greedy,
            truth_engine, budget=16))
    assert isinstance(skipped.value, Undecided) and "does not confirm chunked prefill" in str(skipped.value)


def _without_chunks(result: GenResult) -> GenResult:
    result.counters = replace(result.counters, prefill_chunks=None)
    return result


# --------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def faulty_server(model_dir, tmp_path_factory):
    from kvbench.conformance.faults import FaultyServerAdapter

    engine = FaultyServerAdapter(model_dir, {"fault": "overcounts_generated_tokens",
                                             "log_dir": str(tmp_path_factory.mktemp("logs"))})
    yield engine
    engine.close()


#: runs a check gets on the faulty server to meet its fault's moment (see the test)
HTTP_TRIES = 3
HTTP_CASES = [
    pytest.param(test_equivalence.test_recompute_after_preemption_reuses_cached_blocks, "counts_prefix_hits_per_retry",
                 r"prefix_cache_hits=\d+ exceeds the \d+ tokens the requests can reuse", id="hits-ceiling"),
    pytest.param(test_metrics_truth.test_counts_told_twice_agree, "preemptions_total_misses_a_mode",
                 r"preemptions_total=\d+ \(the engine's own total\) but its by-mode counts add up to \d+",
                 id="preemptions-total"),
    pytest.param(test_metrics_truth.test_what_the_client_saw_agrees_with_the_counters, "overcounts_generated_tokens",
                 r"generated_tokens=\d+ but the output tokens kvbench received = \d+", id="client-view"),
]


@pytest.mark.server
@pytest.mark.parametrize(("check", "fault", "match"), HTTP_CASES)
def test_new_assertions_fail_over_http_on_a_faulty_server(check, fault, match, faulty_server, model_dir, truth,
                                                          requests_greedy, truth_engine):
    """Each check fails, for its broken property, on the reference server carrying the fault. Over HTTP some
    faults show only when the arrivals make their moment (a hit counted again needs an admission retried while
    it waits for room, and the requests reach the engine over several steps): the check gets up to
    :data:`HTTP_TRIES` runs, and must fail in one. A run in which it passed had nothing wrong to see: the
    counts were true that time (one of three full-suite runs under ``-n 2`` had no such retry)."""
    faulty_server.use_fault(fault)
    args = _suite_args(check, faulty_server, model_dir, truth, requests_greedy, truth_engine)
    for attempt in range(1, HTTP_TRIES + 1):
        try:
            assert_fails(check, match, **args)
            return
        except Failed as e:
            if "passed on an engine broken" not in str(e) or attempt == HTTP_TRIES:
                raise


@pytest.mark.server
def test_a_server_that_counts_no_chunks_proves_them_from_its_confirmed_budget(faulty_server, model_dir, truth,
                                                                             requests_greedy, truth_engine):
    """The reference server with its ``prefill_chunks`` counter hidden, as vLLM has none: the budget it confirms
    (its ``vllm:cache_config_info`` labels) and its prompts longer than it, answered right, prove the chunks;
    the proof is the check's recorded evidence. (The fault in place is one of counting generated tokens, which
    this check does not look at.)"""
    from kvbench.core.evidence import collecting

    faulty_server.use_fault("overcounts_generated_tokens")
    assert faulty_server.confirmed_settings(_chunk_knobs(faulty_server, requests_greedy))["max_num_batched_tokens"] \
        == 16
    generate = faulty_server.generate
    faulty_server.generate = lambda requests, knobs: _without_chunks(generate(requests, knobs))
    try:
        properties: list = []
        with collecting(properties):
            test_equivalence.test_chunked_prefill_equivalence(**_suite_args(
                test_equivalence.test_chunked_prefill_equivalence, faulty_server, model_dir, truth, requests_greedy,
                truth_engine, budget=16))
    finally:
        del faulty_server.generate
    proven = dict(properties)
    assert proven.get("kvbench.proven") == "prefill_chunks", properties
    assert proven["kvbench.evidence.prefill_chunks"]["confirmed_budget"] == 16
    assert proven["kvbench.evidence.prefill_chunks"]["prefill_chunks_at_least"] > 0


def _chunk_knobs(engine, requests):
    from kvbench.conformance.prove import roomy_knobs

    return roomy_knobs(engine, requests, enable_chunked_prefill=True, max_num_batched_tokens=16)
