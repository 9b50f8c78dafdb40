"""The scenarios' claims read the engine's own evidence (kvbench.bench.scenarios.claims): a server's preemption
counter over the claim's window before a sampled gauge; "not exposed", "did not fire" and "not reached" kept apart;
a workload that did not reach its own pressure is undecided, never a failed benchmark."""

from __future__ import annotations

import pytest

from kvbench.bench import scenarios as sc
from kvbench.bench.results import Results, ResultsError, validate
from kvbench.bench.scenarios.claims import Decision, pressure, undecided_summary
from kvbench.core.trace import StepRecord
from kvbench.drivers.http_driver import CLIENT_SIDE_BLIND_SPOTS
from tests.kvbench.trace_factory import make_trace, req

TINY = sc.Model("tiny-ckpt", "tiny", vocab_size=512, max_model_len=1024)
WAVE_AT = sc.EVENING_SURGE.size("quick").wave_start_s
FILLED = "the wave filled the KV pool (peak usage > 90%)"
PREEMPTED = "the wave preempted running requests"


def sample(t: float, kv: float | None, preempted: int | None) -> StepRecord:
    """A /metrics sample as the HTTP driver records it: queues, KV usage, the server's count since the first."""
    return StepRecord(t, 0.1, 4, 0, kv_usage=kv, sampled=True, server_preemptions=preempted)


def server_trace(samples: list[StepRecord], counters: dict | None) -> object:
    """A run seen from an HTTP client: per-request records blind (the driver's not_exposed), the counters the
    before/after scrapes gave (None: the server publishes none), the sampler's records."""
    requests = [req("r0000", 0.5, [0.6, 0.7], prompt_len=40), req("r0001", WAVE_AT + 0.1, [WAVE_AT + 1.0],
                                                                   prompt_len=600)]
    return make_trace(*requests, steps=samples, counters=counters or {}, not_exposed=dict(CLIENT_SIDE_BLIND_SPOTS),
                      duration=WAVE_AT + 2.0)


def judge_surge(trace: object) -> sc.Outcome:
    (job,) = sc.EVENING_SURGE.plan("quick", TINY)
    return sc.EVENING_SURGE.judge([sc.Served(job, trace)], "quick", TINY)


VLLM_COUNTERS = {"preemptions_recompute": 3, "preemptions_swap": 0}  # vllm:num_preemptions_total, read as recompute


def test_a_low_sampled_gauge_beside_a_risen_preemption_counter_counts_as_pressured():
    """The evening surge of issue 34: a 10 Hz sample read 83.6% at most while the server counted preemptions after
    the wave began. The engine preempts only when no block is free, so the pool ran dry: both pressure claims hold,
    decided on the server's counter, not on the gauge."""
    samples = [sample(0.0, 0.1, 0), sample(1.0, 0.4, 0), sample(WAVE_AT + 0.2, 0.836, 0), sample(WAVE_AT + 0.4, 0.8, 2),
               sample(WAVE_AT + 0.8, 0.7, 3), sample(WAVE_AT + 1.9, 0.0, 3)]
    outcome = judge_surge(server_trace(samples, VLLM_COUNTERS))
    assert outcome.claims[FILLED] is True and outcome.claims[PREEMPTED] is True, outcome.undecided_reasons
    # the gauge alone would have said otherwise
    assert max(s.kv_usage for s in samples) < sc.FULL_POOL
    # and the results say what decided each claim
    results = Results()
    sc.record(outcome, results, "server:preset=vllm")
    (entry,) = results.scenario("evening_surge")["results"]
    assert "0 before, 3 after, 0 across" in entry["claim_evidence"][PREEMPTED]
    assert "the server's preemption counter" in entry["claim_evidence"][PREEMPTED]
    assert "the pool ran dry" in entry["claim_evidence"][FILLED]


def test_counts_after_the_last_sample_come_from_the_runs_total():
    """A preemption counted after the sampler's last scrape (the settle's after-scrape saw it) is still one of
    the run's: placed after the last sample."""
    samples = [sample(0.0, 0.1, 0), sample(WAVE_AT + 0.5, 0.7, 0)]
    split = sc.preemption_split(server_trace(samples, {"preemptions_recompute": 2, "preemptions_swap": 0}), WAVE_AT)
    assert (split.before, split.after, split.straddling, split.exact) == (0, 2, 0, False)


def test_a_server_without_a_preemption_counter_leaves_the_claims_not_exposed():
    """No counter and no per-request records: "not exposed", with no word of a mechanism that did not fire."""
    samples = [sample(0.0, None, None), sample(WAVE_AT + 0.5, None, None)]
    outcome = judge_surge(server_trace(samples, None))
    for claim in (FILLED, PREEMPTED):
        assert outcome.claims[claim] is None
        assert outcome.undecided_kinds[claim] == "not exposed"
        assert "did not" not in outcome.undecided_reasons[claim]
    assert "publishes no preemption counter" in outcome.undecided_reasons[PREEMPTED]


