"""Check 5: refcount safety. A hypothesis state machine drives the engine's block manager through
allocate, append, share, free, preempt (both modes), swap in and evict against a plain-Python
model, checking invariants after every step; at the end the pool must be whole.

The same safety from outside, on any engine with prefix caching: requests in several groups, each group
sharing a prefix of whole blocks, run at once in a pool too small for them, so that blocks several running
requests share stay held while other requests are preempted and their blocks handed out again. A block
freed while a sharer still reads it is overwritten, and that sharer's tokens go wrong; so every output must
match the ground truth, the engine must serve correctly afterwards (a fresh request, partly from what the
prefix cache kept), and it must end with its pool empty and nothing running or waiting.
"""

from __future__ import annotations

import random

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvbench.conformance.prove import assert_conforms, compare_outputs, model_vocab, pressured_knobs, prove
from kvbench.conformance.stateful import machine_settings, make_state_machine
from kvbench.conformance.verdict import claim
from kvbench.core.evidence import record_evidence
from kvbench.core.requests import GenRequest
from kvbench.plugin import require

pytestmark = pytest.mark.conformance

#: the shared-prefix workload, in blocks of the engine's block size: GROUPS groups of MEMBERS requests, each
#: group sharing PREFIX_BLOCKS whole blocks, each request adding a suffix under half a block and OUTPUT_BLOCKS
#: blocks of output; the pool holds the largest request POOL_FACTOR times (a group's members running at once
#: hold more than that even while sharing)
GROUPS, MEMBERS, PREFIX_BLOCKS, OUTPUT_BLOCKS, POOL_FACTOR = 3, 4, 2, 2, 3.0
#: a step computes at most this many tokens of prompt (chunked prefill; four blocks of 16, two of 32): the groups'
#: first members are admitted over the first steps, and the others once those have computed (and so cached) the
#: prefix they share, while they still run. An engine that caches a block only once its KV is computed shares
#: nothing between requests admitted in one step. The same budget as the other chunked checks' larger one
#: (test_equivalence, test_nothing_lost), so an engine that starts a server per knob set serves them from one.
STEP_BUDGET_TOKENS = 64


def test_block_manager_state_machine(engine):
    require(engine, "block_introspection")
    machine = make_state_machine(engine.block_manager_factory(), name=f"{engine.kind}_blocks")
    run_state_machine_as_test(machine, settings=machine_settings())


def shared_prefix_requests(engine, model_dir: str, seed: int = 55) -> list[GenRequest]:
    """GROUPS x MEMBERS requests, member by member across the groups (g0m0, g1m0, g2m0, g0m1, ...); each group's
    prefix is PREFIX_BLOCKS whole blocks of its own seeded tokens."""
    block = engine.kv_layout.block_size()
    vocab, _ = model_vocab(model_dir)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(PREFIX_BLOCKS * block)] for _ in range(GROUPS)]
    suffixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, block // 2))] for _ in range(GROUPS * MEMBERS)]
    return [GenRequest(f"g{g}m{m}", prefixes[g] + suffixes[m * GROUPS + g], OUTPUT_BLOCKS * block)
            for m in range(MEMBERS) for g in range(GROUPS)]


def fresh_requests(engine, model_dir: str, requests: list[GenRequest], seed: int = 56) -> list[GenRequest]:
    """Two requests for after the storm: one on group 0's prefix (served partly from the blocks the cache kept),
    one on a prompt nobody sent."""
    block = engine.kv_layout.block_size()
    vocab, _ = model_vocab(model_dir)
    rng = random.Random(seed)
    prefix = requests[0].prompt_token_ids[:PREFIX_BLOCKS * block]
    return [GenRequest("after-shared", prefix + [rng.randrange(3, vocab) for _ in range(block // 2)], block),
            GenRequest("after-new", [rng.randrange(3, vocab) for _ in range(PREFIX_BLOCKS * block + 3)], block)]


def _held_after(result) -> int | None:
    """Blocks still held once every request finished (None: not exposed); fails when the engine still had
    requests running or waiting, which leaves its gauge unread."""
    stuck = [line for line in result.evidence if "still held" in line]
    claim(not stuck, f"the engine still ran or queued requests after every response: {stuck[:1]}")
    return result.counters.leaked_blocks


def test_shared_blocks_survive_pressure_from_outside(engine, model_dir, truth_engine, near_ties, tolerance):
    require(engine, "recompute", "prefix_caching")
    requests = shared_prefix_requests(engine, model_dir)
    truth = truth_engine.generate(requests)
    knobs = pressured_knobs(engine, requests, POOL_FACTOR, enable_prefix_caching=True, preemption_mode="recompute",
                            enable_chunked_prefill=True, max_num_batched_tokens=STEP_BUDGET_TOKENS,
                            max_num_seqs=len(requests))
    stormy = engine.generate(requests, knobs)
    margins = truth_engine.top2_margins
    assert_conforms(compare_outputs(engine, stormy, truth, requests, margins, f"{engine.name} shared prefixes under "
                                    "pressure", tolerance, gap_of=truth_engine.logit_gap), near_ties)
    held = _held_after(stormy)
    record_evidence("leaked_blocks", held if held is not None else "not exposed")
    claim(held in (None, 0), f"{held} blocks are still held after every request of the shared-prefix storm finished "
                             "(a shared block whose count never came back to zero)")
    # the same knobs reach the same engine where it outlives a call (a server kept per knob set): what the storm
    # left in its pool and prefix cache serves these
    fresh = fresh_requests(engine, model_dir, requests)
    after = engine.generate(fresh, knobs)
    assert_conforms(compare_outputs(engine, after, truth_engine.generate(fresh), fresh, margins,
                                    f"{engine.name} after the storm", tolerance, gap_of=truth_engine.logit_gap),
                    near_ties)
    held_after = _held_after(after)
    claim(held_after in (None, 0), f"{held_after} blocks are still held once the requests after the storm finished")
    prove(stormy, engine, "preemptions_recompute", "a preemption while blocks were shared")
    prove(stormy, engine, "prefix_cache_hits", "a prefix-cache hit (a block shared)")
