"""Per-request block tables on top of the pools: allocate, share by prefix, free, swap.

Constructible from plain numbers (no model, no tensors): the scheduler's tests and the stateful
refcount machine drive it directly. It decides *which* blocks move; the KV tensors themselves
are copied by :mod:`reference_engine.kv_cache` from the mappings it returns.

Slot arithmetic for a request with ``block_size = 4`` and 10 tokens, 6 computed::

    token index   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block table   [  b7   |   b2    |   b9   ]      ceil(10 / 4) = 3 blocks
    computed      x x x x | x x . . | . .           full computed blocks: 6 // 4 = 1 -> b7 hashed
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from reference_engine.block_pool import BlockHash, BlockPool, HostBlockPool, KVBlock
from reference_engine.engine_counters import EngineCounters
from reference_engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, enable_caching: bool = False,
                 counters: EngineCounters | None = None):
        """``counters``: the engine's record, shared with the pool and the scheduler (a fresh one if None);
        the block manager counts prefix-cache queries and hits in it, the pool evictions."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.counters = counters if counters is not None else EngineCounters()
        self.pool = BlockPool(num_gpu_blocks, enable_caching, self.counters)
        self.host = HostBlockPool(num_cpu_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        self.host_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # per request, full blocks, stable as tokens only append
        self._num_registered: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cpu_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.host.num_free

    def blocks_of(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, [])]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks (prompt and output tokens alike)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent, block = hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]
            # an unsalted request hashes as it always did; a salt (vLLM's cache_salt) joins the first block's hash
            hashes.append(BlockHash.of(parent, block) if request.cache_salt is None
                          else BlockHash.of(parent, block, request.cache_salt))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching the request's leading full blocks.

        Never the whole sequence: the last token is always computed, because its logits are
        needed to sample the next token. A pure query: the caller counts it with
        :meth:`record_prefix_query` once, when it admits the request (a lookup may be retried many times).
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one admission's lookup, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""
        self.counters.prefix_cache_queries += num_tokens
        self.counters.prefix_cache_hits += hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of blocks whose KV is now fully computed. Call after the model ran."""
        if not self.enable_caching:
            return
        table = self.block_tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for i in range(start, num_full):
            self.pool.register(table[i], hashes[i])
        self._num_registered[request.request_id] = num_full

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Make the table cover ``num_computed + len(new_computed_blocks) * block_size + num_new_tokens``
        tokens. Returns False, changing nothing, when the pool cannot supply the blocks.

        ``new_computed_blocks`` are prefix hits for a request being admitted; they are shared,
        not copied, and the caller advances ``num_computed_tokens`` past them.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        if not new_computed_blocks and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # the table already covers them: most decode steps (a new block every block_size tokens)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        # Hits on cached-but-unreferenced blocks take them out of the free queue too.
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free - reclaimed:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        """Release the request's device blocks (tail first, so its last blocks are evicted first)."""
        table = self.block_tables.pop(request_id, [])
        self.pool.free(reversed(table))
        self._num_registered.pop(request_id, None)

    def free_host(self, request_id: str) -> None:
        self.host.free(self.host_tables.pop(request_id, []))

    def forget(self, request_id: str) -> None:
        """Drop everything about a finished request."""
        self.free(request_id)
        self.free_host(request_id)
        self._hashes.pop(request_id, None)

    def tracked_request_ids(self) -> set[str]:
        """Requests the manager holds any per-request state for (tables, hashes, registration marks).
        Empty once every request has been forgotten: nothing kept per request outlives it."""
        return set(self.block_tables) | set(self.host_tables) | set(self._hashes) | set(self._num_registered)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request_id: str) -> bool:
        return len(self.block_tables.get(request_id, [])) <= self.host.num_free

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool. Returns (device id, host id) pairs to copy,
        which must be copied before any freed device block is written again."""
        table = self.block_tables[request_id]
        host_ids = self.host.allocate(len(table))
        self.host_tables[request_id] = host_ids
        mapping = [(b.block_id, h) for b, h in zip(table, host_ids, strict=True)]
        self.free(request_id)
        return mapping

    def can_swap_in(self, request_id: str, extra_blocks: int = 0) -> bool:
        return len(self.host_tables.get(request_id, [])) + extra_blocks <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back. Returns (host id, device id) pairs to copy."""
        host_ids = self.host_tables.pop(request.request_id)
        blocks = self.pool.allocate(len(host_ids))
        self.block_tables[request.request_id] = blocks
        mapping = [(h, b.block_id) for h, b in zip(host_ids, blocks, strict=True)]
        self.host.free(host_ids)
        # The KV is computed: its full blocks may serve prefix hits again (after the copy lands).
        self._num_registered[request.request_id] = 0
        self.cache_full_blocks(request)
        return mapping

    # ------------------------------------------------------------------ self-check
    def check_invariants(self) -> None:
        """Raise AssertionError if any block is leaked, double-held, wrongly shared or stale.

        * device: refcount == number of block-table entries holding it; free + held == total;
        * a block appears at most once in one request's table;
        * host: each id held by at most one request, free + held == total;
        * no request holds both device and host blocks.
        """
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for rid, table in self.block_tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
            holders.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block} has refcount {block.ref_cnt} but {holders.get(block.block_id, 0)} holders")
        held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert held + self.pool.num_free == self.pool.num_blocks, "device blocks lost"
        self.host.check_invariants()
        host_ids = [h for ids in self.host_tables.values() for h in ids]
        assert len(set(host_ids)) == len(host_ids), "a host block is held twice"
        assert len(host_ids) == self.host.num_blocks - self.host.num_free, "host blocks lost"
        both = set(self.host_tables).intersection(self.block_tables)
        assert not both, f"requests hold device and host blocks at once: {sorted(both)}"

    def is_whole(self) -> bool:
        """True when no request holds anything: every block is back in its pool."""
        return (not self.block_tables and not self.host_tables
                and self.pool.num_free == self.pool.num_blocks and self.host.num_free == self.host.num_blocks)