def test_a_published_counter_that_did_not_move_did_not_fire():
    samples = [sample(0.0, 0.1, 0), sample(WAVE_AT + 0.5, 0.6, 0), sample(WAVE_AT + 1.5, 0.2, 0)]
    outcome = judge_surge(server_trace(samples, {"preemptions_recompute": 0, "preemptions_swap": 0}))
    assert outcome.claims[PREEMPTED] is None and outcome.undecided_kinds[PREEMPTED] == "did not fire"
    assert "published and did not move" in outcome.undecided_reasons[PREEMPTED]
    # the pool claim: its gauge read 60% at most and nothing was counted: the wave did not reach its pressure
    assert outcome.undecided_kinds[FILLED] == "not reached"
    assert "60.0%" in outcome.undecided_reasons[FILLED] and "can miss the peak" in outcome.undecided_reasons[FILLED]
    assert outcome.failures() == []  # a workload that did not push this engine is not this engine's failure


def test_counts_that_cannot_be_placed_around_the_wave_are_not_exposed_not_shown():
    """A counter that rose before the wave and between the samples around its start: a count may lag its
    preemption (vLLM V1 counts one at its victim's next output), so which side of the wave it belongs to cannot
    be told from outside: undecided, "not exposed", never "held"."""
    samples = [sample(0.0, 0.1, 0), sample(WAVE_AT - 1.0, 0.9, 1), sample(WAVE_AT + 0.3, 0.9, 2),
               sample(WAVE_AT + 1.0, 0.9, 4)]
    decision = sc.preempted_after(server_trace(samples, {"preemptions_recompute": 4, "preemptions_swap": 0}),
                                  WAVE_AT, "the wave")
    assert decision.held is None and decision.kind == "not exposed"
    assert "1 before, 2 after, 1 across" in decision.why


def test_preemptions_only_before_the_surge_are_shown_as_such():
    samples = [sample(0.0, 0.1, 0), sample(1.0, 0.95, 2), sample(WAVE_AT + 1.0, 0.5, 2)]
    decision = sc.preempted_after(server_trace(samples, {"preemptions_recompute": 2, "preemptions_swap": 0}),
                                  WAVE_AT, "the wave")
    assert decision.held is False and "every preemption came before the wave began" in decision.why


def test_a_precondition_not_reached_is_undecided_not_failed_and_a_mechanism_not_shown_fails():
    not_held = Decision(False, why="peak 50%")
    assert pressure(not_held) == Decision(None, "not reached", "peak 50%")
    assert pressure(Decision(False, "did not fire", "0")).kind == "did not fire"
    assert pressure(Decision(True)) == Decision(True)
    with pytest.raises(ValueError, match="needs a kind"):
        Decision(None)
    # the chunked scenario's roomy pool is its own condition: a preemption there is "not reached", not a failure
    served = [sc.Served(job, make_trace(req("a", 0.0, [0.1]), counters={"preemptions_recompute": 2,
                                                                        "preemptions_swap": 0, "prefill_chunks": 3}))
              for job in sc.CHUNKED_PREFILL.plan("quick", TINY)]
    outcome = sc.CHUNKED_PREFILL.judge(served, "quick", TINY)
    claim = "no preemption muddied the comparison"
    assert outcome.claims[claim] is None and outcome.undecided_kinds[claim] == "not reached"
    # before, an engine that publishes no preemption counter passed this claim: now it is "not exposed"
    blind = [sc.Served(job, make_trace(req("a", 0.0, [0.1]), not_exposed=dict(CLIENT_SIDE_BLIND_SPOTS)))
             for job in sc.CHUNKED_PREFILL.plan("quick", TINY)]
    blind_outcome = sc.CHUNKED_PREFILL.judge(blind, "quick", TINY)
    assert blind_outcome.claims[claim] is None and blind_outcome.undecided_kinds[claim] == "not exposed"
    assert all(blind_outcome.undecided_kinds[c] == "not exposed" for c in blind_outcome.claims
               if c.startswith("budget") or c.startswith("unchunked"))


def test_on_a_server_the_storm_decides_from_each_points_counters():
    """vLLM counts preemptions on /metrics: the storm's claims decide from the counter of each point's run
    (scraped before and after it), and the one claim needing a recomputed-token counter says it is not exposed."""
    def point(preempted: int) -> dict:
        return {"preemptions": float(preempted), "recomputed_tokens": None, "swap_outs": None}

    decisions = sc.storm_decisions([point(0), point(0), point(7)], [2, 8, 16])
    assert [d.held for d in decisions.values()] == [True, True, True, None]
    redone = decisions["preempted work was recomputed or swapped"]
    assert redone.kind == "not exposed" and "recomputed-token" in redone.why


def test_the_skip_reason_names_each_claims_kind():
    outcome = sc.Outcome(sc.EVENING_SURGE, "quick", {}, claims={FILLED: None, PREEMPTED: None,
                                                                 "every request finished": True},
                         undecided_reasons={FILLED: "not reached: peak 60%", PREEMPTED: "did not fire: 0"},
                         undecided_kinds={FILLED: "not reached", PREEMPTED: "did not fire"})
    reason = undecided_summary(outcome)
    assert reason is not None and "nothing decided" in reason
    assert f"{FILLED} (not reached: peak 60%)" in reason and f"{PREEMPTED} (did not fire: 0)" in reason
    outcome.claims[PREEMPTED] = True
    assert undecided_summary(outcome) is None


