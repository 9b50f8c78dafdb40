"""Physical KV blocks: refcounts, an O(1) LRU free queue and the prefix-cache hash map.

A device block is in exactly one of three states::

    in use      ref_cnt > 0, not in the free queue       (held by >= 1 request's block table)
    cached      ref_cnt == 0, in the free queue, hashed  (evictable; reusable by a prefix hit)
    free        ref_cnt == 0, in the free queue, no hash

Allocation pops the free queue's head (least recently freed); if that block was cached its hash
entry is evicted then, not before, so cached blocks survive until their space is actually
needed. A prefix hit on a cached block pulls it out of the middle of the queue in O(1), which
is why the queue is a doubly linked list and not a deque (``deque.remove`` is O(n)).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from reference_engine.engine_counters import EngineCounters


@dataclass(frozen=True)
class BlockHash:
    """Identity of a full block's content: chained from the parent block's hash.

    ``value`` is the lookup key; ``token_ids`` and ``parent`` are kept so that a hit can be
    verified exactly (a hash collision must never share KV between different prefixes).
    """

    value: int
    parent: int | None
    token_ids: tuple[int, ...]

    #: the first block's salt (None: unsalted); later blocks inherit it through the chain
    salt: str | None = None

    @classmethod
    def of(cls, parent: BlockHash | None, token_ids: Iterable[int], salt: str | None = None) -> BlockHash:
        """The hash of a block after ``parent``; ``salt`` (first block only, as vLLM's ``cache_salt``) is part
        of its identity, so blocks of the same tokens under different salts never match."""
        tokens = tuple(token_ids)
        parent_value = parent.value if parent is not None else None
        key = (parent_value, tokens) if salt is None or parent is not None else (parent_value, tokens, salt)
        return cls(hash(key), parent_value, tokens, salt if parent is None else None)


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and remove from the middle."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """The device pool: ``num_blocks`` blocks, refcounts, free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool, counters: EngineCounters | None = None):
        """``counters``: the engine's record, where evictions are counted (a fresh one if None)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: expected >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # BlockHash.value -> block
        self.counters = counters if counters is not None else EngineCounters()

    @property
    def num_evictions(self) -> int:
        """Cache entries dropped because their block was handed out again (``counters.evicted_blocks``)."""
        return self.counters.evicted_blocks

    @property
    def num_free(self) -> int:
        """Free plus cached-but-unreferenced blocks: all can be handed out."""
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the LRU end, evicting their cache entries. Caller checks ``num_free``."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit), pulling cached ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching zero join the
        queue's tail, so the first ones given are evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with exactly this content and parent, or None (collisions are misses)."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def register(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` now holds the computed KV of ``block_hash``. Call only after compute."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.value in self.cached:
            return  # an identical block is already cached; this copy stays anonymous
        block.block_hash = block_hash
        self.cached[block_hash.value] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash.value) is block:
                del self.cached[block.block_hash.value]
            block.block_hash = None
            self.counters.evicted_blocks += 1

    def check_invariants(self) -> None:
        """Free-queue membership matches refcounts and every cache entry points at a block with that hash."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.free_queue.num_free, "free queue length counter is wrong"
        assert len({id(b) for b in in_queue}) == len(in_queue), "a block is in the free queue twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative refcount"
            assert (block.ref_cnt == 0) == (block in self.free_queue), f"{block} queue membership is wrong"
        for value, block in self.cached.items():
            assert block.block_hash is not None and block.block_hash.value == value, f"stale cache entry {block}"


class HostBlockPool:
    """The host (swap) pool: plain block ids, no sharing, no caching."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} host blocks with {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"double free of host block {i}")
            self._used.remove(i)
            self._free.append(i)

    def check_invariants(self) -> None:
        assert len(self._free) + len(self._used) == self.num_blocks, "host blocks lost or duplicated"
        assert not self._used.intersection(self._free), "a host block is both free and used"
