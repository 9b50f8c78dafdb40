"""Exact unit tests of the physical block pool: free-queue order, refcounts, the prefix-cache map.

In the style of vLLM's prefix-caching tests: small pools, exact block ids, exact queue order.
"""

from __future__ import annotations

import pytest

from reference_engine.block_pool import BlockHash, BlockPool, FreeBlockQueue, HostBlockPool, KVBlock

NUM_BLOCKS = 11


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def hash_chain(*blocks: list[int]) -> list[BlockHash]:
    """Chained hashes of consecutive full blocks, as the manager computes them."""
    out: list[BlockHash] = []
    for tokens in blocks:
        out.append(BlockHash.of(out[-1] if out else None, tokens))
    return out


# ---------------------------------------------------------------------------- FreeBlockQueue
def test_free_queue_pops_in_insertion_order() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5
    assert [queue.popleft().block_id for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_removes_from_the_middle_and_relinks_neighbours() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    # The removed block is unlinked entirely, and its neighbours now point at each other.
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2] not in queue
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert len(queue) == 4
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert [b.block_id for b in queue] == [1, 3]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 2]


def test_free_queue_refuses_to_remove_a_block_it_does_not_hold() -> None:
    queue = FreeBlockQueue([KVBlock(0)])
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(KVBlock(1))


# ---------------------------------------------------------------------------- BlockPool
def test_allocate_hands_out_lowest_ids_first_with_refcount_one() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free == NUM_BLOCKS - 3
    assert queue_ids(pool) == list(range(3, NUM_BLOCKS))
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    pool.allocate(NUM_BLOCKS - 1)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_invariants()


def test_invalid_pool_size_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0, enable_caching=True)


def test_free_appends_in_the_given_order_so_first_given_is_evicted_first() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    blocks = pool.allocate(4)  # 0 1 2 3
    pool.free(reversed(blocks))  # the manager frees tail first
    assert queue_ids(pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1, 0]
    # The never-used blocks go first, then the freed ones, tail of the request first.
    assert [b.block_id for b in pool.allocate(9)] == [4, 5, 6, 7, 8, 9, 10, 3, 2]
    pool.check_invariants()


def test_shared_block_joins_queue_only_when_last_reference_drops() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and block not in pool.free_queue
    pool.free([block])
    assert block.ref_cnt == 0 and queue_ids(pool)[-1] == 0
    pool.check_invariants()


def test_double_free_raises() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([block])
    pool.check_invariants()


def test_cached_block_survives_until_its_space_is_needed() -> None:
    pool = BlockPool(4, enable_caching=True)
    (h,) = hash_chain([1, 2, 3])
    a = pool.allocate(1)[0]  # block 0
    pool.register(a, h)
    pool.free([a])
    # Block 0 is cached and free: it is at the queue's tail, behind the never-used blocks.
    assert queue_ids(pool) == [1, 2, 3, 0]
    assert pool.num_free == 4
    assert [b.block_id for b in pool.allocate(3)] == [1, 2, 3]
    assert pool.lookup(h) is a and pool.num_evictions == 0
    # Only now, when its space is needed, is it evicted.
    assert pool.allocate(1) == [a]
    assert a.block_hash is None and pool.lookup(h) is None
    assert pool.cached == {} and pool.num_evictions == 1
    pool.check_invariants()


def test_touch_pulls_a_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.allocate(6)
    hashes = hash_chain(*[[i] * 4 for i in range(6)])
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    pool.free(blocks)
    assert queue_ids(pool) == [0, 1, 2, 3, 4, 5]
    hit = pool.lookup(hashes[3])
    assert hit is blocks[3]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert queue_ids(pool) == [0, 1, 2, 4, 5]  # order of the others untouched
    # A hit does not evict: the block keeps its hash, so others can hit it too.
    assert pool.lookup(hashes[3]) is hit and pool.num_evictions == 0
    pool.check_invariants()


