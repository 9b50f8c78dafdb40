"""A pin that needs a precondition of the checkpoint or workload (``needs = "greedy_reaches_eos"``): where the check
recorded that it held, the pin is judged as any other (failed as pinned: expected; passed: stale); where it did not
hold, the pin was not exercised and the check's own verdict stands, said in the summary and in results.json; an
unknown precondition in a file is an error naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.conformance.expectations import SHIPPED, ExpectationsError, load_expectations
from kvbench.conformance.preconditions import (
    eos_token_ids,
    note_greedy_reaches_eos,
    precondition_held,
    record_precondition,
)
from kvbench.core.evidence import collecting, evidence_of
from tests.kvbench import fault_test_fixtures as _shared

pytest_plugins = ["pytester"]

SUITE = '''
import pytest
from kvbench.conformance.preconditions import record_precondition
from kvbench.conformance.verdict import claim, record_proof, undecided
pytestmark = pytest.mark.conformance

def test_healthy(engine_spec):
    record_proof("preemptions_recompute", 3)  # a pressured check that proved its mechanism: the run can be green

def test_eos_shows(engine_spec):
    record_precondition("greedy_reaches_eos", False)  # one part of the check without EOS, one with:
    record_precondition("greedy_reaches_eos", True)   # it held in the check
    claim(False, "r1: expected token 2, got 7")

def test_eos_fixed(engine_spec):
    record_precondition("greedy_reaches_eos", True)

def test_no_eos_passes(engine_spec):
    record_precondition("greedy_reaches_eos", False)

def test_no_eos_undecided(engine_spec):
    record_precondition("greedy_reaches_eos", False)
    undecided("no counter could prove chunking")

def test_no_eos_fails_otherwise(engine_spec):
    record_precondition("greedy_reaches_eos", False)
    assert False, "r3: expected token 9, got 7"

def test_no_eos_yet_the_pinned_claim(engine_spec):
    claim(False, "r1: expected token 2, got 7")  # excused while the precondition was not known yet
    record_precondition("greedy_reaches_eos", False)

def test_never_recorded(engine_spec):
    pass
'''

ENTRY = '''
[[expected_failure]]
engine = "reference"
check = "{check}"
match = "expected token 2, got"
reason = "bans EOS {check}"
reproduction = "python repro.py {check}"
needs = "{needs}"
'''


def expectations(tmp_path: Path, *checks: str, needs: str = "greedy_reaches_eos") -> str:
    path = tmp_path / "expect.toml"
    path.write_text("".join(ENTRY.format(check=c, needs=needs) for c in checks))
    return str(path)


def run(pytester, tmp_path, path: str, select: str, *more: str):
    pytester.makepyfile(test_suite=SUITE)
    report_dir = tmp_path / "reports"
    result = pytester.runpytest_subprocess("--engine", "reference", "--kvbench-expectations", path, "-p",
                                           "no:cacheprovider", "-rfx", "--report-dir", str(report_dir), "-k", select,
                                           *more)
    [results] = report_dir.glob("*/results.json")
    records = {r["check"]: r for r in json.loads(results.read_text())["conformance"]}
    return result, records


def test_a_precondition_that_held_judges_the_pin_as_before(pytester, tmp_path):
    """Held and failed as pinned: the expected failure; held and passed: stale, as a pin without ``needs``."""
    path = expectations(tmp_path, "eos_shows", "eos_fixed")
    result, records = run(pytester, tmp_path, path, "test_eos_shows or test_eos_fixed or test_healthy")
    result.assert_outcomes(passed=1, xfailed=1, failed=1)
    result.stdout.fnmatch_lines([f"*now passes: the expectation is stale, remove it from {path}*",
                                 "*expected failure*test_eos_shows*", "*STALE*test_eos_fixed*now passes*"])
    assert records["eos_shows"]["outcome"] == "xfailed"
    assert records["eos_fixed"]["outcome"] == "xpassed"
    assert records["eos_shows"]["evidence"]["precondition.greedy_reaches_eos"] is True  # held in one part of two
    assert "pin" not in records["eos_shows"] and "pin" not in records["eos_fixed"]
    assert "NOT EXERCISED" not in result.stdout.str()


def test_a_precondition_that_did_not_hold_leaves_the_checks_own_verdict(pytester, tmp_path):
    """Not held: the pin is not exercised, neither stale nor an excuse; a pass passes, an undecided check is
    undecided, a failure is a plain failure, and a claim the pin excused before the precondition was known fails."""
    checks = ("no_eos_passes", "no_eos_undecided", "no_eos_fails_otherwise", "no_eos_yet_the_pinned_claim")
    path = expectations(tmp_path, *checks)
    result, records = run(pytester, tmp_path, path, " or ".join(f"test_{c}" for c in [*checks, "healthy"]))
    result.assert_outcomes(passed=2, skipped=1, failed=2)
    out = result.stdout.str()
    assert "stale" not in out and "expected failure " not in out
    result.stdout.fnmatch_lines([
        "*?PIN NOT EXERCISED? the expectation in * needs greedy_reaches_eos (*EOS token), which did not hold on this "
        "checkpoint/workload: not exercised, the check's own verdict stands; the claims it would have excused fail:*",
        "*AssertionError: r1: expected token 2, got 7*",
    ])
    result.stdout.fnmatch_lines(["*test_no_eos_fails_otherwise*", "*AssertionError: r3: expected token 9, got 7*"])
    assert "r3: expected token 9, got 7" in records["no_eos_fails_otherwise"]["reason"]  # its own failure, not the pin
    for check, verdict in (("no_eos_passes", "passed"), ("no_eos_undecided", "undecided"),
                           ("no_eos_fails_otherwise", "failed"), ("no_eos_yet_the_pinned_claim", "failed")):
        result.stdout.fnmatch_lines([f"*NOT EXERCISED *test_{check}*: reference / {check} needs greedy_reaches_eos "
                                     f"(*), which did not hold on this checkpoint/workload; the check's own "
                                     f"verdict stands: {verdict}*"])
        record = records[check]
        assert record["outcome"] == verdict, check
        assert record["pin"]["state"] == "not_exercised" and record["pin"]["needs"] == "greedy_reaches_eos"
        assert "did not hold on this checkpoint/workload" in record["pin"]["reason"]
        assert record["evidence"]["precondition.greedy_reaches_eos"] is False


def test_a_pin_not_exercised_reaches_the_controller_under_xdist(pytester, tmp_path):
    """Workers run the checks: the finding and the record's ``pin`` come back to the controller with the report."""
    path = expectations(tmp_path, "no_eos_passes")
    result, records = run(pytester, tmp_path, path, "test_no_eos_passes or test_healthy", "-n", "2")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*NOT EXERCISED *test_no_eos_passes*the check's own verdict stands: passed*"])
    assert records["no_eos_passes"]["pin"]["state"] == "not_exercised"


