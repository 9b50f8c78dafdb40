"""Every conformance check fails on an engine broken in exactly the way the check is about.

Each case runs the suite's own test function (``suites/conformance``), called directly with a
:class:`~kvbench.conformance.faults.FaultyReferenceAdapter` as the engine, and expects it to fail
with the message that names the broken property. A skip counts as a defect here: the check must
catch the fault, not step aside. Check 5 (the refcount state machine) is shown failing on broken
block managers in ``tests/kvbench/test_stateful.py::test_machine_catches_a_broken_manager``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from _pytest.outcomes import Failed, Skipped

from kvbench.conformance.prove import near_tie_tolerance
from kvbench.core.liveness import DriverWatchdog, Liveness, LivenessError, Watchdog
from kvbench.engines.registry import make_adapter, parse_engine_spec
from suites.conformance import (
    test_admission,
    test_bad_input,
    test_equivalence,
    test_metrics_truth,
    test_nothing_lost,
    test_stop_conditions,
    test_victim,
)
from tests.kvbench import fault_test_fixtures as _shared

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
one_torch_thread = _shared.one_torch_thread
model_dir = _shared.model_dir
requests_greedy = _shared.requests_greedy
truth_engine = _shared.truth_engine
truth = _shared.truth


FAULTY = "kvbench.conformance.faults:FaultyReferenceAdapter"


def faulty(fault: str, model_dir: str, **options: str):
    extra = "".join(f",{k}={v}" for k, v in options.items())
    return make_adapter(parse_engine_spec(f"{FAULTY}:fault={fault}{extra}"), model_dir)


def assert_fails(check: Callable[..., Any], match: str, **kwargs: Any) -> str:
    """Run ``check``; it must fail (assertion, pytest.fail, LivenessError) with ``match`` in its message.
    A check that takes the suite's ``tolerance`` fixture gets the engine's, as the suite would give it."""
    import inspect

    if "tolerance" in inspect.signature(check).parameters and "tolerance" not in kwargs:
        kwargs["tolerance"] = near_tie_tolerance(kwargs["engine"])
    try:
        check(**kwargs)
    except (AssertionError, Failed, LivenessError) as e:
        message = str(e)
        assert re.search(match, message), f"the check failed, but not for the broken property: {message[:600]}"
        return message
    except Skipped as e:
        pytest.fail(f"the check skipped instead of failing on the broken engine: {e}")
    pytest.fail("the check passed on an engine broken in exactly the way it is about")


# ----------------------------------------------------------------------------------- checks 1-4, 7, 8
def test_unpressured_equivalence_fails_when_the_engine_miscomputes_a_position(model_dir, truth, requests_greedy,
                                                                             truth_engine):
    from kvbench.conformance.prove import roomy_knobs

    engine = faulty("miscomputes_one_position", model_dir)
    unpressured = engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))
    assert_fails(test_equivalence.test_unpressured_matches_ground_truth, r"differ from the ground truth",
                 engine=engine, unpressured=unpressured, truth=truth, requests_greedy=requests_greedy,
                 truth_engine=truth_engine, near_ties=[])


def test_swap_equivalence_fails_when_swap_in_scrambles_blocks(model_dir, truth, requests_greedy, truth_engine):
    assert_fails(test_equivalence.test_swap_preemption_equivalence, r"differ from the ground truth",
                 engine=faulty("scrambles_swap_in", model_dir), truth=truth, requests_greedy=requests_greedy,
                 truth_engine=truth_engine, near_ties=[])


def test_prefix_caching_on_equals_off_fails_when_a_hit_serves_stale_kv(model_dir, truth_engine):
    assert_fails(test_equivalence.test_prefix_caching_equivalence_and_hits, r"differ from the ground truth",
                 engine=faulty("serves_stale_cached_blocks", model_dir), model_dir=model_dir, truth_engine=truth_engine,
                 near_ties=[])


def test_over_long_prompt_check_fails_when_the_engine_truncates(model_dir, requests_greedy, truth, truth_engine):
    assert_fails(test_bad_input.test_over_long_prompt_is_refused_and_others_are_served,
                 r"the bad request was not refused", engine=faulty("truncates_over_long_prompts", model_dir),
                 model_dir=model_dir, requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine,
                 near_ties=[])


def test_invalid_configuration_check_fails_when_the_error_names_no_field(model_dir, requests_greedy):
    assert_fails(test_bad_input.test_invalid_configuration_names_the_field, r"the error does not name block_size",
                 knob="block_size", value=3, engine=faulty("vague_config_error", model_dir),
                 requests_greedy=requests_greedy)


def test_recompute_equivalence_fails_when_recompute_corrupts_output(model_dir, truth, requests_greedy, truth_engine):
    assert_fails(test_equivalence.test_recompute_preemption_equivalence, r"differ from the ground truth",
                 engine=faulty("corrupts_recomputed_output", model_dir), truth=truth, requests_greedy=requests_greedy,
                 truth_engine=truth_engine, near_ties=[])


def test_recompute_equivalence_fails_when_the_engine_aborts_its_victims(model_dir, truth, requests_greedy,
                                                                        truth_engine):
    # a prefix of the right tokens, finished "abort": exact only had the check asked for that abort
    assert_fails(test_equivalence.test_recompute_preemption_equivalence, r"aborted by the engine, not asked for",
                 engine=faulty("aborts_preemption_victims", model_dir), truth=truth, requests_greedy=requests_greedy,
                 truth_engine=truth_engine, near_ties=[])


def test_swap_round_trip_fails_when_swap_in_scrambles_blocks(model_dir, requests_greedy):
    assert_fails(test_equivalence.test_swapped_blocks_survive_the_round_trip_byte_for_byte, r"changed in transit",
                 engine=faulty("scrambles_swap_in", model_dir), requests_greedy=requests_greedy)


def test_prefix_caching_check_fails_when_caching_is_silently_off(model_dir, requests_greedy, truth, truth_engine):
    assert_fails(test_equivalence.test_recompute_after_preemption_reuses_cached_blocks,
                 r"prefix-cache hit on resume did not happen", engine=faulty("ignores_prefix_caching", model_dir),
                 requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])


def test_chunked_prefill_check_fails_when_the_budget_is_ignored(model_dir, truth, requests_greedy, truth_engine):
    assert_fails(test_equivalence.test_chunked_prefill_equivalence, r"chunked prefill did not happen", budget=16,
                 engine=faulty("ignores_token_budget", model_dir), truth=truth, requests_greedy=requests_greedy,
                 truth_engine=truth_engine, near_ties=[])


def test_seeded_sampling_check_fails_when_seeds_are_ignored(model_dir, truth_engine):
    assert_fails(test_equivalence.test_seeded_sampling_is_reproducible_across_preemption,
                 r"seeded sampling changed|another seed gave the same tokens", mode="recompute",
                 engine=faulty("ignores_seed", model_dir), model_dir=model_dir, truth_engine=truth_engine, near_ties=[])


def test_bad_input_check_fails_when_a_refusal_does_not_say_why(model_dir, requests_greedy, truth, truth_engine):
    assert_fails(test_bad_input.test_request_larger_than_the_pool_is_refused_and_others_are_served,
                 r"does not mention 'blocks'", engine=faulty("vague_rejection", model_dir),
                 requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])


def test_swap_exhaustion_check_fails_when_unswappable_victims_are_dropped(model_dir, requests_greedy, truth,
                                                                         truth_engine):
    assert_fails(test_bad_input.test_exhausted_swap_space_falls_back_to_recompute,
                 r"did not finish once swap space ran out", engine=faulty("drops_unswappable_victims", model_dir),
                 requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_fallback_check_fails_when_fallbacks_go_uncounted(mode, model_dir, requests_greedy):
    assert_fails(test_bad_input.test_every_swap_wanted_but_not_made_is_a_counted_fallback,
                 rf"{mode}: swap_fallbacks=0 but \d+ preemptions wanted a swap|a swap fallback did not happen",
                 mode=mode, engine=faulty("uncounted_swap_fallbacks", model_dir), requests_greedy=requests_greedy)


# ----------------------------------------------------------------------------------- check 6
@pytest.mark.parametrize(("fault", "match"), [
    ("never_aborts", r"aborts never reached the engine"),
    ("finishes_twice", r"finished more than once"),
    ("leaks_block", r"blocks are still held"),
    ("aborts_preemption_victims", r"aborted by the engine, not asked for"),
])
def test_nothing_lost_fails(fault, match, model_dir):
    assert_fails(test_nothing_lost.test_every_request_finishes_exactly_once, match, mode="recompute",
                 engine=faulty(fault, model_dir), model_dir=model_dir)


# ----------------------------------------------------------------------------------- check 9: victims
@pytest.mark.parametrize(("policy", "fault", "match"), [
    ("fcfs", "fcfs_oldest_victim", r"FCFS must preempt the latest admitted"),
    ("priority", "priority_most_important_victim", r"priority policy must preempt the least important"),
])
def test_victim_check_fails_on_the_wrong_victim(policy, fault, match, model_dir, requests_greedy):
    assert_fails(test_victim.test_preemption_victim_follows_the_policy, match, policy=policy,
                 engine=faulty(fault, model_dir), requests_greedy=requests_greedy)


# ----------------------------------------------------------------------------------- the same in bfloat16
@pytest.fixture(scope="module")
def truth_engine_bf16(model_dir):
    """The ground truth a bfloat16 engine is held to: transformers in bfloat16 (suites/conformance/conftest.py)."""
    adapter = make_adapter(parse_engine_spec("hf:dtype=bfloat16"), model_dir)
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def truth_bf16(truth_engine_bf16, requests_greedy):
    return truth_engine_bf16.generate(requests_greedy)


@pytest.mark.parametrize(("check", "fault"), [
    (test_equivalence.test_recompute_preemption_equivalence, "corrupts_recomputed_output"),
    (test_equivalence.test_swap_preemption_equivalence, "scrambles_swap_in"),
    (test_equivalence.test_unpressured_matches_ground_truth, "miscomputes_one_position"),
], ids=["recompute", "swap", "unpressured"])
def test_kv_faults_still_fail_in_bfloat16(check, fault, model_dir, requests_greedy, truth_bf16, truth_engine_bf16):
    """The near-tie rule of bfloat16 (tolerance 2.0 logits, above the top-2 margin at about 60% of positions)
    still catches KV-cache bugs: a near-tie must also have the engine's token within the tolerance of the
    ground truth's best (``confirm_near_tie``), which a corrupted KV rarely gives."""
    import inspect

    from kvbench.conformance.prove import roomy_knobs

    engine = faulty(fault, model_dir, dtype="bfloat16")
    assert near_tie_tolerance(engine) == 2.0
    available = {"engine": engine, "truth": truth_bf16, "requests_greedy": requests_greedy,
                 "truth_engine": truth_engine_bf16, "near_ties": []}
    if "unpressured" in inspect.signature(check).parameters:
        available["unpressured"] = engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))
    message = assert_fails(check, r"differ from the ground truth",
                           **{k: available[k] for k in inspect.signature(check).parameters if k in available})
    assert "tolerance 2" in message or "not a near tie" in message or "noise does not pick" in message, message


