"""Check 8: bad input gets a clear error or a documented fallback, and the engine keeps serving
everyone else: an over-long prompt, a pool too small for one request (on an engine whose pool must hold
max_model_len: a request needing the whole pool), an exhausted swap space, an invalid configuration."""

from __future__ import annotations

import math
import random

import pytest

from kvbench.conformance.prove import (
    compare_outputs,
    kv_needs,
    model_vocab,
    pressured_knobs,
    prove,
    require_events,
    require_knobs,
    roomy_knobs,
)
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.core.evidence import record_evidence
from kvbench.core.kv_budget import KVBudget
from kvbench.engines.base import AdapterRefusal, GenRequest, Knobs
from kvbench.plugin import require

pytestmark = pytest.mark.conformance


def _served_the_others(engine, result, truth, bad_id: str, requests, truth_engine, near_ties,
                       tolerance) -> list[str]:
    """Problems with the requests beside the bad one: not served, or tokens that differ from the ground truth
    other than at a near-tie (recorded in ``near_ties``)."""
    problems = []
    served = []
    for req, got, want in zip(requests, result.outputs, truth.outputs, strict=True):
        if got.request_id == bad_id:
            continue
        if got.finish_reason not in ("length", "stop"):
            problems.append(f"{got.request_id} was not served: {got.finish_reason} ({got.error})")
        else:
            served.append((req, got, want))
    got, want = type(result)([g for _, g, _ in served]), type(truth)([w for _, _, w in served])
    comparison = compare_outputs(engine, got, want, [r for r, _, _ in served], truth_engine.top2_margins,
                                 f"{engine.name} beside {bad_id}", tolerance,
                                 gap_of=truth_engine.logit_gap)
    near_ties.extend(f"{comparison.label}: {rid}: {v.explain()}" for rid, v in comparison.near_ties)
    problems += [f"{rid} got other tokens beside a bad request: {v.explain()}" for rid, v in comparison.mismatches]
    return problems


#: how engines name a limit in their errors: kvbench's field name, or the engine's own words for it
#: (vLLM: "This model's maximum context length is 192 tokens", "longer than the maximum model length"; llama.cpp:
#: "request (1034 tokens) exceeds the available context size (1024 tokens)")
SYNONYMS = {"max_model_len": ("max_model_len", "maximum context length", "maximum model length", "context size")}


def _clear_rejection(result, bad_id: str, *words: str) -> list[str]:
    bad = next(o for o in result.outputs if o.request_id == bad_id)
    if bad.finish_reason not in ("rejected", "error"):
        return [f"the bad request was not refused: it finished with {bad.finish_reason!r}"]
    if not bad.error:
        return ["the bad request was refused without saying why"]
    return [f"the error does not mention {word!r}: {bad.error!r}" for word in words
            if not any(name in bad.error for name in SYNONYMS.get(word, (word,)))]


def _report(problems: list[str]) -> None:
    """Fail once with every problem, so a report shows both the refusal and the bystanders' fate."""
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.conformance(pressured=False)
def test_over_long_prompt_is_refused_and_others_are_served(engine, model_dir, requests_greedy, truth, truth_engine,
                                                           near_ties, tolerance):
    """A prompt past the model's positions is refused naming max_model_len; the others are served. An engine
    with no length limit at all (``EngineAdapter.no_length_limit``) lacks the prerequisite: a skip, not a pass."""
    lacking = getattr(engine, "no_length_limit", None)
    if lacking:
        pytest.skip(f"{engine.name} has no per-request length limit to enforce: {lacking}")
    _, max_len = model_vocab(model_dir)
    bad = GenRequest("too-long", [5] * (max_len + 10), 4)
    requests = [*requests_greedy[:6], bad, *requests_greedy[6:12]]
    # the pool is sized for the requests served (not the whole set): where every launch is a fresh start (vLLM),
    # the run then rides on a pool other checks share instead of a launch of its own
    result = engine.generate(requests, roomy_knobs(engine, requests_greedy[:12], sent=requests))
    problems = _clear_rejection(result, "too-long", "max_model_len")
    truth_outputs = [*truth.outputs[:6], None, *truth.outputs[6:12]]
    truth_by_id = type(truth)([o for o in truth_outputs if o is not None])
    others = [r for r in requests if r.request_id != "too-long"]
    problems += _served_the_others(engine, type(result)([o for o in result.outputs if o.request_id != "too-long"]),
                                   truth_by_id, "too-long", others, truth_engine, near_ties, tolerance)
    _report(problems)


