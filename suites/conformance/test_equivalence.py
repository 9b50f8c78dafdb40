"""Checks 1-4 and 7: outputs under forced pressure equal the unpressured run and the ground truth,
and the mechanism each check is about provably fired.

Every check compares outputs first, so that a wrong answer fails whether or not the mechanism can be
proven; then it proves the mechanism (:func:`~kvbench.conformance.prove.prove`, or from outside where the
engine counts nothing: :mod:`kvbench.conformance.chunking`); then its other assertions, each a
:func:`~kvbench.conformance.verdict.claim` an expected failure can excuse one by one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench.conformance.chunking import chunked_prefill_from_outside
from kvbench.conformance.metrics_truth import (
    hits_over_ceiling,
    prefix_hit_ceiling,
    prefix_hit_floor,
    told_twice_disagreements,
)
from kvbench.conformance.preconditions import record_precondition
from kvbench.conformance.prove import (
    assert_conforms,
    compare_outputs,
    exact_only,
    fitted_requests,
    pressured_knobs,
    prove,
    roomy_knobs,
    until_triggered,
)
from kvbench.conformance.verdict import claim, record_proof, undecided
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: the most requests the prefix-caching checks (3 and 3b) admit at once: check 3's floor on hits needs the bound
CACHING_SEQS = 4


def _conforms(engine, result, truth, requests, truth_engine, near_ties, label, tolerance):
    comparison = compare_outputs(engine, result, truth, requests, truth_engine.top2_margins, f"{engine.name} {label}",
                                 tolerance, gap_of=truth_engine.logit_gap)
    assert_conforms(comparison, near_ties)


@pytest.mark.conformance(pressured=False)
def test_unpressured_matches_ground_truth(engine, unpressured, truth, requests_greedy, truth_engine, near_ties,
                                          tolerance):
    """The baseline of every other check: no pressure, same tokens as transformers."""
    _conforms(engine, unpressured, truth, requests_greedy, truth_engine, near_ties, "unpressured", tolerance)


def test_recompute_preemption_equivalence(engine, truth, requests_greedy, truth_engine, near_ties, tolerance):
    """1. Forced recompute preemption: same tokens; preemptions by recompute > 0."""
    require(engine, "recompute")
    knobs = pressured_knobs(engine, requests_greedy, preemption_mode="recompute")

    def attempt():
        result = engine.generate(requests_greedy, knobs)
        _conforms(engine, result, truth, requests_greedy, truth_engine, near_ties, "recompute", tolerance)
        return result

    prove(until_triggered(engine, "preemptions_recompute", attempt), engine, "preemptions_recompute",
          "recompute preemption")


def test_swap_preemption_equivalence(engine, truth, requests_greedy, truth_engine, near_ties, tolerance):
    """2. Forced swap preemption: same tokens; swap-outs and swap-ins > 0."""
    require(engine, "swap")
    knobs = pressured_knobs(engine, requests_greedy, num_cpu_blocks=512, preemption_mode="swap")

    def attempt():
        result = engine.generate(requests_greedy, knobs)
        _conforms(engine, result, truth, requests_greedy, truth_engine, near_ties, "swap", tolerance)
        return result

    result = until_triggered(engine, "preemptions_swap", attempt)
    prove(result, engine, "preemptions_swap", "swap preemption")
    prove(result, engine, "swap_ins", "swap-in")


def test_swapped_blocks_survive_the_round_trip_byte_for_byte(engine, requests_greedy):
    """2b. Every swapped block holds the same bytes after swap-out and swap-in."""
    require(engine, "swap", "block_introspection")
    if not hasattr(engine, "swap_round_trip"):
        pytest.skip(f"{engine.name} exposes no KV tensors to compare")
    knobs = pressured_knobs(engine, requests_greedy, num_cpu_blocks=512, preemption_mode="swap")
    compared, mismatches = engine.swap_round_trip(requests_greedy, knobs)
    claim(not mismatches, f"{len(mismatches)} swapped blocks differ after the round trip: {mismatches[:5]}")
    claim(compared > 0, "no block was swapped in: the check proved nothing")
    if compared > 0:
        record_proof("swapped_blocks_compared", compared)


def test_prefix_caching_equivalence_and_hits(engine, model_dir, truth_engine, near_ties, tolerance):
    """3. Prefix caching on == off, with hits > 0, on requests that share a system prompt. Off counts no hit;
    on counts at least the reuse the shared prefixes guarantee at this concurrency
    (:func:`~kvbench.conformance.metrics_truth.prefix_hit_floor`) and at most the reuse they can give, each
    admission once (:func:`~kvbench.conformance.metrics_truth.prefix_hit_ceiling`), in its counter and in
    the responses' per-request cached tokens where it reports them, and the two agree."""
    require(engine, "prefix_caching")
    requests = fitted_requests(engine, model_dir, seed=77, n=12, shared_prefix=64)
    truth = truth_engine.generate(requests)
    base = roomy_knobs(engine, requests, max_num_seqs=CACHING_SEQS)
    off = engine.generate(requests, replace(base, enable_prefix_caching=False))
    on = engine.generate(requests, replace(base, enable_prefix_caching=True))
    _conforms(engine, off, truth, requests, truth_engine, near_ties, "prefix caching off", tolerance)
    _conforms(engine, on, truth, requests, truth_engine, near_ties, "prefix caching on", tolerance)
    prove(on, engine, "prefix_cache_hits", "a prefix-cache hit")
    cached_off = sum(o.cached_tokens or 0 for o in off.outputs)
    claim(not off.counters.get("prefix_cache_hits") and not cached_off,
          f"{engine.name} counted prefix-cache hits with caching off (prefix_cache_hits="
          f"{off.counters.get('prefix_cache_hits')}, cached tokens in the responses {cached_off})")
    block_size = base.block_size or engine.kv_layout.block_size()
    floor = prefix_hit_floor(requests, block_size, base.max_num_seqs or CACHING_SEQS)
    for problem in told_twice_disagreements(on, floor, prefix_hit_ceiling(requests, on, block_size)):
        claim(False, f"{engine.name}'s prefix-cache counts disagree: {problem}")


