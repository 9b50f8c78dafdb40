"""Check 13 (suites/conformance/test_block_accounting.py) fails on engines broken in exactly its ways, and
its observer (kvbench.conformance.block_accounting) sees what it claims to see."""

from __future__ import annotations

from types import SimpleNamespace

from kvbench.conformance.block_accounting import StepObserver, blocks_needed, can_observe, observe
from kvbench.conformance.prove import pressured_knobs
from kvbench.engines.registry import make_adapter, parse_engine_spec
from suites.conformance import test_bad_input, test_block_accounting
from tests.kvbench import fault_test_fixtures as _shared
from tests.kvbench.test_checks_can_fail import assert_fails, faulty

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
model_dir = _shared.model_dir
one_torch_thread = _shared.one_torch_thread
requests_greedy = _shared.requests_greedy
truth = _shared.truth
truth_engine = _shared.truth_engine


def _check_args(engine, requests_greedy, truth, truth_engine) -> dict:
    return dict(engine=engine, requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[])


def test_blocks_needed_is_a_ceiling_division():
    assert [blocks_needed(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_the_observer_sees_every_step_and_readmitted_requests_on_the_reference_engine(model_dir, requests_greedy):
    """On the unbroken engine under recompute pressure: every step observed, nothing wrong, and readmitted
    requests among the holdings checked (what makes 13a's proof)."""
    engine = make_adapter(parse_engine_spec("reference"), model_dir)
    assert can_observe(engine) == ""
    run = observe(engine, requests_greedy, pressured_knobs(engine, requests_greedy, preemption_mode="recompute"))
    observer = run.observer
    assert observer.steps > 0 and observer.holdings_checked >= observer.steps
    assert run.result.counters["preemptions_recompute"] > 0 and observer.readmitted_checked > 0
    assert not observer.wrong_holdings and not observer.wrong_counts
    assert observer.events_seen["preemptions_recompute"] == run.result.counters["preemptions_recompute"]
    assert "build_engine" not in vars(engine), "observe left its builder on the adapter"


def test_an_adapter_without_an_engine_in_process_cannot_be_observed():
    adapter = SimpleNamespace(name="remote")
    assert "no build_engine" in can_observe(adapter)


def test_a_step_that_moves_a_counter_its_events_do_not_explain_is_named():
    """The counting rule on a hand-made engine: one recompute preemption that wanted a swap counted in
    preemptions_recompute but not in swap_fallbacks."""
    counts = {"preemptions_recompute": 0, "preemptions_swap": 0, "swap_fallbacks": 0}
    sinks = []

    def step():
        for sink in sinks:
            sink(SimpleNamespace(kind="preempted", request_id="r1", data={"mode": "recompute", "wanted": "swap"}))
        counts["preemptions_recompute"] += 1

    engine = SimpleNamespace(block_manager=SimpleNamespace(block_size=4, block_tables={}),
                             scheduler=SimpleNamespace(running=[]), add_event_sink=sinks.append, step=step,
                             counters=lambda: SimpleNamespace(**counts))
    observer = StepObserver()
    observer.attach(engine)
    engine.step()
    [wrong] = observer.wrong_counts
    assert "swap_fallbacks moved +0 where the step's events say +1" in wrong.explain()
    assert "preemptions_recompute" not in wrong.explain()


def test_block_accounting_fails_when_a_readmitted_request_holds_an_extra_block(model_dir, requests_greedy, truth,
                                                                                truth_engine):
    assert_fails(test_block_accounting.test_running_requests_hold_the_blocks_their_tokens_need,
                 r"recompute: \d+ times a running request .* held other than the blocks its tokens need:\n"
                 r".*\(readmitted after a recompute preemption\) holds (\d+) blocks .* more than its tokens need",
                 **_check_args(faulty("readmitted_holds_extra_blocks", model_dir), requests_greedy, truth,
                               truth_engine))


def test_block_accounting_fails_when_auto_leaves_its_fallbacks_uncounted(model_dir, requests_greedy, truth,
                                                                         truth_engine):
    """``uncounted_auto_fallbacks`` leaves both swap_fallbacks and preemptions_recompute still on each of auto's
    fallbacks. (``uncounted_swap_fallbacks`` already covers auto's fallbacks in swap_fallbacks alone: it patches
    the preemption of every mode, and check 8c' is shown failing on it with ``auto`` too; this fault is auto's
    only, which fixed ``swap`` mode never sees.)"""
    message = assert_fails(test_block_accounting.test_auto_counts_every_fallback_the_step_it_happens,
                           r"auto, host pool full: \d+ steps .* counted their preemptions otherwise than their "
                           r"events say:\n  step \d+: preemptions_recompute moved \+0 where the step's events say "
                           r"\+1, swap_fallbacks moved \+0",
                           **_check_args(faulty("uncounted_auto_fallbacks", model_dir), requests_greedy, truth,
                                         truth_engine))
    assert "preemptions_swap" not in message


def test_the_fallback_count_check_fails_too_when_auto_leaves_its_fallbacks_uncounted(model_dir, requests_greedy):
    """Check 8c' with ``auto`` counts the run's fallbacks in one sum; it fails on this fault as well."""
    assert_fails(test_bad_input.test_every_swap_wanted_but_not_made_is_a_counted_fallback,
                 r"auto: swap_fallbacks=0 but \d+ preemptions wanted a swap|a swap fallback did not happen",
                 mode="auto", engine=faulty("uncounted_auto_fallbacks", model_dir), requests_greedy=requests_greedy)
