"""Counters triangulated, not trusted (docs/checks.md#the-checks-suitesconformance, check 11b): a count an
engine tells two ways must agree with itself and with the reuse the requests were built to produce; a
disagreement fails naming both figures."""

from __future__ import annotations

import re

import pytest

from kvbench.conformance.metrics_truth import prefix_hit_floor, told_twice_disagreements
from kvbench.conformance.prove import roomy_knobs
from kvbench.core.counters import Counters
from kvbench.core.requests import GenOutput, GenRequest, GenResult
from kvbench.drivers.server_metrics import MetricsSnapshot, cumulative_counters
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint
from suites.conformance import test_equivalence
from tests.kvbench.test_checks_can_fail import assert_fails


def _req(rid: str, prompt: list[int]) -> GenRequest:
    return GenRequest(rid, prompt, 4)


def test_prefix_hit_floor_leaves_out_the_first_admissions_of_each_group():
    shared = [7, 7, 7, 7, 8, 8, 8, 8]  # two whole blocks of 4
    group_a = [_req(f"a{i}", [*shared, 100 + i, 1, 2]) for i in range(4)]  # each can reuse 8 tokens
    group_b = [_req(f"b{i}", [9, 9, 9, 9, 200 + i, 5]) for i in range(3)]  # each can reuse 4 tokens
    loner = [_req("c", [1, 2, 3, 4, 5, 6])]  # shares nothing: no floor
    requests = [*group_a, *group_b, *loner]
    # max_num_seqs=2: per group, two may be admitted before any finished its prefill
    assert prefix_hit_floor(requests, block_size=4, max_num_seqs=2) == 2 * 8 + 1 * 4
    assert prefix_hit_floor(requests, block_size=4, max_num_seqs=4) == 0
    # never a 100% hit: a prompt that is exactly the shared blocks reuses all but its last block
    exact = [_req(f"e{i}", list(shared)) for i in range(3)]
    assert prefix_hit_floor(exact, block_size=4, max_num_seqs=1) == 2 * 4


def _result(counters: dict, outputs: list[GenOutput]) -> GenResult:
    return GenResult(outputs, Counters.from_dict(counters))


def test_each_disagreement_names_both_figures():
    outs = [GenOutput("a", [1, 2, 3], "length", 1, cached_tokens=16),
            GenOutput("b", [4, 5], "length", 0, cached_tokens=16)]
    agreeing = {"preemptions_recompute": 1, "preemptions_swap": 0, "preemptions_total": 1, "generated_tokens": 5,
                "prefix_cache_queries": 100, "prefix_cache_hits": 32}
    assert told_twice_disagreements(_result(agreeing, outs), hit_floor=32) == []
    cases = {
        "preemptions_total": (5, r"preemptions_total=5 .* add up to 1"),
        "generated_tokens": (7, r"generated_tokens=7 but the output tokens received = 5"),
        "prefix_cache_hits": (20, r"cached tokens add up to 32 but prefix_cache_hits=20"),
        "preemptions_recompute": (2, r"per-request preemptions add up to 1 but the counters say 2 recompute"),
    }
    for counter, (value, message) in cases.items():
        problems = told_twice_disagreements(_result({**agreeing, counter: value}, outs))
        assert any(re.search(message, p) for p in problems), (counter, problems)
    below = told_twice_disagreements(_result(agreeing, outs), hit_floor=48)
    assert any("prefix_cache_hits = 32, below the 48 tokens" in p for p in below)
    assert any("cached tokens (summed) = 32, below the 48" in p for p in below)


def test_what_is_not_told_twice_is_not_compared():
    outs = [GenOutput("a", [1, 2], "length")]  # no per-request counts
    assert told_twice_disagreements(_result({"preemptions_recompute": 3}, outs), hit_floor=0) == []


def test_a_servers_total_is_read_beside_its_by_mode_counts():
    text = "\n".join([
        "# TYPE vllm:num_preemptions counter", "vllm:num_preemptions_total 7",
        "# TYPE reference_engine:preemptions_recompute counter", "reference_engine:preemptions_recompute_total 3",
        "# TYPE reference_engine:preemptions_swap counter", "reference_engine:preemptions_swap_total 3",
    ]) + "\n"
    counters = cumulative_counters(MetricsSnapshot.parse(text))
    assert (counters.preemptions_total, counters.preemptions) == (7, 6)
    problems = told_twice_disagreements(GenResult([], counters))
    assert problems == ["preemptions_total=7 (the engine's own total) but its by-mode counts add up to 6 "
                        "(3 recompute + 3 swap)"]


# --------------------------------------------------------------------------- the checks, on engines

@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(builtin_checkpoint("tiny"))


@pytest.fixture(scope="module")
def truth_engine(model_dir):
    adapter = make_adapter(parse_engine_spec("hf"), model_dir)
    yield adapter
    adapter.close()


def test_prefix_check_fails_when_the_hit_counter_undercounts(model_dir, truth_engine):
    engine = make_adapter(parse_engine_spec("kvbench.conformance.faults:FaultyReferenceAdapter:"
                                            "fault=undercounts_prefix_hits"), model_dir)
    assert_fails(test_equivalence.test_prefix_caching_equivalence_and_hits,
                 r"cached tokens add up to \d+ but prefix_cache_hits=\d+", engine=engine, model_dir=model_dir,
                 truth_engine=truth_engine, near_ties=[])


@pytest.mark.server
def test_the_reference_server_tells_cached_tokens_per_response_and_they_agree(model_dir, truth_engine, tmp_path):
    engine = make_adapter(parse_engine_spec(f"server:preset=reference,log_dir={tmp_path}"), model_dir)
    try:
        requests = [GenRequest(f"r{i}", [5] * 40 + [10 + i], 3) for i in range(6)]
        knobs = roomy_knobs(engine, requests, max_num_seqs=2, enable_prefix_caching=True)
        result = engine.generate(requests, knobs)
        cached = [o.cached_tokens for o in result.outputs]
        assert None not in cached and sum(cached) == result.counters["prefix_cache_hits"] > 0
        floor = prefix_hit_floor(requests, knobs.block_size, 2)
        assert floor > 0 and told_twice_disagreements(result, floor) == []
    finally:
        engine.close()