def test_prefix_caching_serving_stale_kv_still_fails_in_bfloat16(model_dir, truth_engine_bf16):
    assert_fails(test_equivalence.test_prefix_caching_equivalence_and_hits, r"differ from the ground truth",
                 engine=faulty("serves_stale_cached_blocks", model_dir, dtype="bfloat16"), model_dir=model_dir,
                 truth_engine=truth_engine_bf16, near_ties=[])


# ----------------------------------------------------------------------------------- stop conditions
@pytest.mark.parametrize(("condition", "fault", "match"), [
    ("stop_token_ids", "ignores_stop_token_ids", r"(?s)finish reasons differ.*expected 'stop'"),
    ("eos", "ignores_eos", r"(?s)finish reasons differ.*expected 'stop'"),
    ("max_tokens", "overruns_max_tokens", r"differ from the ground truth"),
])
def test_stop_condition_check_fails_when_the_condition_is_ignored(condition, fault, match, model_dir, requests_greedy,
                                                                 truth, truth_engine):
    assert_fails(test_stop_conditions.test_stop_condition_holds_under_pressure, match, condition=condition,
                 engine=faulty(fault, model_dir), requests_greedy=requests_greedy, truth=truth,
                 truth_engine=truth_engine, near_ties=[])


# ----------------------------------------------------------------------------------- metrics truth
@pytest.mark.parametrize(("mode", "fault", "match"), [
    ("recompute+prefix", "recomputed_counter_frozen", r"recomputed_tokens=0 but the tokens discarded"),
    ("swap", "preemptions_without_swaps", r"reports 0 preemptions but the events show 1"),
])
def test_metrics_truth_fails_on_a_lying_counter(mode, fault, match, model_dir, requests_greedy):
    assert_fails(test_metrics_truth.test_counters_agree_with_events_and_outputs, match, mode=mode,
                 engine=faulty(fault, model_dir), requests_greedy=requests_greedy)


