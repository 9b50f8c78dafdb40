"""Check 8: bad input gets a clear error or a documented fallback, and the engine keeps serving
everyone else: an over-long prompt, a pool too small for one request, an exhausted swap space,
an invalid configuration."""

from __future__ import annotations

import pytest

from kvbench.conformance import BLOCK_SIZE, PRESSURED_BLOCKS, ROOMY_BLOCKS, model_vocab, prove
from kvbench.engines.base import GenRequest, Knobs
from kvbench.plugin import require

pytestmark = pytest.mark.conformance


def _served_the_others(result, truth, bad_id: str) -> None:
    for got, want in zip(result.outputs, truth.outputs, strict=True):
        if got.request_id == bad_id:
            continue
        assert got.finish_reason in ("length", "stop"), f"{got.request_id} was not served: {got.finish_reason}"
        assert got.token_ids == want.token_ids, f"{got.request_id} got other tokens beside a bad request"


def _assert_clear_rejection(result, bad_id: str, *words: str) -> None:
    bad = next(o for o in result.outputs if o.request_id == bad_id)
    assert bad.finish_reason in ("rejected", "error"), f"the bad request was not refused: {bad.finish_reason}"
    assert bad.error, "refused without saying why"
    for word in words:
        assert word in bad.error, f"the error does not mention {word!r}: {bad.error}"


def test_over_long_prompt_is_refused_and_others_are_served(engine, model_dir, requests_greedy, truth):
    _, max_len = model_vocab(model_dir)
    bad = GenRequest("too-long", [5] * (max_len + 10), 4)
    requests = [*requests_greedy[:6], bad, *requests_greedy[6:12]]
    result = engine.generate(requests, Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=ROOMY_BLOCKS))
    _assert_clear_rejection(result, "too-long", "max_model_len")
    truth_outputs = [*truth.outputs[:6], None, *truth.outputs[6:12]]
    truth_by_id = type(truth)([o for o in truth_outputs if o is not None])
    _served_the_others(type(result)([o for o in result.outputs if o.request_id != "too-long"]), truth_by_id,
                       "too-long")


def test_request_larger_than_the_pool_is_refused_and_others_are_served(engine, requests_greedy, truth):
    small = [r for r, t in zip(requests_greedy, truth.outputs, strict=True)
             if len(r.prompt_token_ids) + r.max_tokens <= 4 * BLOCK_SIZE][:6]
    assert small, "the request set has no small requests"
    bad = GenRequest("too-big", [7] * (8 * BLOCK_SIZE), 8)  # needs 9 blocks, the pool has 6
    result = engine.generate([*small, bad], Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=6))
    _assert_clear_rejection(result, "too-big", "blocks")
    wanted = {r.request_id for r in small}
    truth_small = type(truth)([o for o in truth.outputs if o.request_id in wanted])
    _served_the_others(type(result)([o for o in result.outputs if o.request_id in wanted]), truth_small, "too-big")


def test_exhausted_swap_space_falls_back_to_recompute(engine, requests_greedy, truth):
    """Documented fallback: a victim the host pool cannot take is recomputed instead; all complete."""
    require(engine, "swap")
    knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=PRESSURED_BLOCKS, num_cpu_blocks=4, preemption_mode="swap")
    result = engine.generate(requests_greedy, knobs)
    prove(result, engine, "swap_fallbacks", "a fallback from swap to recompute")
    assert all(o.finish_reason in ("length", "stop") for o in result.outputs)
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in truth.outputs]


@pytest.mark.parametrize(("knob", "value"), [("block_size", 3), ("num_gpu_blocks", -1), ("max_num_seqs", 0),
                                             ("preemption_mode", "teleport")])
def test_invalid_configuration_names_the_field(knob, value, engine, requests_greedy):
    knobs = Knobs(block_size=BLOCK_SIZE, num_gpu_blocks=ROOMY_BLOCKS).merged(Knobs(**{knob: value}))
    with pytest.raises(Exception) as info:  # any exception type, but it must name the field
        engine.generate(requests_greedy[:2], knobs)
    words = {"num_gpu_blocks": ("num_gpu_blocks", "num_blocks"), "block_size": ("block_size", "page_size"),
             "max_num_seqs": ("max_num_seqs", "max_requests"), "preemption_mode": ("preemption_mode",)}[knob]
    assert any(w in str(info.value) for w in words), f"the error does not name {knob}: {info.value!r}"
