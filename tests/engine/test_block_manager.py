"""Exact unit tests of the block manager: block tables, prefix hits, LRU eviction, swap, self-checks.

In the style of vLLM's prefix-caching tests: block size 16, eleven device blocks, a ``make_request``
helper, exact block ids and exact free-queue order. ``admit`` and ``compute`` play the scheduler's
part (find the cached prefix, allocate, and after the "model" ran, register full blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from reference_engine.block_manager import BlockManager
from reference_engine.block_pool import BlockHash
from reference_engine.request import Request
from reference_engine.sampling_params import SamplingParams
from reference_engine.scheduler import Scheduler

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 11
NUM_CPU_BLOCKS = 4


def make_request(request_id: str, prompt_token_ids: Sequence[int]) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=16), arrival_time=0.0)


def make_manager(num_gpu_blocks: int = NUM_GPU_BLOCKS, num_cpu_blocks: int = NUM_CPU_BLOCKS,
                 enable_caching: bool = True) -> BlockManager:
    return BlockManager(num_gpu_blocks, num_cpu_blocks, BLOCK_SIZE, enable_caching=enable_caching)


def tokens(first: int, n: int) -> list[int]:
    """``n`` distinct token ids starting at ``first``: content no other helper call repeats."""
    return list(range(first, first + n))


def admit(bm: BlockManager, req: Request, num_new: int | None = None) -> list[int]:
    """Admit like the scheduler: share the cached prefix, allocate the rest; returns hit block ids."""
    hits = bm.find_cached_prefix(req)
    cached = len(hits) * BLOCK_SIZE
    num_new = req.num_tokens - cached if num_new is None else num_new
    assert bm.allocate_slots(req, num_new, hits)
    req.num_computed_tokens = cached
    return [b.block_id for b in hits]


def compute(bm: BlockManager, req: Request, n: int | None = None) -> None:
    """The model ran over the next ``n`` tokens (default: all): register the now-full blocks."""
    req.num_computed_tokens += req.num_tokens - req.num_computed_tokens if n is None else n
    bm.cache_full_blocks(req)


def queue_ids(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.pool.free_queue]


def refs(bm: BlockManager, ids: Sequence[int]) -> list[int]:
    return [bm.pool.blocks[i].ref_cnt for i in ids]


def hashed_ids(bm: BlockManager) -> list[int]:
    return sorted(b.block_id for b in bm.pool.cached.values())


# ---------------------------------------------------------------------------- allocation and hashing
def test_prefill_allocates_exact_blocks_and_hashes_only_full_ones() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 3 * BLOCK_SIZE + 7))
    assert admit(bm, a) == []
    assert bm.blocks_of("a") == [0, 1, 2, 3]
    assert bm.pool.cached == {}  # nothing is computed yet
    compute(bm, a)
    assert hashed_ids(bm) == [0, 1, 2]
    table = bm.block_tables["a"]
    assert table[3].block_hash is None  # partial block: never hashed
    # The chain: each block's hash names its parent's.
    assert table[0].block_hash.parent is None
    assert table[1].block_hash.parent == table[0].block_hash.value
    assert table[2].block_hash.token_ids == tuple(tokens(32, 16))
    assert bm.num_free_gpu_blocks == NUM_GPU_BLOCKS - 4
    bm.check_invariants()


def test_hash_is_registered_only_after_compute() -> None:
    bm = make_manager()
    prompt = tokens(0, 3 * BLOCK_SIZE + 1)
    a = make_request("a", prompt)
    admit(bm, a)
    # In flight: allocated but not computed, so a twin must not hit it.
    assert bm.find_cached_prefix(make_request("twin1", prompt)) == []
    compute(bm, a, BLOCK_SIZE + 5)  # a chunk: one block completes
    assert hashed_ids(bm) == [0]
    assert [b.block_id for b in bm.find_cached_prefix(make_request("twin2", prompt))] == [0]
    compute(bm, a)
    assert hashed_ids(bm) == [0, 1, 2]
    assert [b.block_id for b in bm.find_cached_prefix(make_request("twin3", prompt))] == [0, 1, 2]
    bm.check_invariants()


def test_decode_adds_one_block_exactly_at_a_block_boundary() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 2 * BLOCK_SIZE))
    admit(bm, a)
    compute(bm, a)
    assert bm.blocks_of("a") == [0, 1]
    a.output_token_ids.append(999)  # token 33 starts block 2
    assert bm.allocate_slots(a, 1)
    assert bm.blocks_of("a") == [0, 1, 2]
    compute(bm, a)
    a.output_token_ids.append(998)  # token 34 fits in block 2
    assert bm.allocate_slots(a, 1)
    assert bm.blocks_of("a") == [0, 1, 2]
    bm.check_invariants()


# ---------------------------------------------------------------------------- prefix sharing
def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 3 * BLOCK_SIZE + 7))
    admit(bm, a)
    compute(bm, a)
    b = make_request("b", tokens(0, 3 * BLOCK_SIZE) + tokens(500, 10))
    assert admit(bm, b) == [0, 1, 2]
    assert b.num_computed_tokens == 3 * BLOCK_SIZE
    assert bm.blocks_of("b") == [0, 1, 2, 4]  # shares three, one new block for its own tail
    assert refs(bm, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    bm.check_invariants()

    bm.free("a")
    assert refs(bm, [0, 1, 2, 3, 4]) == [1, 1, 1, 0, 1]
    assert queue_ids(bm) == [5, 6, 7, 8, 9, 10, 3]  # only a's private block came back
    bm.free("b")
    assert queue_ids(bm) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1, 0]  # b's tail first
    assert hashed_ids(bm) == [0, 1, 2]  # still cached after both left
    assert bm.is_whole()
    bm.check_invariants()


def test_a_prompt_is_never_a_full_hit() -> None:
    bm = make_manager()
    prompt = tokens(0, 2 * BLOCK_SIZE)
    a = make_request("a", prompt)
    admit(bm, a)
    compute(bm, a)
    assert hashed_ids(bm) == [0, 1]  # both blocks are cached...
    again = make_request("again", prompt)
    assert admit(bm, again) == [0]  # ...but the last token must be computed: one block only
    assert again.num_computed_tokens == BLOCK_SIZE
    assert bm.blocks_of("again") == [0, 2]  # block 1 is not shared: "again" recomputes into its own
    longer = make_request("longer", [*prompt, 7])
    assert [b.block_id for b in bm.find_cached_prefix(longer)] == [0, 1]
    bm.check_invariants()


def test_hashes_are_chained_so_same_block_under_another_parent_misses() -> None:
    bm = make_manager()
    x, y, z = tokens(0, BLOCK_SIZE), tokens(100, BLOCK_SIZE), tokens(200, BLOCK_SIZE)
    a = make_request("a", [*x, *y, 1])
    admit(bm, a)
    compute(bm, a)
    assert bm.find_cached_prefix(make_request("zy", [*z, *y, 1])) == []
    assert [b.block_id for b in bm.find_cached_prefix(make_request("xz", [*x, *z, 1]))] == [0]
    assert [b.block_id for b in bm.find_cached_prefix(make_request("xy", [*x, *y, 2]))] == [0, 1]


def test_hash_collision_is_a_miss_because_token_ids_are_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    def colliding_of(cls: type[BlockHash], parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
        return cls(42, parent.value if parent is not None else None, tuple(token_ids))  # every value collides

    monkeypatch.setattr(BlockHash, "of", classmethod(colliding_of))
    bm = make_manager()
    a = make_request("a", [1] * BLOCK_SIZE + [0])
    admit(bm, a)
    compute(bm, a)
    assert list(bm.pool.cached) == [42]
    # Same value, other tokens: the lookup must not hand out a's KV.
    assert bm.find_cached_prefix(make_request("b", [2] * BLOCK_SIZE + [0])) == []
    assert [b.block_id for b in bm.find_cached_prefix(make_request("a2", [1] * BLOCK_SIZE + [5]))] == [0]


def test_caching_disabled_never_hits_or_registers() -> None:
    bm = make_manager(enable_caching=False)
    prompt = tokens(0, 3 * BLOCK_SIZE + 1)
    a = make_request("a", prompt)
    admit(bm, a)
    compute(bm, a)
    assert bm.pool.cached == {}
    assert bm.find_cached_prefix(make_request("b", prompt)) == []


# ---------------------------------------------------------------------------- LRU eviction
def test_eviction_is_lru_and_freed_tail_first() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 5 * BLOCK_SIZE + 1))
    admit(bm, a)
    compute(bm, a)
    b = make_request("b", tokens(1000, 3 * BLOCK_SIZE + 1))
    admit(bm, b)
    compute(bm, b)
    assert bm.blocks_of("a") == [0, 1, 2, 3, 4, 5] and bm.blocks_of("b") == [6, 7, 8, 9]
    assert hashed_ids(bm) == [0, 1, 2, 3, 4, 6, 7, 8]

    bm.free("a")
    bm.free("b")
    assert queue_ids(bm) == [10, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6]

    # Never-used block first, then a's tail; block 4 is the only cached one evicted.
    c = make_request("c", tokens(2000, 2 * BLOCK_SIZE + 1))
    admit(bm, c)
    assert bm.blocks_of("c") == [10, 5, 4]
    assert hashed_ids(bm) == [0, 1, 2, 3, 6, 7, 8]
    assert bm.pool.num_evictions == 1

    # a again: its first four blocks survived and come out of the middle of the queue.
    a_again = make_request("a_again", tokens(0, 5 * BLOCK_SIZE + 1))
    assert admit(bm, a_again) == [0, 1, 2, 3]
    assert bm.blocks_of("a_again") == [0, 1, 2, 3, 9, 8]  # b's tail evicted next (9 unhashed, 8 hashed)
    assert queue_ids(bm) == [7, 6]
    assert hashed_ids(bm) == [0, 1, 2, 3, 6, 7]
    assert bm.pool.num_evictions == 2
    bm.check_invariants()


def test_recompute_after_preemption_reuses_its_own_cached_blocks() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 2 * BLOCK_SIZE + 3))
    admit(bm, a)
    compute(bm, a)
    bm.free("a")  # preempted by recompute
    a.num_computed_tokens = 0
    assert admit(bm, a) == [0, 1]
    # The never-used blocks 3..10 sit ahead of a's freed tail in the queue, so the new block is 3.
    assert bm.blocks_of("a") == [0, 1, 3]
    assert queue_ids(bm) == [4, 5, 6, 7, 8, 9, 10, 2]
    assert a.num_computed_tokens == 2 * BLOCK_SIZE
    bm.check_invariants()


# ---------------------------------------------------------------------------- allocate_slots when short
def test_allocate_slots_returns_false_and_changes_nothing_when_short() -> None:
    bm = make_manager()
    hog = make_request("hog", tokens(0, 8 * BLOCK_SIZE))
    admit(bm, hog)
    before = (queue_ids(bm), refs(bm, range(NUM_GPU_BLOCKS)), dict(bm.block_tables))
    y = make_request("y", tokens(1000, 3 * BLOCK_SIZE + 1))  # 4 blocks, 3 free
    assert not bm.allocate_slots(y, y.num_tokens)
    assert "y" not in bm.block_tables
    assert (queue_ids(bm), refs(bm, range(NUM_GPU_BLOCKS)), dict(bm.block_tables)) == before
    # A running request that cannot grow keeps its table as it was.
    compute(bm, hog)
    hog.output_token_ids.extend(tokens(5000, 4 * BLOCK_SIZE))
    assert not bm.allocate_slots(hog, 4 * BLOCK_SIZE)
    assert bm.blocks_of("hog") == list(range(8))
    assert bm.allocate_slots(hog, 3 * BLOCK_SIZE)  # exactly the three free blocks
    assert bm.blocks_of("hog") == [*range(8), 8, 9, 10] and bm.num_free_gpu_blocks == 0
    bm.check_invariants()


def test_cached_unreferenced_blocks_count_as_free_but_hits_on_them_are_not_free_twice() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 4 * BLOCK_SIZE + 1))
    admit(bm, a)
    compute(bm, a)
    bm.free("a")
    hog = make_request("hog", tokens(1000, 6 * BLOCK_SIZE))
    admit(bm, hog)
    assert bm.blocks_of("hog") == [5, 6, 7, 8, 9, 10]
    assert queue_ids(bm) == [4, 3, 2, 1, 0]
    assert hashed_ids(bm) == [0, 1, 2, 3]
    assert bm.num_free_gpu_blocks == 5  # four of them cached: still free

    # Hits on blocks 0-2 reclaim three free blocks, so only two remain for new ones.
    too_long = make_request("too_long", tokens(0, 3 * BLOCK_SIZE) + tokens(3000, 40))  # 6 blocks: 3 new
    hits = bm.find_cached_prefix(too_long)
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert not bm.allocate_slots(too_long, too_long.num_tokens - 3 * BLOCK_SIZE, hits)
    assert refs(bm, [0, 1, 2]) == [0, 0, 0] and queue_ids(bm) == [4, 3, 2, 1, 0]
    assert "too_long" not in bm.block_tables and hashed_ids(bm) == [0, 1, 2, 3]

    fits = make_request("fits", tokens(0, 3 * BLOCK_SIZE) + tokens(3000, 20))  # 5 blocks: 2 new
    assert admit(bm, fits) == [0, 1, 2]
    assert bm.blocks_of("fits") == [0, 1, 2, 4, 3]  # block 3 (a's 4th) is evicted only now
    assert hashed_ids(bm) == [0, 1, 2] and bm.num_free_gpu_blocks == 0
    bm.check_invariants()


# ---------------------------------------------------------------------------- free
def test_manager_free_is_idempotent_but_the_pool_refuses_a_double_free() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 20))
    admit(bm, a)
    blocks = list(bm.block_tables["a"])
    bm.free("a")
    bm.free("a")  # the scheduler may free a preempted request again when it finishes: a no-op
    assert bm.is_whole()
    with pytest.raises(RuntimeError, match="double free of block 1"):
        bm.pool.free(reversed(blocks))
    with pytest.raises(RuntimeError, match="double free of host block 0"):
        bm.host.free([0])


def test_is_whole_only_when_nothing_is_held() -> None:
    bm = make_manager()
    assert bm.is_whole()
    a = make_request("a", tokens(0, 20))
    admit(bm, a)
    assert not bm.is_whole()
    bm.swap_out("a")
    assert not bm.is_whole()  # host blocks are held
    bm.forget("a")
    assert bm.is_whole()


# ---------------------------------------------------------------------------- swap
def test_swap_out_and_in_return_exact_pairs_and_account_for_host_blocks() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 2 * BLOCK_SIZE + 8))
    admit(bm, a)
    compute(bm, a)
    b = make_request("b", tokens(1000, BLOCK_SIZE + 4))
    admit(bm, b)
    assert bm.blocks_of("a") == [0, 1, 2] and bm.blocks_of("b") == [3, 4]
    hash0, hash1 = (bm.pool.blocks[i].block_hash for i in (0, 1))

    assert bm.can_swap_out("a")
    assert bm.swap_out("a") == [(0, 0), (1, 1), (2, 2)]
    assert bm.host_tables == {"a": [0, 1, 2]} and "a" not in bm.block_tables
    assert bm.num_free_cpu_blocks == NUM_CPU_BLOCKS - 3
    assert bm.num_free_gpu_blocks == NUM_GPU_BLOCKS - 2
    assert queue_ids(bm) == [5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert hashed_ids(bm) == [0, 1]  # the device copy stays cached until its space is needed
    assert not bm.can_swap_out("b")  # two blocks, one host block left
    bm.check_invariants()

    c = make_request("c", tokens(2000, 7 * BLOCK_SIZE))
    admit(bm, c)
    assert bm.blocks_of("c") == [5, 6, 7, 8, 9, 10, 2]
    assert not bm.can_swap_in("a")  # needs three, two free
    bm.forget("c")
    assert queue_ids(bm) == [1, 0, 2, 10, 9, 8, 7, 6, 5]
    assert bm.can_swap_in("a")
    assert not bm.can_swap_in("a", extra_blocks=7)

    assert bm.swap_in(a) == [(0, 1), (1, 0), (2, 2)]
    assert bm.blocks_of("a") == [1, 0, 2] and bm.host_tables == {}
    assert bm.num_free_cpu_blocks == NUM_CPU_BLOCKS
    # Swap-in evicted the stale cached copies (blocks 0 and 1) and registered the new homes.
    assert bm.pool.lookup(hash0) is bm.pool.blocks[1]
    assert bm.pool.lookup(hash1) is bm.pool.blocks[0]
    bm.check_invariants()


def test_swap_out_of_a_request_sharing_a_prefix_leaves_the_other_holder_intact() -> None:
    bm = make_manager()
    a = make_request("a", tokens(0, 2 * BLOCK_SIZE + 1))
    admit(bm, a)
    compute(bm, a)
    b = make_request("b", tokens(0, 2 * BLOCK_SIZE) + tokens(900, 5))
    assert admit(bm, b) == [0, 1]
    assert bm.blocks_of("b") == [0, 1, 3]
    assert bm.swap_out("b") == [(0, 0), (1, 1), (3, 2)]
    assert refs(bm, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert bm.blocks_of("a") == [0, 1, 2]
    bm.check_invariants()

    # Back in: fresh blocks; a's blocks already hold that content, so the copies stay anonymous.
    assert bm.swap_in(b) == [(0, 4), (1, 5), (2, 6)]
    assert [bm.pool.blocks[i].block_hash for i in (4, 5)] == [None, None]
    assert refs(bm, [0, 1]) == [1, 1]
    bm.check_invariants()
    bm.forget("a")
    bm.forget("b")
    assert bm.is_whole()


# ---------------------------------------------------------------------------- check_invariants
@pytest.fixture
def two_requests() -> BlockManager:
    """``a`` holds [0, 1, 2] (0 and 1 cached) and shares 0 and 1 with ``b`` = [0, 1, 3]; ``s`` is swapped."""
    bm = make_manager()
    a = make_request("a", tokens(0, 2 * BLOCK_SIZE + 1))
    admit(bm, a)
    compute(bm, a)
    admit(bm, make_request("b", [*tokens(0, 2 * BLOCK_SIZE), 7]))
    admit(bm, make_request("s", tokens(500, 5)))
    bm.swap_out("s")
    bm.check_invariants()
    return bm


def test_invariants_catch_a_wrong_refcount(two_requests: BlockManager) -> None:
    two_requests.pool.blocks[0].ref_cnt = 3
    with pytest.raises(AssertionError, match="refcount 3 but 2 holders"):
        two_requests.check_invariants()


def test_invariants_catch_a_refcount_that_missed_a_holder(two_requests: BlockManager) -> None:
    two_requests.pool.blocks[1].ref_cnt = 1  # as if b's hit never took its reference
    with pytest.raises(AssertionError, match="refcount 1 but 2 holders"):
        two_requests.check_invariants()


def test_invariants_catch_a_block_both_free_and_held(two_requests: BlockManager) -> None:
    free_block = two_requests.pool.free_queue._head.next_free
    two_requests.block_tables["a"].append(free_block)  # held by a, still in the free queue
    with pytest.raises(AssertionError, match="refcount 0 but 1 holders"):
        two_requests.check_invariants()


def test_invariants_catch_a_held_block_put_in_the_free_queue(two_requests: BlockManager) -> None:
    two_requests.pool.free_queue.append(two_requests.pool.blocks[2])
    with pytest.raises(AssertionError, match="queue membership is wrong"):
        two_requests.check_invariants()


def test_invariants_catch_a_stale_cache_entry(two_requests: BlockManager) -> None:
    pool = two_requests.pool
    value = pool.blocks[0].block_hash.value
    pool.cached[value] = pool.blocks[5]  # points at a block that does not hold that content
    with pytest.raises(AssertionError, match="stale cache entry"):
        two_requests.check_invariants()


def test_invariants_catch_a_block_held_twice_by_one_request(two_requests: BlockManager) -> None:
    table = two_requests.block_tables["a"]
    table.append(table[0])
    table[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="holds a block twice"):
        two_requests.check_invariants()


def test_invariants_catch_a_leaked_host_block(two_requests: BlockManager) -> None:
    two_requests.host.allocate(1)  # allocated, but no request's host table records it
    with pytest.raises(AssertionError, match="host blocks lost"):
        two_requests.check_invariants()


def test_invariants_catch_a_host_block_held_twice(two_requests: BlockManager) -> None:
    two_requests.host_tables["t"] = list(two_requests.host_tables["s"])
    with pytest.raises(AssertionError, match="host block is held twice"):
        two_requests.check_invariants()


def test_invariants_catch_a_request_on_device_and_host_at_once(two_requests: BlockManager) -> None:
    bm = two_requests
    bm.host_tables["a"] = bm.host.allocate(1)
    with pytest.raises(AssertionError, match=r"device and host blocks at once: \['a'\]"):
        bm.check_invariants()


# ---------------------------------------------------------------------------- prefix accounting
def test_prefix_counters_count_each_admission_once() -> None:
    """Regression: ``find_cached_prefix`` and the scheduler both added to the counters, doubling them."""
    bm = make_manager()
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    prompt = tokens(0, 40)
    sched.add(make_request("a", prompt))
    sched.update(sched.schedule(), {"a": 7})
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (40, 0)
    b = make_request("b", prompt[:33])
    assert len(bm.find_cached_prefix(b)) == 2  # a lookup alone counts nothing
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (40, 0)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 32
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (73, 32)