def test_recompute_after_preemption_reuses_cached_blocks(engine, requests_greedy, truth, truth_engine, near_ties,
                                                         tolerance):
    """3b. Under recompute pressure with caching, preempted requests re-hit their own blocks, so
    fewer tokens are computed than without caching; and the hits counted are no more than the requests can
    give, each admission once (:func:`~kvbench.conformance.metrics_truth.prefix_hit_ceiling`: an admission
    retried while it waits for room is still one)."""
    require(engine, "prefix_caching", "recompute")
    # at most CACHING_SEQS at once where the engine can cap it, as check 3's runs: on an engine that starts afresh
    # per knob set the two checks then share their two launches (caching on, caching off)
    cap = {} if "max_num_seqs" in (getattr(engine, "unsupported_knobs", {}) or {}) else {"max_num_seqs": CACHING_SEQS}
    knobs = pressured_knobs(engine, requests_greedy, preemption_mode="recompute", **cap)
    without = engine.generate(requests_greedy, replace(knobs, enable_prefix_caching=False))
    _conforms(engine, without, truth, requests_greedy, truth_engine, near_ties, "recompute, no prefix caching",
              tolerance)

    def attempt():  # the run with caching, its outputs judged; served again over HTTP while it preempted nothing
        result = engine.generate(requests_greedy, replace(knobs, enable_prefix_caching=True))
        _conforms(engine, result, truth, requests_greedy, truth_engine, near_ties, "recompute + prefix caching",
                  tolerance)
        return result

    with_cache = until_triggered(engine, "preemptions_recompute", attempt)
    # a hit on resume can only show where a request was preempted (preconditions.preempted)
    record_precondition("preempted", (with_cache.counters.get("preemptions_recompute") or 0) > 0)
    prove(with_cache, engine, "preemptions_recompute", "recompute preemption")
    prove(with_cache, engine, "prefix_cache_hits", "a prefix-cache hit on resume")
    ceiling = prefix_hit_ceiling(requests_greedy, with_cache, knobs.block_size or engine.kv_layout.block_size())
    over = hits_over_ceiling(with_cache, ceiling)
    claim(over is None, f"{engine.name}: {over}")
    computed = prove(without, engine, "computed_tokens", "computation")
    claim(with_cache.counters["computed_tokens"] < computed,
          f"prefix caching saved no computation on {engine.name}: computed_tokens="
          f"{with_cache.counters['computed_tokens']} with it, {computed} without")


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill_equivalence(budget, engine, truth, requests_greedy, truth_engine, near_ties, tolerance):
    """4. Chunked prefill at budgets smaller than the prompts: same tokens; chunks > 1, counted by the engine
    (``prefill_chunks``) or, where it counts none, proven from outside: a prompt longer than the token budget
    the engine confirms it runs with, answered right (:mod:`kvbench.conformance.chunking`)."""
    require(engine, "chunked_prefill")
    knobs = roomy_knobs(engine, requests_greedy, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    result = engine.generate(requests_greedy, knobs)
    _conforms(engine, result, truth, requests_greedy, truth_engine, near_ties, f"chunked prefill, budget {budget}",
              tolerance)
    if "prefill_chunks" in result.counters:
        prove(result, engine, "prefill_chunks", "a chunked prefill", minimum=2)
        return
    proof = chunked_prefill_from_outside(requests_greedy, result, engine.confirmed_settings(knobs))
    if isinstance(proof, str):
        undecided(f"{engine.name} exposes no 'prefill_chunks' counter, and chunking cannot be proven from "
                  f"outside: {proof}")
    record_proof("prefill_chunks", proof.evidence())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_is_reproducible_across_preemption(mode, engine, model_dir, truth_engine, near_ties, tolerance):
    """7. Seeded temperature sampling gives the same tokens with and without preemption."""
    require(engine, "sampling", mode)
    # The suite's own request set (the one checks 1-3 pressure), sampled: its own 12 requests (seed 31) preempted
    # once in process and sometimes not at all over HTTP, where arrivals spread out, so the check could not run.
    requests = fitted_requests(engine, model_dir, temperature=1.0)
    calm = engine.generate(requests, roomy_knobs(engine, requests))
    swap_space = {"num_cpu_blocks": 512} if mode == "swap" else {}  # a recompute engine needs no host pool
    knobs = pressured_knobs(engine, requests, preemption_mode=mode, **swap_space)

    def attempt():
        stormy = engine.generate(requests, knobs)
        differing = _sampling_differences(engine, requests, calm, stormy, truth_engine, near_ties, tolerance,
                                          f"{engine.name} seeded sampling under {mode}")
        claim(not differing, f"seeded sampling changed under {mode} preemption for {differing}")
        return stormy

    stormy = until_triggered(engine, f"preemptions_{mode}", attempt)
    reseeded = engine.generate([replace(r, seed=r.seed + 1) for r in requests],
                               roomy_knobs(engine, requests))
    claim([o.token_ids for o in reseeded.outputs] != [o.token_ids for o in calm.outputs],
          "another seed gave the same tokens: the engine ignores the seed, so this check proves nothing")
    prove(stormy, engine, f"preemptions_{mode}", f"{mode} preemption")


def _sampling_differences(engine, requests, calm, stormy, truth_engine, near_ties, tolerance, label) -> list[str]:
    """Requests whose sampled tokens differ between the calm and the stormy run, less those whose first
    difference is a near-tie of the sampler's own scores (:meth:`ReferenceAdapter.sampling_scores`: a seeded
    pick is a greedy pick over logits / T minus log of its seeded draws). Only an engine not held to exact
    equality (:func:`~kvbench.conformance.prove.exact_only`) that exposes its sampler's scores gets that
    excuse; the logits are the ground truth's (the engine's dtype), teacher-forced over the calm tokens."""
    scores_of = getattr(engine, "sampling_scores", None)
    differing = []
    for req, a, b in zip(requests, calm.outputs, stormy.outputs, strict=True):
        if a.token_ids == b.token_ids:
            continue
        position = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        if exact_only(engine) or scores_of is None or position is None:
            differing.append(a.request_id)
            continue
        scores = scores_of(req, position, truth_engine.next_logits(req.prompt_token_ids, a.token_ids, position))
        if scores is None:
            differing.append(a.request_id)
            continue
        best, calm_score, stormy_score = (float(scores.max()), float(scores[a.token_ids[position]]),
                                          float(scores[b.token_ids[position]]))
        width = tolerance / req.temperature
        if best - min(calm_score, stormy_score) < width:
            near_ties.append(f"{label}: {a.request_id}: near_tie: first difference at sampled position {position}: "
                             f"tokens {a.token_ids[position]} and {b.token_ids[position]} within "
                             f"{best - min(calm_score, stormy_score):.3g} of the sampler's best score "
                             f"(< tolerance {width:.3g})")
        else:
            differing.append(f"{a.request_id} (at position {position}, {best - min(calm_score, stormy_score):.3g} "
                             f"below the sampler's best score, tolerance {width:.3g})")
    return differing
