"""A full KV cache loses nothing and truncates nothing; and greedy output does not depend on the batch.

Full cache: 8 requests, each needing most of what the largest needs, are sent at once to an engine given room
for all 8 at a time and a pool that holds the largest twice: their prompts alone overrun it. What the engine
then does is its design (preempt and resume, defer admission, shift a context, refuse or fail requests);
what every engine owes its clients is the same: every request ends exactly once, either served with all its
tokens (the ground truth's) or refused with an error that says so. A request cut short and reported finished
(``length`` before its ``max_tokens``) is a silent truncation. And a pool that holds every request alone can
serve every request: a request failed only because others held the cache is lost work the client must find
out and resend.

A request the pool cannot finish (its prompt fits, its prompt and max_tokens do not) is refused saying so, or
served whole; cutting it off when the pool runs out and calling it finished (``length``) is a silent truncation.

Batch of 16: the same 16 requests run one at a time (each sent alone, ``max_num_seqs=1``) and all together
(16), both in a pool that holds them all, give each request the ground truth's tokens (near-ties aside, on
engines not held to exact equality); an engine held to exact equality gives the same tokens both ways.
"""

from __future__ import annotations

import random

import pytest

from kvbench.conformance.preconditions import record_precondition
from kvbench.conformance.prove import (
    assert_conforms,
    compare_outputs,
    exact_only,
    kv_needs,
    model_vocab,
    pressured_knobs,
    require_knobs,
    roomy_knobs,
    timed_trigger_missed,
)
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
from kvbench.core.kv_budget import KVBudget
from kvbench.engines.base import GenRequest, GenResult

pytestmark = pytest.mark.conformance

#: requests an engine may run at once in both checks: enough that their needs overrun the pressured pool
BATCH = 16
SERVED = ("length", "stop")
REFUSED = ("rejected", "error")


def _subset(result: GenResult, ids: set[str]) -> GenResult:
    return type(result)([o for o in result.outputs if o.request_id in ids])


def _same_as_truth(engine, result, truth, requests, truth_engine, near_ties, label: str, tolerance) -> None:
    """A claim that ``result`` has the ground truth's tokens (near-ties recorded, not failures), so a pinned
    mismatch leaves the check's other claims to run."""
    comparison = compare_outputs(engine, result, truth, requests, truth_engine.top2_margins, f"{engine.name} {label}",
                                 tolerance, gap_of=truth_engine.logit_gap)
    if comparison.unknown_dtype_of is not None:
        assert_conforms(comparison, near_ties)  # undecided on a mismatch: no dtype to judge it by
        return
    near_ties.extend(f"{comparison.label}: {rid}: {v.explain()}" for rid, v in comparison.near_ties)
    bad = comparison.mismatches
    lines = "".join(f"\n  {rid}: {v.explain()}" for rid, v in bad[:10])
    claim(not bad, f"{comparison.label}: {len(bad)} of {len(comparison.verdicts)} requests differ from the ground "
                   f"truth:{lines}")


#: the full-cache workload: requests that each need most of what the largest needs, all admitted at once, whose
#: prompts alone overrun the pool (twice the largest request): a cache that fills while no request is near its end
FULL_REQUESTS, FULL_PROMPT, FULL_OUTPUT = 8, 80, 64


def full_cache_requests(model_dir: str) -> list[GenRequest]:
    vocab, _ = model_vocab(model_dir)
    rng = random.Random(44)
    return [GenRequest(f"full{i}", [rng.randrange(3, vocab) for _ in range(FULL_PROMPT - 4 * i)], FULL_OUTPUT)
            for i in range(FULL_REQUESTS)]