#: the pool of the too-big check, in tokens: small requests (at most SMALL tokens) fit, the bad one
#: (TOO_BIG tokens) cannot, whatever the block size up to 32
POOL_TOKENS, SMALL, TOO_BIG = 96, 64, 136


@pytest.mark.conformance(pressured=False)
def test_request_larger_than_the_pool_is_refused_and_others_are_served(engine, requests_greedy, truth, truth_engine,
                                                                        near_ties, tolerance):
    """A request that can never fit the pool is refused naming it, and the others are served. An engine that
    refuses to start with a pool smaller than max_model_len admits no such request (a longer one is refused as
    over-long, which that check covers): on it the check takes the largest request it allows, one needing the
    whole pool, while others hold part of it (:func:`whole_pool_request_is_served_or_refused`)."""
    require_knobs(engine, "num_gpu_blocks", "block_size")
    if engine.kv_layout.pool_holds_max_model_len:
        whole_pool_request_is_served_or_refused(engine, requests_greedy, truth, truth_engine, near_ties, tolerance)
        return
    small = [r for r, t in zip(requests_greedy, truth.outputs, strict=True)
             if len(r.prompt_token_ids) + r.max_tokens <= SMALL][:6]
    assert small, "the request set has no small requests"
    bad = GenRequest("too-big", [7] * (TOO_BIG - 8), 8)
    knobs = engine.pool_knobs(KVBudget(tokens=POOL_TOKENS, largest=max(kv_needs(small))))
    if engine.kv_layout.pool_multiple > 1 and knobs.block_size * knobs.num_gpu_blocks >= TOO_BIG:
        # an engine that rounds its pool up (llama.cpp: to 256 tokens) has no pool this small; the request it cannot
        # finish is test_kv_full's overflow check, sized to its smallest pool
        pytest.skip(f"{engine.name}'s smallest pool ({knobs.block_size * knobs.num_gpu_blocks} tokens) holds the "
                    f"{TOO_BIG}-token request: no request of this check can be too big for it")
    assert knobs.block_size * knobs.num_gpu_blocks < TOO_BIG, f"{knobs} would hold the too-big request"
    result = engine.generate([*small, bad], knobs)
    problems = _clear_rejection(result, "too-big", "blocks")
    wanted = {r.request_id for r in small}
    truth_small = type(truth)([o for o in truth.outputs if o.request_id in wanted])
    problems += _served_the_others(engine, type(result)([o for o in result.outputs if o.request_id in wanted]),
                                   truth_small, "too-big", small, truth_engine, near_ties, tolerance)
    _report(problems)


#: the whole-pool request: max_model_len of WHOLE_POOL_BLOCKS blocks, a pool of one block more (an engine may hold
#: one back: vLLM keeps a null block out of every request's reach and refuses to start when max_model_len exceeds
#: the pool less that block), and a request of exactly max_model_len (its output WHOLE_POOL_OUTPUT_BLOCKS blocks),
#: sent with up to WHOLE_POOL_OTHERS requests of 2 to SMALL_BLOCKS blocks: none of them fits beside it. 7 blocks:
#: on vLLM's CPU build the pool of 8 that the stop and full-cache checks share, so no launch of its own
WHOLE_POOL_BLOCKS, WHOLE_POOL_OUTPUT_BLOCKS, WHOLE_POOL_OTHERS, SMALL_BLOCKS = 7, 2, 6, 4
#: what a clear refusal of it names: the limit it hit, in kvbench's or an engine's words
WHOLE_POOL_WORDS = ("max_model_len", "maximum context length", "maximum model length", "blocks", "KV cache")


