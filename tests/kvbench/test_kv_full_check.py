"""The full-cache and batch checks (``suites/conformance/test_kv_full.py``) fail on engines broken in exactly their
ways: one that fails requests in flight when its cache is full (as llama.cpp's server does), one that cuts a
request short and calls it finished, one that refuses without saying why, one that loses a request, one that
never fills its cache, and one whose batched output differs from its output alone.

Each broken engine is the reference engine with its answers changed as such an engine would give them, run
through the suite's own check functions.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from _pytest.outcomes import Failed, Skipped

from kvbench.conformance.prove import near_tie_tolerance
from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.engines.base import GenResult
from kvbench.engines.registry import make_adapter, parse_engine_spec
from suites.conformance import test_kv_full
from tests.kvbench import fault_test_fixtures as _shared

# the shared fixtures (tests/kvbench/fault_test_fixtures.py), bound here so that pytest finds them for this module
model_dir = _shared.model_dir
one_torch_thread = _shared.one_torch_thread
requests_greedy = _shared.requests_greedy
truth = _shared.truth
truth_engine = _shared.truth_engine


@pytest.fixture(scope="module")
def reference(model_dir):
    adapter = make_adapter(parse_engine_spec("reference"), model_dir)
    yield adapter
    adapter.close()


class Broken:
    """The reference engine, its answers changed by ``change(requests, knobs, result) -> result``."""

    def __init__(self, engine: Any, change: Any):
        self._engine, self._change = engine, change

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, requests, knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        return self._change(requests, knobs, self._engine.generate(requests, knobs))


def _outputs(result: GenResult, change) -> GenResult:
    return replace(result, outputs=[change(i, o) for i, o in enumerate(result.outputs)])


def fails_in_flight(requests, knobs, result):
    """llama.cpp's way: when the cache is full every request in flight fails with one error."""
    return _outputs(result, lambda i, o: replace(o, token_ids=o.token_ids[:2], finish_reason="error",
                                                 error="Context size has been exceeded.") if i % 3 == 0 else o)


def truncates(requests, knobs, result):
    return _outputs(result, lambda i, o: replace(o, token_ids=o.token_ids[: len(o.token_ids) // 2],
                                                 finish_reason="length") if i == 4 else o)


def vague(requests, knobs, result):
    return _outputs(result, lambda i, o: replace(o, token_ids=[], finish_reason="rejected", error="")
                    if i == 2 else o)


def loses(requests, knobs, result):
    return _outputs(result, lambda i, o: replace(o, finish_reason=None) if i == 7 else o)


def never_full(requests, knobs, result):
    """Served whole, but nothing was ever preempted or refused (as if the pool were roomy)."""
    counters = replace(result.counters, preemptions_recompute=0, preemptions_swap=0)
    return replace(result, counters=counters)


def batch_differs(requests, knobs, result):
    """Alone (max_num_seqs=1) the last token of every request changes: a batch-dependent engine."""
    if knobs.max_num_seqs != 1:
        return result
    return _outputs(result, lambda i, o: replace(o, token_ids=[*o.token_ids[:-1], (o.token_ids[-1] + 1) % 500])
                    if o.token_ids else o)


def _run(check, engine, **kwargs) -> str:
    kwargs.setdefault("tolerance", near_tie_tolerance(engine))
    try:
        check(engine=engine, near_ties=[], **kwargs)
    except (AssertionError, Failed) as e:
        return str(e)
    except Skipped as e:
        pytest.fail(f"the check skipped instead of failing on the broken engine: {e}")
    pytest.fail("the check passed on an engine broken in exactly the way it is about")


@pytest.mark.parametrize(("change", "match"), [
    (fails_in_flight, r"refused on .* though the pool \(\d+ tokens\) holds each of them alone.*Context size"),
    (truncates, r"silently truncated on .*full4 finished 'length' after"),
    (vague, r"refused on .* without saying why: \['full2'\]"),
    (loses, r"requests lost on .*full7"),
    (never_full, r"its cache never filled"),
])
def test_full_cache_check_fails(change, match, reference, model_dir, truth_engine):
    message = _run(test_kv_full.test_full_kv_cache_loses_and_truncates_nothing, Broken(reference, change),
                   model_dir=model_dir, truth_engine=truth_engine)
    assert re.search(match, message, re.S), message[:800]


def runs_out_quietly(requests, knobs, result):
    """llama.cpp's way with a request its context cannot finish: generate until the context is full, then report it
    finished at its length (the ground truth's first tokens, fewer than asked for)."""
    request = requests[0]
    pool = (knobs.block_size or 1) * (knobs.num_gpu_blocks or 0)
    room = max(pool - len(request.prompt_token_ids), 0)
    return _outputs(result, lambda i, o: replace(o, token_ids=list(range(3, 3 + room)), finish_reason="length",
                                                 error=None))


def test_overflow_check_fails_when_the_request_is_cut_short(reference, model_dir, truth_engine):
    message = _run(test_kv_full.test_request_the_pool_cannot_finish_is_refused_or_served_whole,
                   Broken(reference, runs_out_quietly), model_dir=model_dir, truth_engine=truth_engine)
    max_tokens = test_kv_full.OVERFLOW_POOL // 2  # the reference engine takes the pool as asked
    assert re.search(rf"silently truncated on .* finished 'length' after \d+ of {max_tokens} tokens", message), \
        message[:800]


def test_batch_check_fails_when_output_depends_on_the_batch(reference, requests_greedy, truth, truth_engine):
    message = _run(test_kv_full.test_greedy_output_alone_equals_in_a_batch_of_16, Broken(reference, batch_differs),
                   requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine)
    assert re.search(r"alone: \d+ of 16 requests differ from the ground truth", message), message[:800]


def test_both_checks_pass_on_the_reference_engine(reference, requests_greedy, truth, truth_engine):
    """The control: the unbroken engine passes both, so the failures above are the faults'."""
    tolerance = near_tie_tolerance(reference)
    test_kv_full.test_full_kv_cache_loses_and_truncates_nothing(
        engine=reference, model_dir=reference.model_dir, truth_engine=truth_engine, near_ties=[], tolerance=tolerance)
    test_kv_full.test_greedy_output_alone_equals_in_a_batch_of_16(
        engine=reference, requests_greedy=requests_greedy, truth=truth, truth_engine=truth_engine, near_ties=[],
        tolerance=tolerance)
    test_kv_full.test_request_the_pool_cannot_finish_is_refused_or_served_whole(
        engine=reference, model_dir=reference.model_dir, truth_engine=truth_engine, near_ties=[], tolerance=tolerance)