def test_a_precondition_the_check_never_recorded_excuses_nothing(pytester, tmp_path):
    path = expectations(tmp_path, "never_recorded")
    result, records = run(pytester, tmp_path, path, "test_never_recorded or test_healthy")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*now passes (the entry needs greedy_reaches_eos, which this check did not record): "
                                 "the expectation is stale*"])
    assert records["never_recorded"]["outcome"] == "xpassed"


# ------------------------------------------------------------------------------------------- the file
def test_an_unknown_precondition_is_refused_naming_the_file_and_field(tmp_path):
    path = expectations(tmp_path, "eos_shows", needs="greedy_reaches_the_moon")
    with pytest.raises(ExpectationsError, match=rf"expectations file {tmp_path}/expect.toml, expected_failure #1: "
                                                r"field 'needs' = 'greedy_reaches_the_moon' is not a known "
                                                r"precondition \(known: [a-z_, ]*greedy_reaches_eos"):
        load_expectations(path)
    (tmp_path / "expect.toml").write_text(ENTRY.format(check="c", needs="x").replace('needs = "x"', "needs = 3"))
    with pytest.raises(ExpectationsError, match="field 'needs' = 3 is not a known precondition"):
        load_expectations(tmp_path / "expect.toml")
    [entry] = load_expectations(expectations(tmp_path, "eos_shows"))
    assert entry.needs == "greedy_reaches_eos" and "needs greedy_reaches_eos" in entry.describe()