def whole_pool_request_is_served_or_refused(engine, requests_greedy, truth, truth_engine, near_ties, tolerance):
    """The largest request an engine allows, when its pool must hold max_model_len: a request exactly as long as
    max_model_len, in a pool that holds it with at most one block to spare, sent with others that each need two
    blocks or more, so that it can run only while none of them holds its blocks. It must be served with the ground
    truth's tokens, or refused with an error that names the limit; the others must be served with theirs; nobody
    may wait forever (the watchdog). Proven: the engine ran the pool it was given (its own pool size)."""
    block = engine.kv_layout.block_size()
    limit = WHOLE_POOL_BLOCKS * block
    small = [r for r in requests_greedy if block < len(r.prompt_token_ids) + r.max_tokens <= SMALL_BLOCKS * block]
    small = small[:WHOLE_POOL_OTHERS]
    assert small, "the request set has no small requests"
    vocab, _ = model_vocab(engine.model_dir)
    rng = random.Random(8)
    output = WHOLE_POOL_OUTPUT_BLOCKS * block
    whole = GenRequest("whole-pool", [rng.randrange(3, vocab) for _ in range(limit - output)], output)
    pool = WHOLE_POOL_BLOCKS + 1
    knobs = Knobs(block_size=block, num_gpu_blocks=pool, max_model_len=limit, preemption_mode="recompute")
    result = engine.generate([whole, *small], knobs)
    got = result.outputs[0]
    problems = []
    if got.finish_reason in ("rejected", "error"):
        if not got.error or not any(word in got.error for word in WHOLE_POOL_WORDS):
            problems.append(f"the whole-pool request was refused without naming the limit it hit: {got.error!r}")
    else:
        want = truth_engine.generate([whole])
        comparison = compare_outputs(engine, type(result)([got]), want, [whole], truth_engine.top2_margins,
                                     f"{engine.name} whole-pool request", tolerance, gap_of=truth_engine.logit_gap)
        near_ties.extend(f"{comparison.label}: {rid}: {v.explain()}" for rid, v in comparison.near_ties)
        problems += [f"the whole-pool request was not served right: {v.explain()}" for _, v in comparison.mismatches]
    wanted = {r.request_id for r in small}
    problems += _served_the_others(engine, type(result)(result.outputs[1:]),
                                   type(truth)([o for o in truth.outputs if o.request_id in wanted]), "whole-pool",
                                   small, truth_engine, near_ties, tolerance)
    _report(problems)
    ran = result.counters.num_gpu_blocks
    if ran is None:
        undecided(f"{engine.name} does not say how large a pool it ran, so nothing proves the request needed all of it")
    claim(ran == pool, f"{engine.name} ran a pool of {ran} blocks, not the {pool} it was given: the request did not "
                       "need all of it")
    record_evidence("whole_pool_request", got.finish_reason)
    if ran == pool:
        record_proof("whole_pool_request", limit)