def test_counts_told_twice_fail_when_a_counter_overcounts(model_dir, requests_greedy):
    assert_fails(test_metrics_truth.test_counts_told_twice_agree,
                 r"generated_tokens=\d+ but the output tokens received = \d+",
                 engine=faulty("overcounts_generated_tokens", model_dir), requests_greedy=requests_greedy)


# ----------------------------------------------------------------------------------- check 12: admission
def test_admission_check_fails_when_the_watermark_ignores_its_headroom(model_dir, requests_greedy):
    assert_fails(test_admission.test_watermark_admission_keeps_its_headroom, r"the headroom it must keep",
                 engine=faulty("admission_ignores_headroom", model_dir), requests_greedy=requests_greedy)


# ----------------------------------------------------------------------------------- liveness
def test_a_livelocked_engine_fails_its_check_quickly_naming_the_stuck_requests(model_dir, truth, requests_greedy,
                                                                              truth_engine):
    # "quickly" is decided by what fired, not by a stopwatch: the 200-step limit (the message says
    # "200 steps"), not the 60 s no-progress limit, whose message gives seconds instead
    message = assert_fails(test_equivalence.test_recompute_preemption_equivalence,
                           r"no token and no state change for 200 steps", engine=faulty("livelock", model_dir),
                           truth=truth, requests_greedy=requests_greedy, truth_engine=truth_engine, near_ties=[])
    assert re.search(r"r00\d\d \((running|waiting)", message), message