def test_results_keep_skipped_scenarios_and_undecided_kinds():
    results = Results()
    results.add_skipped_scenario("swap_vs_recompute", "server:preset=vllm", "lacks capability events")
    results.add_skipped_scenario("swap_vs_recompute", "server:preset=vllm", "lacks capability events, swap")
    entry = results.add_scenario_result("evening_surge", "server:preset=vllm", {"requests": 2.0},
                                        undecided={PREEMPTED: "did not fire: 0"},
                                        undecided_kinds={PREEMPTED: "did not fire"})
    assert entry["undecided_kinds"] == {PREEMPTED: "did not fire"}
    again = Results.from_dict(results.to_dict())
    assert again.skipped_scenarios == [{"scenario": "swap_vs_recompute", "engine": "server:preset=vllm",
                                        "reason": "lacks capability events, swap"}]
    with pytest.raises(ResultsError, match="undecided_kinds"):
        results.add_scenario_result("evening_surge", "x", {}, undecided_kinds={PREEMPTED: "maybe"})
    old = results.to_dict()
    del old["skipped_scenarios"]
    for sc_ in old["scenarios"]:
        for res in sc_["results"]:
            del res["undecided_kinds"]
    assert validate(old)["skipped_scenarios"] == []  # older files read as nothing skipped
    with pytest.raises(ResultsError, match="skipped_scenarios"):
        validate({**old, "skipped_scenarios": [{"scenario": "x"}]})


def test_chunked_prefill_split_is_proven_from_the_budget_the_server_confirms():
    """vLLM counts no prefill chunks: the split is read as the conformance check reads it, from the budget the
    server itself confirms (never the one kvbench asked for), and only where it says so."""
    long_prompt = make_trace(req("a", 0.0, [0.5, 0.6], prompt_len=700), not_exposed=dict(CLIENT_SIDE_BLIND_SPOTS))
    said = {"enable_chunked_prefill": True, "max_num_batched_tokens": 128, "enable_prefix_caching": False}
    claim = "budget 128: long prompts were split into chunks"
    decided = sc.chunked_decisions(long_prompt, {128: long_prompt}, 600, {128: said})[claim]
    assert decided.held is True and "at least 5 prefill chunks" in decided.why
    assert sc.chunked_decisions(long_prompt, {128: long_prompt}, 600)[claim].kind == "not exposed"  # nothing said
    unknown_cache = {**said, "enable_prefix_caching": None}
    assert sc.chunked_decisions(long_prompt, {128: long_prompt}, 600, {128: unknown_cache})[claim].kind == \
        "not exposed"
    roomy = {**said, "max_num_batched_tokens": 2048}
    assert sc.chunked_decisions(long_prompt, {128: long_prompt}, 600, {128: roomy})[claim].kind == "not reached"
    # an engine that counts its chunks is read by its counter, whatever it says
    counted = make_trace(req("a", 0.0, [0.5], prompt_len=700), counters={"prefill_chunks": 0})
    assert sc.chunked_decisions(counted, {128: counted}, 600, {128: said})[claim].held is False


def test_a_merge_keeps_every_shards_skipped_scenarios():
    from kvbench.bench.merge import merge_results

    parts = []
    for i, engine in enumerate(("reference", "server:preset=vllm")):
        part = Results()
        part.data["shard"] = {"index": i + 1, "count": 2}
        part.add_skipped_scenario("swap_vs_recompute", engine, f"reason {i}")
        parts.append((f"{i}.json", part))
    merged = merge_results(parts)
    assert [(s["engine"], s["reason"]) for s in merged.skipped_scenarios] == [
        ("reference", "reason 0"), ("server:preset=vllm", "reason 1")]


def test_a_failed_every_request_finished_says_how_the_requests_ended() -> None:
    """Not "requests_finished=52" beside a failed claim: how many were not served and the server's words."""
    from types import SimpleNamespace

    from kvbench.bench.scenarios.common import SANITY_CLAIM, Outcome, ResultEntry, say_why_unfinished, unserved
    from kvbench.core.trace import TraceRecorder

    rec = TraceRecorder("e", "s")
    for i in range(4):
        rec.arrived(f"r{i}", 0.0, 10, 4)
    rec.finished("r0", 1.0, "length")
    rec.finished("r1", 1.0, "stop")
    rec.error_event("r2", "Context size has been exceeded.")
    rec.finished("r2", 1.0, "error")
    trace = rec.finish()
    said = unserved(trace)
    assert said is not None and said.startswith("2 of 4 not served")
    assert '1 error ("Context size has been exceeded.")' in said and "1 never finished" in said
    outcome = Outcome(scenario=SimpleNamespace(name="surge"), scale="quick", parameters={},  # type: ignore[arg-type]
                      entries=[ResultEntry(trace=trace)], claims={SANITY_CLAIM: False})
    say_why_unfinished(outcome)
    assert outcome.claim_evidence[SANITY_CLAIM] == said
    assert said in outcome.explain()