def test_exhausted_swap_space_falls_back_to_recompute(engine, requests_greedy, truth, truth_engine, near_ties,
                                                     tolerance):
    """Documented fallback: a victim the host pool cannot take is recomputed instead; all complete.

    The host pool holds one block and every request spans at least two, so every swap falls back,
    whichever requests the engine happens to preempt: over HTTP the schedule depends on when each
    request arrives, and a roomier host pool (four blocks) took every victim of some schedules."""
    require(engine, "swap")
    pairs = [(r, t) for r, t in zip(requests_greedy, truth.outputs, strict=True)
             if len(r.prompt_token_ids) > engine.kv_layout.block_size()]
    requests = [r for r, _ in pairs]
    knobs = pressured_knobs(engine, requests, num_cpu_blocks=1, preemption_mode="swap")
    result = engine.generate(requests, knobs)
    prove(result, engine, "swap_fallbacks", "a fallback from swap to recompute")
    unfinished = [(o.request_id, o.finish_reason) for o in result.outputs if o.finish_reason not in ("length", "stop")]
    assert not unfinished, f"requests did not finish once swap space ran out (no fallback to recompute): {unfinished}"
    comparison = compare_outputs(engine, result, type(truth)([t for _, t in pairs]), requests,
                                 truth_engine.top2_margins, f"{engine.name} after the fallback to recompute", tolerance,
                                 gap_of=truth_engine.logit_gap)
    near_ties.extend(f"{comparison.label}: {rid}: {v.explain()}" for rid, v in comparison.near_ties)
    wrong = [rid for rid, _ in comparison.mismatches]
    assert not wrong, f"outputs after the fallback to recompute differ from the ground truth: {wrong}"


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_every_swap_wanted_but_not_made_is_a_counted_fallback(mode, engine, requests_greedy):
    """8c'. With a host pool of one block, every preemption whose policy wanted a swap (fixed ``swap``, or
    ``auto`` deciding by cost) but recomputed is counted in ``swap_fallbacks`` and says so on its event
    (``wanted="swap"``, ``mode="recompute"``): the policy does what its knob says, and says when it cannot."""
    require(engine, "swap", *(("auto_preemption",) if mode == "auto" else ()))
    requests = [r for r in requests_greedy if len(r.prompt_token_ids) > engine.kv_layout.block_size()]
    result = engine.generate(requests, pressured_knobs(engine, requests, num_cpu_blocks=1, preemption_mode=mode))
    events = require_events(result, engine, "which preemptions wanted a swap")
    preempted = [e for e in events if e.kind == "preempted"]
    if preempted and all("wanted" not in e.data for e in preempted):
        pytest.skip(f"{engine.name}'s preemption events do not say which mode was wanted (not exposed)")
    fell_back = [e.request_id for e in preempted if e.data.get("wanted") == "swap" and e.data["mode"] == "recompute"]
    if not fell_back:
        pytest.skip(f"{mode}: no preemption wanted a swap the host pool could not take ({len(preempted)} "
                    "preemptions): nothing proves fallbacks are counted (undecided)")
    counted = prove(result, engine, "swap_fallbacks", "a swap fallback")
    assert counted == len(fell_back), (f"{mode}: swap_fallbacks={counted} but {len(fell_back)} preemptions wanted a "
                                       f"swap and recomputed ({fell_back[:10]})")


@pytest.mark.conformance(pressured=False)
@pytest.mark.parametrize(("knob", "value"), [("block_size", 3), ("num_gpu_blocks", -1), ("max_num_seqs", 0),
                                             ("preemption_mode", "teleport")])
def test_invalid_configuration_names_the_field(knob, value, engine, requests_greedy):
    """The engine (or its server) refuses the value with an error naming the field. An adapter that refuses
    it first (:class:`AdapterRefusal`) leaves the engine's own validation untested: a skip saying so, never a
    pass on the adapter's words."""
    require_knobs(engine, knob)
    knobs = roomy_knobs(engine, requests_greedy[:2])
    if knob == "block_size":  # the same pool in tokens, so the block size is the only thing wrong with it
        knobs = knobs.merged(Knobs(num_gpu_blocks=math.ceil(knobs.num_gpu_blocks * knobs.block_size / value)))
    knobs = knobs.merged(Knobs(**{knob: value}))
    with pytest.raises(Exception) as info:  # any exception type, but it must name the field
        engine.generate(requests_greedy[:2], knobs)
    if isinstance(info.value, AdapterRefusal):
        pytest.skip(f"{engine.name}'s adapter refused {knob}={value!r} before the engine saw it ({info.value}): "
                    "the engine's own validation of it is not exercised")
    # the field's name as kvbench, the engine's flags or its prose say it (vLLM: "No common block size for 3")
    words = {"num_gpu_blocks": ("num_gpu_blocks", "num_blocks"),
             "block_size": ("block_size", "page_size", "block size"),
             "max_num_seqs": ("max_num_seqs", "max_requests", "n_parallel"),  # llama.cpp: --parallel's field
             "preemption_mode": ("preemption_mode",)}[knob]
    # the engine's own words: a server that failed to start is judged by what it wrote, not by the
    # command line kvbench wrote (which names every flag)
    said = getattr(info.value, "engine_output", "") or str(info.value)
    assert any(w in said for w in words), f"the error does not name {knob}: {info.value!r}"