def test_the_driver_watchdog_names_stuck_requests_of_a_timed_run(model_dir):
    """The same fault under ``serve`` (kvbench.drivers.step_loop.drive), with a smaller step limit."""
    engine = faulty("livelock", model_dir)
    engine.liveness = Liveness(stall_steps=50, stall_seconds=None)
    message = assert_fails(test_nothing_lost.test_every_request_finishes_exactly_once, r"for 50 steps.*stuck",
                           mode="recompute", engine=engine, model_dir=model_dir)
    assert re.search(r"\((waiting|running|preempted)", message), message


def test_watchdog_counts_steps_and_seconds_without_progress():
    now = [0.0]
    dog = Watchdog(Liveness(stall_steps=3, stall_seconds=10.0), clock=lambda: now[0])
    dog.observe(5, {"a": "running"})
    dog.observe(6, {"a": "running"})  # work: progress
    dog.observe(6, {"a": "waiting"})  # a state change: progress
    dog.observe(6, {"a": "waiting"})
    dog.observe(6, {"a": "waiting"})
    with pytest.raises(LivenessError, match=r"for 3 steps.*a \(waiting\)") as info:
        dog.observe(6, {"a": "waiting"})
    assert info.value.stuck == {"a": "waiting"}
    slow = Watchdog(Liveness(stall_steps=None, stall_seconds=10.0, deadline=100.0), clock=lambda: now[0])
    slow.observe(1, {"b": "running"})
    now[0] = 11.0
    with pytest.raises(LivenessError, match=r"for 11.0 s"):
        slow.observe(1, {"b": "running"})
    now[0] = 0.0
    late = Watchdog(Liveness(deadline=100.0), clock=lambda: now[0])
    now[0] = 101.0
    with pytest.raises(LivenessError, match="deadline of 100 s"):
        late.observe(1, {})