def test_register_is_a_no_op_without_caching() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=False)
    (block,) = pool.allocate(1)
    (h,) = hash_chain([1, 2])
    pool.register(block, h)
    assert block.block_hash is None and pool.cached == {} and pool.lookup(h) is None


def test_duplicate_content_stays_anonymous() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    first, second = pool.allocate(2)
    (h,) = hash_chain([5, 6, 7])
    pool.register(first, h)
    pool.register(second, h)
    assert first.block_hash == h and second.block_hash is None
    assert pool.cached == {h.value: first}
    # Registering a block twice keeps its first identity.
    (other,) = hash_chain([9])
    pool.register(first, other)
    assert first.block_hash == h and other.value not in pool.cached


def test_hash_is_chained_on_the_parent() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    a_then_b = hash_chain([1, 1], [2, 2])
    c_then_b = hash_chain([3, 3], [2, 2])
    assert a_then_b[1].token_ids == c_then_b[1].token_ids
    assert a_then_b[1].value != c_then_b[1].value
    blocks = pool.allocate(2)
    for block, h in zip(blocks, a_then_b, strict=True):
        pool.register(block, h)
    assert pool.lookup(a_then_b[1]) is blocks[1]
    assert pool.lookup(c_then_b[1]) is None  # same tokens, different parent: a miss


def test_lookup_compares_token_ids_on_a_value_collision() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    stored = BlockHash(value=42, parent=None, token_ids=(1, 2, 3))
    pool.register(block, stored)
    assert pool.lookup(BlockHash(42, None, (1, 2, 3))) is block
    assert pool.lookup(BlockHash(42, None, (1, 2, 4))) is None  # colliding value, other tokens
    assert pool.lookup(BlockHash(42, 7, (1, 2, 3))) is None  # colliding value, other parent


# ---------------------------------------------------------------------------- BlockPool.check_invariants
def test_pool_invariants_catch_a_held_block_in_the_free_queue() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.free_queue.append(block)  # corrupt: held (ref 1) and free at once
    with pytest.raises(AssertionError, match="queue membership is wrong"):
        pool.check_invariants()


def test_pool_invariants_catch_a_free_block_missing_from_the_queue() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    block.ref_cnt = 0  # corrupt: unreferenced but never returned to the queue (a leak)
    with pytest.raises(AssertionError, match="queue membership is wrong"):
        pool.check_invariants()


def test_pool_invariants_catch_a_negative_refcount() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    pool.blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError, match="negative refcount"):
        pool.check_invariants()


def test_pool_invariants_catch_a_stale_cache_entry() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    (block,) = pool.allocate(1)
    (h,) = hash_chain([1])
    pool.register(block, h)
    block.block_hash = None  # corrupt: the map still points at a block that forgot its content
    with pytest.raises(AssertionError, match="stale cache entry"):
        pool.check_invariants()


def test_pool_invariants_catch_a_wrong_free_counter() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    pool.free_queue.num_free += 1
    with pytest.raises(AssertionError, match="length counter"):
        pool.check_invariants()


# ---------------------------------------------------------------------------- HostBlockPool
def test_host_pool_hands_out_low_ids_and_reuses_the_last_freed() -> None:
    host = HostBlockPool(4)
    assert host.allocate(3) == [0, 1, 2]
    assert host.num_free == 1
    host.free([1])
    assert host.num_free == 2
    assert host.allocate(2) == [1, 3]
    host.check_invariants()


def test_host_pool_short_or_double_free_raises() -> None:
    host = HostBlockPool(2)
    ids = host.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 host blocks with 0 free"):
        host.allocate(1)
    host.free(ids)
    with pytest.raises(RuntimeError, match="double free of host block 0"):
        host.free([0])
    assert host.num_free == 2
    host.check_invariants()


def test_host_pool_invariants_catch_a_block_both_free_and_used() -> None:
    host = HostBlockPool(3)
    host.allocate(1)
    host._free.append(0)  # corrupt: 0 is used and free
    with pytest.raises(AssertionError, match="lost or duplicated"):
        host.check_invariants()