def test_the_shipped_ignore_eos_pins_need_greedy_output_to_reach_eos():
    """Every llama.cpp pin about ignore_eos's banned EOS (its match expects token 2) names the precondition, and no
    other pin does: the full-cache and text pins are about lost work, which any checkpoint shows."""
    pins = load_expectations(SHIPPED / "llamacpp.toml")
    eos_only = {e.check for e in pins if "ignore_eos_bans_eos" in e.reproduction}
    assert eos_only == {"unpressured_matches_ground_truth", "chunked_prefill_equivalence",
                        "over_long_prompt_is_refused_and_others_are_served",
                        "greedy_output_alone_equals_in_a_batch_of_16"}
    assert {e.check for e in pins if e.needs == "greedy_reaches_eos"} == eos_only


# ------------------------------------------------------------------------------------------- the evidence
def test_the_precondition_holds_once_any_part_saw_it_and_is_unknown_until_recorded():
    properties: list = []
    with collecting(properties):
        assert precondition_held(properties, "greedy_reaches_eos") is None
        assert record_precondition("greedy_reaches_eos", False) is False
        assert precondition_held(properties, "greedy_reaches_eos") is False
        assert record_precondition("greedy_reaches_eos", True) is True
        assert record_precondition("greedy_reaches_eos", False) is True  # a later part without it: still held
    assert precondition_held(properties, "greedy_reaches_eos") is True
    assert evidence_of(properties)["precondition.greedy_reaches_eos"] is True  # results.json's last value
    with pytest.raises(KeyError, match="unknown precondition 'no_such'"):
        record_precondition("no_such", True)


def _out(tokens):
    return SimpleNamespace(token_ids=list(tokens))