def test_driver_watchdog_follows_states_from_step_reports():
    from kvbench.core.trace import StepRecord
    from kvbench.drivers.step_loop import StepReport

    dog = DriverWatchdog(Liveness(stall_steps=2, stall_seconds=None))
    dog.submitted("x")
    dog.saw_step(StepReport({}, {}, ["x"], [], [], StepRecord(0, 0, 1, 0, num_prefill_tokens=16)))
    assert dog.states == {"x": "running"}
    dog.saw_step(StepReport({}, {}, [], [("x", "swap")], [], StepRecord(0, 0, 0, 0)))
    dog.abort_sent("x")
    assert dog.states == {"x": "preempted (swap), abort requested"}
    dog.saw_step(StepReport({}, {}, [], [], [], StepRecord(0, 0, 0, 0)))  # the abort request: a change
    dog.saw_step(StepReport({}, {}, [], [], [], StepRecord(0, 0, 0, 0)))  # 1 step without progress
    with pytest.raises(LivenessError, match=r"x \(preempted \(swap\), abort requested\)"):
        dog.saw_step(StepReport({}, {}, [], [], [], StepRecord(0, 0, 0, 0)))


@pytest.mark.parametrize("value", [0, -1, True, "3"])
def test_liveness_limits_are_validated_naming_the_field(value):
    with pytest.raises(ValueError, match=r"Liveness\.stall_steps"):
        Liveness(stall_steps=value)


# ----------------------------------------------------------------------- check 8d judges the engine
@pytest.mark.parametrize(("knob", "value"), [("block_size", 3), ("num_gpu_blocks", -1),
                                             ("preemption_mode", "teleport")])
def test_invalid_configuration_skips_when_the_adapter_refuses_first(knob, value, model_dir, requests_greedy):
    """hf-cb's adapter refuses these values before transformers sees them: the check must not credit the
    engine with the adapter's words (docs/checks.md#the-checks-suitesconformance, check 8)."""
    engine = make_adapter(parse_engine_spec("hf-cb"), model_dir)
    try:
        with pytest.raises(Skipped, match=rf"adapter refused {knob}=.*before the engine saw it"):
            test_bad_input.test_invalid_configuration_names_the_field(knob=knob, value=value, engine=engine,
                                                                       requests_greedy=requests_greedy)
    finally:
        engine.close()


def test_invalid_configuration_passes_on_the_engines_own_refusal(model_dir, requests_greedy):
    engine = make_adapter(parse_engine_spec("reference"), model_dir)
    test_bad_input.test_invalid_configuration_names_the_field(knob="block_size", value=3, engine=engine,
                                                               requests_greedy=requests_greedy)


def test_the_docs_map_every_fault_to_a_check_and_an_existing_test():
    """docs/checks.md's check -> fault -> test table names every fault of FAULTS, and every test it names exists."""
    from pathlib import Path

    from kvbench.conformance.faults import FAULTS

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "checks.md").read_text(encoding="utf-8")
    table = page[page.index("| check | fault (`kvbench/conformance/faults.py`)"):]
    table = table[:table.index("\n\n")]
    missing = [f for f in FAULTS if f"`{f}`" not in table]
    assert not missing, f"faults with no row in docs/checks.md's check -> fault -> test table: {missing}"
    for file, name in re.findall(r"`(test_[a-z_]+\.py)::(test_[a-z_]+)`", table):
        found = sorted((root / "tests").rglob(file))  # tests/engine/ or tests/kvbench/
        assert found, f"{file}, named in docs/checks.md, is not under tests/"
        assert f"def {name}(" in found[0].read_text(encoding="utf-8"), f"{file}::{name} is gone"