def test_full_kv_cache_loses_and_truncates_nothing(engine, model_dir, truth_engine, near_ties, tolerance):
    """Every request ends once: served whole and right, or refused saying why; none that the pool holds alone
    is refused. Proven: the cache was full (the engine preempted, or refused or failed requests)."""
    require_knobs(engine, "max_num_seqs")
    requests = full_cache_requests(model_dir)
    truth = truth_engine.generate(requests)
    knobs = pressured_knobs(engine, requests, max_num_seqs=FULL_REQUESTS)
    pool = (knobs.block_size or 1) * (knobs.num_gpu_blocks or 0)
    result = engine.generate(requests, knobs)
    outcome = {o.request_id: o for o in result.outputs}
    preempted = sum(result.counters.get(k) or 0 for k in ("preemptions_recompute", "preemptions_swap"))
    # what a pin on losing work when the pool runs dry needs to be put to the test: a preemption counted, or a
    # request failed in the engine's own words for a full pool (8 requests at once do not fill it in every run)
    record_precondition("pool_ran_dry", preempted > 0 or any(engine.says_pool_full(o.error) for o in result.outputs))

    lost = {rid: o.finish_reason for rid, o in outcome.items() if o.finish_reason not in (*SERVED, *REFUSED)}
    claim(set(outcome) == {r.request_id for r in requests} and not lost,
          f"requests lost on {engine.name} (no served or refused ending): {lost}")
    served = [r for r in requests if outcome[r.request_id].finish_reason in SERVED]
    refused = [r for r in requests if outcome[r.request_id].finish_reason in REFUSED]
    record_evidence("served", len(served))
    record_evidence("refused", len(refused))

    # served: all the tokens, the right ones; one cut short and called finished is a silent truncation
    want = {o.request_id: o for o in truth.outputs}
    short = [f"{r.request_id} finished {outcome[r.request_id].finish_reason!r} after "
             f"{len(outcome[r.request_id].token_ids)} of {len(want[r.request_id].token_ids)} tokens"
             for r in served if len(outcome[r.request_id].token_ids) < len(want[r.request_id].token_ids)]
    claim(not short, f"silently truncated on {engine.name} (reported finished, tokens missing): {short[:5]}")
    ids = {r.request_id for r in served}
    _same_as_truth(engine, _subset(result, ids), _subset(truth, ids), served, truth_engine, near_ties,
                   "full cache, served", tolerance)

    # refused: saying why; and none the pool could hold alone
    vague = [r.request_id for r in refused if not (outcome[r.request_id].error or "").strip()]
    claim(not vague, f"refused on {engine.name} without saying why: {vague}")
    needs = dict(zip((r.request_id for r in requests), kv_needs(requests), strict=True))
    fitting = [r for r in refused if needs[r.request_id] <= pool]
    said = sorted({(outcome[r.request_id].error or "")[:160] for r in fitting})
    claim(not fitting, f"{len(fitting)} of {len(requests)} requests were refused on {engine.name} though the "
                       f"pool ({pool} tokens) holds each of them alone ({', '.join(r.request_id for r in fitting[:8])}"
                       f"): {said[:3]}")

    # proof that the cache filled: the engine made room (preempted) or turned requests away
    record_evidence("preemptions", preempted)
    if preempted or refused:
        record_proof("kv_cache_full", preempted + len(refused))
    elif engine.kv_layout.slots == "per_slot":
        undecided(f"{engine.name} splits its pool among its slots, and each slot's share holds the largest request: "
                  "its cache cannot fill, requests wait for a free slot instead (served whole, as checked)")
    elif not {"recompute", "swap"} & set(engine.capabilities) or (
            "preemptions_recompute" not in result.counters and "preemptions_swap" not in result.counters):
        undecided(f"{engine.name} served every request, and nothing it exposes says its cache filled (it has no "
                  f"preemption to count, or counts none): pool {pool} tokens, {FULL_REQUESTS} requests at once")
    else:
        timed_trigger_missed(engine, f"{engine.name} served every request without preempting or refusing any: its "
                                     f"cache (pool {pool} tokens) never filled")
        claim(False, f"{engine.name} served every request without preempting or refusing any: its cache never "
                     f"filled (pool {pool} tokens; knobs {knobs}), so the check proved nothing")


#: the overflowing request's pool, in tokens (the engine may round it up: its own terms decide the request). 224:
#: where a pool must hold max_model_len and a block is held back (vLLM's CPU build: 32-token blocks), this is the
#: 8-block pool the stop and full-cache checks share, so the check needs no launch of its own
OVERFLOW_POOL = 224