def test_a_comparison_records_whether_the_ground_truth_reached_eos(tmp_path):
    """From the checkpoint's EOS id (config.json; generation_config.json's too) and the ground truth's tokens: only
    greedy requests sent with ignore_eos count, and an unknown checkpoint records nothing."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert eos_token_ids(tmp_path) == {2, 9}
    greedy = SimpleNamespace(ignore_eos=True, temperature=0.0)
    stops = SimpleNamespace(ignore_eos=False, temperature=0.0)
    sampled = SimpleNamespace(ignore_eos=True, temperature=0.8)
    cases = [
        ([greedy, greedy], [_out([5, 6]), _out([7, 8])], False),
        ([greedy, greedy], [_out([5, 6]), _out([7, 2, 8])], True),
        ([greedy], [_out([9, 4])], True),  # generation_config's other EOS id
        ([stops, sampled], [_out([2]), _out([2])], None),  # neither counts: nothing recorded
    ]
    for requests, outputs, held in cases:
        properties: list = []
        with collecting(properties):
            note_greedy_reaches_eos(str(tmp_path), requests, outputs)
        assert precondition_held(properties, "greedy_reaches_eos") is held, (requests, outputs)
    properties = []
    with collecting(properties):
        note_greedy_reaches_eos(None, [greedy], [_out([2])])
        note_greedy_reaches_eos(str(tmp_path / "missing"), [greedy], [_out([2])])
    assert precondition_held(properties, "greedy_reaches_eos") is None


def test_compare_outputs_records_it_for_every_check_that_compares_with_the_ground_truth(tmp_path):
    from kvbench.conformance.prove import compare_outputs
    from kvbench.core.requests import GenOutput, GenRequest, GenResult

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    engine = SimpleNamespace(name="e", kind="fake", model_dir=str(tmp_path), compute_dtype=lambda: "float32")
    requests = [GenRequest("r0", [5, 6], 3)]
    for truth_tokens, held in (([4, 2, 4], True), ([4, 3, 4], False)):
        truth = GenResult([GenOutput("r0", truth_tokens, "length")])
        properties: list = []
        with collecting(properties):
            compare_outputs(engine, truth, truth, requests, margins_of=None, label="x")
        assert precondition_held(properties, "greedy_reaches_eos") is held


def test_the_shipped_vllm_abort_count_pins_need_an_abort_to_reach_a_running_request():
    """vLLM's aborts-counter finding shows only where an abort landed on a running request, which over HTTP the
    load decides (a run in which none did was reported stale though the finding held): both check-6 pins say so."""
    pins = [e for e in load_expectations(SHIPPED / "vllm.toml") if e.check.startswith("every_request_finishes")]
    assert len(pins) == 2 and {e.needs for e in pins} == {"aborts_reach_running_requests"}


model_dir = _shared.model_dir  # the shared checkpoint fixture, bound here so that pytest finds it


def test_check_6_records_whether_an_abort_reached_a_running_request(model_dir):
    """The in-process reference engine confirms its aborts: the precondition is recorded as held."""
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from suites.conformance import test_nothing_lost as check6

    properties: list = []
    with collecting(properties):
        check6.test_every_request_finishes_exactly_once(mode="recompute", engine=make_adapter(
            parse_engine_spec("reference"), model_dir), model_dir=model_dir)
    assert precondition_held(properties, "aborts_reach_running_requests") is True


def test_pool_ran_dry_is_read_from_preemptions_failures_at_a_full_pool_or_the_streams():
    """Held where the engine preempted, or its streams held more than the pool, or a request failed while the
    streams in flight held all but one token each of the pool; not held where none of these shows (llama.cpp's
    text-check pin is then not exercised, not stale). A failure at a pool far from full is no evidence: it is what
    the pin excuses, and would otherwise make the pin look exercised by the very failure it pins."""
    from kvbench.conformance.preconditions import note_pool_ran_dry

    def trace(counters, *requests):
        reqs = {f"r{i}": SimpleNamespace(finish_reason=why, prompt_len=prompt, token_times=times, finished=None)
                for i, (why, prompt, times) in enumerate(requests)}
        return SimpleNamespace(counters=counters, requests=reqs)

    calm = [("length", 10, [0.1, 0.2]), ("length", 10, [0.15, 0.25])]  # 12 + 12 tokens held at 0.2 at most
    # at 0.2 (r2's failure): r0 10+2, r1 10+1, r2 10+2 (35, no more than the peak), each one token further in the
    # engine: 38
    failing = [*calm, ("error", 10, [0.1, 0.2])]
    cases = [({}, calm, 100, False), ({"preemptions_recompute": 1}, calm, 100, True),
             ({}, failing, 100, False), ({}, failing, 38, False), ({}, failing, 37, True),
             ({}, calm, 20, True)]
    for counters, requests, pool, held in cases:
        properties: list = []
        with collecting(properties):
            assert note_pool_ran_dry(trace(counters, *requests), pool) is held, (counters, requests, pool)
        assert precondition_held(properties, "pool_ran_dry") is held
    assert {e.needs for e in load_expectations(SHIPPED / "llamacpp.toml")
            if e.check == "text_is_the_decoding_of_the_token_ids"} == {"pool_ran_dry"}


def test_pool_ran_dry_takes_the_engines_own_words_for_a_full_pool_and_no_others():
    """llama.cpp fails every request in flight with "Context size has been exceeded" when a decode finds no free
    cell, and for nothing else: such a failure is the engine's word that its pool ran dry, where the client saw too
    little (requests in their prefill, non-streamed responses) to prove it. Any other error, or an engine that has
    no such words, proves nothing."""
    from kvbench.conformance.preconditions import note_pool_ran_dry
    from kvbench.engines.base import EngineAdapter
    from kvbench.engines.http.presets import PRESETS

    llama = SimpleNamespace(pool_full_errors=PRESETS["llamacpp"].pool_full_errors)
    says = lambda message: EngineAdapter.says_pool_full(llama, message)  # noqa: E731 - the method, on the preset
    assert says("HTTP 500: Context size has been exceeded.") and says("Context size has been exceeded.")
    assert not says("HTTP 500: Compute error.") and not says(None) and not says("")
    assert not EngineAdapter.says_pool_full(SimpleNamespace(pool_full_errors=()), "Context size has been exceeded.")

    def trace(error):  # a request failed before its first token (nothing the client saw held KV), one served
        reqs = {"r0": SimpleNamespace(finish_reason="error", prompt_len=10, token_times=[], finished=0.3,
                                      error=error),
                "r1": SimpleNamespace(finish_reason="length", prompt_len=10, token_times=[0.1, 0.2], finished=0.2,
                                      error=None)}
        return SimpleNamespace(counters={}, requests=reqs)

    for error, judge, held in (("HTTP 500: Context size has been exceeded.", says, True),
                               ("HTTP 500: Compute error.", says, False),
                               ("HTTP 500: Context size has been exceeded.", None, False)):
        properties: list = []
        with collecting(properties):
            assert note_pool_ran_dry(trace(error), 512, judge) is held, (error, judge)
        assert precondition_held(properties, "pool_ran_dry") is held


requests_greedy, truth_engine, truth = _shared.requests_greedy, _shared.truth_engine, _shared.truth


def test_the_resume_hit_pin_needs_a_preemption_and_check_3b_records_one(model_dir, requests_greedy, truth_engine,
                                                                        truth):
    """vLLM's resume-hits finding shows only where a request was preempted and resumed; a vLLM run whose arrivals
    never ran the pool dry reported that pin stale though the finding held. The pin needs ``preempted``, and check
    3b records it: held on the reference engine, whose pressured run preempts every time."""
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from suites.conformance import test_equivalence as check3

    [pin] = [e for e in load_expectations(SHIPPED / "vllm.toml")
             if e.check == "recompute_after_preemption_reuses_cached_blocks"]
    assert pin.needs == "preempted"
    engine = make_adapter(parse_engine_spec("reference:enable_prefix_caching=true"), model_dir)
    properties: list = []
    with collecting(properties):
        check3.test_recompute_after_preemption_reuses_cached_blocks(engine, requests_greedy, truth, truth_engine,
                                                                    near_ties=[], tolerance=None)
    assert precondition_held(properties, "preempted") is True



def test_the_llamacpp_full_cache_pin_needs_the_pool_to_run_dry_and_the_check_records_it(model_dir, truth_engine):
    """llama.cpp's lost-work finding shows only where its cache filled, and 8 requests at once do not fill it in
    every run: one that served all 8 reported the pin stale though the finding held (a first run ordered by the
    shipped launch plan, 2026-12-07). The pin needs ``pool_ran_dry``; the check records it from a counted
    preemption or a failure in the engine's own words for a full pool: held on the reference engine, whose
    pressured run preempts."""
    from kvbench.engines.registry import make_adapter, parse_engine_spec
    from suites.conformance import test_kv_full

    [pin] = [e for e in load_expectations(SHIPPED / "llamacpp.toml")
             if e.check == "full_kv_cache_loses_and_truncates_nothing"]
    assert pin.needs == "pool_ran_dry"
    properties: list = []
    with collecting(properties):
        test_kv_full.test_full_kv_cache_loses_and_truncates_nothing(
            make_adapter(parse_engine_spec("reference"), model_dir), model_dir, truth_engine, near_ties=[],
            tolerance=None)
    assert precondition_held(properties, "pool_ran_dry") is True

def test_the_llamacpp_early_abort_pin_needs_the_closes_to_land_while_the_requests_wait():
    """llama.cpp's finding (a request closed while it waits for a slot still runs) shows only where the closes came
    while every slot was held; a run in which the slots freed first went undecided and reported the pin stale."""
    [pin] = [e for e in load_expectations(SHIPPED / "llamacpp.toml")
             if e.check == "an_abort_before_the_first_token_stops_the_request"]
    assert pin.needs == "closed_while_waiting"