# ----------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def faulty_server(model_dir, tmp_path_factory):
    """One patched reference server for every fault over HTTP: each test names its fault with ``use_fault``
    and gets an engine built after that (a reconfigure in the running server), as a fresh server would have."""
    from kvbench.conformance.faults import FaultyServerAdapter

    engine = FaultyServerAdapter(model_dir, {"fault": "leaks_block", "log_dir": str(tmp_path_factory.mktemp("logs"))})
    yield engine
    engine.close()


def with_fault(engine: Any, fault: str) -> Any:
    engine.use_fault(fault)
    return engine


@pytest.mark.server
def test_recompute_equivalence_fails_over_http_on_a_server_that_corrupts_recomputed_output(
        faulty_server, truth, requests_greedy, truth_engine):
    assert_fails(test_equivalence.test_recompute_preemption_equivalence, r"differ from the ground truth",
                 engine=with_fault(faulty_server, "corrupts_recomputed_output"), truth=truth,
                 requests_greedy=requests_greedy, truth_engine=truth_engine, near_ties=[])


@pytest.mark.server
def test_over_long_prompt_check_fails_over_http_on_a_server_that_truncates(faulty_server, model_dir, requests_greedy,
                                                                           truth, truth_engine):
    assert_fails(test_bad_input.test_over_long_prompt_is_refused_and_others_are_served,
                 r"the bad request was not refused", engine=with_fault(faulty_server, "truncates_over_long_prompts"),
                 model_dir=model_dir, requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine,
                 near_ties=[])


# checks that run on a black-box engine, each failing over HTTP on the reference server with an engine fault
# inside it: (check, the fault, what the failure must say, the check's own parameters)
HTTP_CASES = [
    pytest.param(test_equivalence.test_unpressured_matches_ground_truth, "miscomputes_one_position",
                 r"differ from the ground truth", {}, id="unpressured-equivalence"),
    pytest.param(test_equivalence.test_swap_preemption_equivalence, "scrambles_swap_in",
                 r"differ from the ground truth", {}, id="swap-equivalence"),
    pytest.param(test_equivalence.test_prefix_caching_equivalence_and_hits, "serves_stale_cached_blocks",
                 r"differ from the ground truth", {}, id="prefix-caching"),
    pytest.param(test_equivalence.test_prefix_caching_equivalence_and_hits, "undercounts_prefix_hits",
                 r"cached tokens add up to \d+ but prefix_cache_hits=\d+", {}, id="prefix-hits-told-twice"),
    pytest.param(test_equivalence.test_recompute_after_preemption_reuses_cached_blocks, "ignores_prefix_caching",
                 r"prefix-cache hit on resume did not happen", {}, id="prefix-reuse-on-resume"),
    pytest.param(test_equivalence.test_chunked_prefill_equivalence, "ignores_token_budget",
                 r"chunked prefill did not happen", {"budget": 16}, id="chunked-prefill"),
    pytest.param(test_bad_input.test_request_larger_than_the_pool_is_refused_and_others_are_served,
                 "vague_rejection", r"does not mention 'blocks'", {}, id="larger-than-the-pool"),
    pytest.param(test_bad_input.test_exhausted_swap_space_falls_back_to_recompute, "drops_unswappable_victims",
                 r"did not finish once swap space ran out", {}, id="swap-space-exhausted"),
    pytest.param(test_equivalence.test_seeded_sampling_is_reproducible_across_preemption, "ignores_seed",
                 r"seeded sampling changed|another seed gave the same tokens", {"mode": "recompute"},
                 id="seeded-sampling"),
    pytest.param(test_stop_conditions.test_stop_condition_holds_under_pressure, "overruns_max_tokens",
                 r"differ from the ground truth", {"condition": "max_tokens"}, id="stop-max-tokens"),
    pytest.param(test_metrics_truth.test_counts_told_twice_agree, "overcounts_generated_tokens",
                 r"generated_tokens=\d+ but the output tokens received = \d+", {}, id="counts-told-twice"),
    pytest.param(test_nothing_lost.test_every_request_finishes_exactly_once, "leaks_block",
                 r"blocks are still held", {"mode": "recompute"}, id="nothing-lost-leak"),
    pytest.param(test_nothing_lost.test_every_request_finishes_exactly_once, "never_aborts",
                 r"aborts counter 0 but \d+ requests were aborted by the client", {"mode": "recompute"},
                 id="nothing-lost-abort"),
    # the engine's own aborts show per request (one the workload never aborts ended "abort") or, where every victim
    # was one the client would have closed later, in the count (more aborts than the client closed streams): which
    # one depends on which requests the storm preempts over HTTP (one full-suite run in four saw the second)
    pytest.param(test_nothing_lost.test_every_request_finishes_exactly_once, "aborts_preemption_victims",
                 r"aborted by the engine, not asked for|aborts counter \d+ but the client closed only \d+ streams",
                 {"mode": "recompute"}, id="nothing-lost-victims"),
]