def request_pool(engine, knobs) -> int:
    """The tokens one request can hold under ``knobs``: the pool, or where the engine splits its pool among its slots
    (``KVLayout.slots == "per_slot"``, as llama.cpp's ``--no-kv-unified``) one slot's share of it. A request sized
    against the whole split pool fits no slot-shaped question: per slot it would be one slot's worth of pressure
    asked for with four slots' tokens (1024 cells, more than tiny's 1024 positions can take with max_tokens)."""
    pool = (knobs.block_size or 1) * (knobs.num_gpu_blocks or 0)
    if engine.kv_layout.slots == "per_slot":
        return pool // (knobs.max_num_seqs or engine.kv_layout.default_slots)
    return pool


def test_request_the_pool_cannot_finish_is_refused_or_served_whole(engine, model_dir, truth_engine, near_ties,
                                                                   tolerance):
    """One request whose prompt is three quarters of the pool and whose max_tokens is half of it: refused with an
    error, or served with all its tokens (the ground truth's); never cut short and reported finished."""
    require_knobs(engine, "num_gpu_blocks", "block_size")
    knobs = engine.pool_knobs(KVBudget(tokens=OVERFLOW_POOL, largest=OVERFLOW_POOL))
    pool = request_pool(engine, knobs)
    vocab, max_len = model_vocab(model_dir)
    prompt_len, max_tokens = 3 * pool // 4, pool // 2
    if prompt_len + max_tokens > max_len:
        pytest.skip(f"the model's {max_len} positions cannot hold a request of {prompt_len + max_tokens} tokens: "
                    f"{engine.name}'s smallest pool ({pool} tokens) is too large for it")
    rng = random.Random(33)
    request = GenRequest("overflows", [rng.randrange(3, vocab) for _ in range(prompt_len)], max_tokens)
    got = engine.generate([request], knobs).outputs[0]
    record_evidence("finish_reason", got.finish_reason)
    record_evidence("tokens", len(got.token_ids))
    if got.finish_reason in REFUSED:
        claim((got.error or "").strip(), f"{engine.name} refused a request the pool cannot finish without saying why")
        record_proof("refused", 1)
        return
    claim(got.finish_reason in SERVED, f"{engine.name} ended the request with {got.finish_reason!r}")
    claim(len(got.token_ids) >= max_tokens,
          f"silently truncated on {engine.name}: a request of {prompt_len} prompt tokens and max_tokens {max_tokens} "
          f"in a pool of {pool} tokens finished {got.finish_reason!r} after {len(got.token_ids)} of {max_tokens} "
          "tokens, with no error")
    if len(got.token_ids) < max_tokens:  # the pool ran out (said above, once): there is no whole output to compare
        record_proof("ran_out", len(got.token_ids))
        return
    want = truth_engine.generate([request])
    _same_as_truth(engine, type(want)([got]), want, [request], truth_engine, near_ties, "overflowing request",
                   tolerance)
    undecided(f"{engine.name} served the request whole: its pool ({pool} tokens asked) held more than the "
              f"{prompt_len + max_tokens} tokens the request needs, so the check could not overflow it")


def test_greedy_output_alone_equals_in_a_batch_of_16(engine, requests_greedy, truth, truth_engine, near_ties,
                                                     tolerance):
    """16 requests one at a time and all together: the ground truth's tokens both ways; the same tokens both
    ways on an engine held to exact equality."""
    require_knobs(engine, "max_num_seqs")
    requests = requests_greedy[:BATCH]
    want = _subset(truth, {r.request_id for r in requests})
    batched = engine.generate(requests, roomy_knobs(engine, requests, max_num_seqs=BATCH))
    # alone: each request by itself, one after another from the client, with the one-at-a-time cap besides: the
    # engine never holds two, whether or not it honours the cap, and an engine that starts a server per knob set
    # serves them from the batch's server (:meth:`ServerAdapter._cap_not_reached`) instead of a launch of its own
    one_at_a_time = roomy_knobs(engine, requests, max_num_seqs=1)
    alone = type(want)([engine.generate([r], one_at_a_time).outputs[0] for r in requests])
    for label, result in (("alone", alone), (f"in a batch of {BATCH}", batched)):
        _same_as_truth(engine, result, want, requests, truth_engine, near_ties, label, tolerance)
    differ = [a.request_id for a, b in zip(alone.outputs, batched.outputs, strict=True) if a.token_ids != b.token_ids]
    record_evidence("alone_vs_batch_differences", len(differ))
    if exact_only(engine):
        claim(not differ, f"{engine.name} gave other tokens in a batch of {BATCH} than alone: {differ}")