@pytest.mark.server
@pytest.mark.parametrize(("check", "fault", "match", "params"), HTTP_CASES)
def test_black_box_checks_fail_over_http_on_a_faulty_server(check, fault, match, params, faulty_server, model_dir,
                                                            truth, requests_greedy, truth_engine):
    import inspect

    from kvbench.conformance.prove import roomy_knobs

    engine = with_fault(faulty_server, fault)
    available = {"engine": engine, "model_dir": model_dir, "truth": truth, "requests_greedy": requests_greedy,
                 "truth_engine": truth_engine, "near_ties": [], "tolerance": near_tie_tolerance(engine), **params}
    if "unpressured" in inspect.signature(check).parameters:  # the suite's fixture, made the same way
        available["unpressured"] = engine.generate(requests_greedy, roomy_knobs(engine, requests_greedy))
    assert_fails(check, match, **{k: available[k] for k in inspect.signature(check).parameters})


@pytest.mark.server
def test_one_server_serves_fault_after_fault_each_in_a_fresh_engine(faulty_server, tmp_path):
    """What the HTTP cases rest on: ``use_fault`` gives the next call an engine built after it, with that
    fault, in the same server process (a reconfigure, not a new server); the same fault again still gets a
    fresh engine: the blocks the previous run leaked are not held any more."""
    import httpx

    from kvbench.conformance.faults import FaultyServerAdapter
    from kvbench.core.requests import GenRequest
    from kvbench.drivers.server_metrics import MetricsSnapshot, blocks_in_use

    def blocks_held() -> int | None:
        argv = faulty_server.process.argv
        url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/metrics"
        return blocks_in_use(MetricsSnapshot.parse(httpx.get(url, timeout=30).text))

    requests = [GenRequest(f"r{i}", [5 + i] * 20, 4) for i in range(3)]  # alike: each holds as many blocks
    with_fault(faulty_server, "leaks_block").generate(requests)
    server, leak, reconfigures = faulty_server.process, blocks_held(), faulty_server.reconfigures
    assert leak, "leaks_block leaked nothing: the fault did not reach the engine"
    with_fault(faulty_server, "leaks_block").generate(requests)
    assert faulty_server.process is server and server.running(), "use_fault started a new server"
    assert faulty_server.reconfigures == reconfigures + 1
    assert blocks_held() == leak, "the engine was not fresh: it still held the previous run's leak"
    overcounting = with_fault(faulty_server, "overcounts_generated_tokens").generate(requests)
    assert faulty_server.process is server and blocks_held() == 0
    assert overcounting.counters["generated_tokens"] > 12, "the new fault did not reach the engine"
    with pytest.raises(ValueError, match=r"fault='vague_config_error' is invalid"):
        FaultyServerAdapter(faulty_server.model_dir, {"fault": "vague_config_error", "log_dir": str(tmp_path)})


def test_a_patch_is_named_by_import_path_and_a_config_fault_is_refused():
    from kvbench.testing.patched_server import resolve

    for bad in ("no-colon", "kvbench.conformance.faults:nothing_here"):
        with pytest.raises(ValueError, match="--patch"):
            resolve(bad)
    with pytest.raises(ValueError, match="not a patch of a built engine"):
        resolve("kvbench.conformance.faults:apply_fault=vague_config_error")(object())
