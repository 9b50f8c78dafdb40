"""Refcount safety as a hypothesis state machine (conformance check 5), shipped for any engine.

The machine drives a paged-KV block manager through everything a scheduler does to it (admit with
a prefix hit, allocate chunk by chunk, compute, decode, share a prefix, finish, preempt by
recompute, preempt by swap, swap in, evict) and mirrors every step onto a plain-Python model of
what each request must hold. After every step it checks the engine's own ``check_invariants()``
and that engine and model agree; at teardown it frees everything and asserts the pool is whole.

An engine takes part through :class:`BlockManagerUnderTest`, a small adapter protocol keyed by
request id (the engine keeps its own request objects). :class:`ReferenceBlockManager` adapts
``reference_engine``'s block manager (``kvbench.engines.inprocess.reference_blocks``, the only place that touches
``reference_engine``, lazily, so other engines need not install it)::

    from kvbench.conformance.stateful import make_state_machine, machine_settings
    from kvbench.engines.inprocess.reference_blocks import reference_block_manager

    Machine = make_state_machine(reference_block_manager(num_gpu_blocks=12, block_size=4))
    TestReferenceBlocks = Machine.TestCase
    TestReferenceBlocks.settings = machine_settings()   # 200 examples; HYPOTHESIS_PROFILE=kvbench-deep for more

What the model knows, and so checks, for any engine:

* each request's block count (``ceil(tokens allocated / block_size)``) and exact block ids: ids
  the engine hands out fresh must be free (held by nobody), ids it keeps must not change;
* which requests are waiting (no blocks), running (device blocks only), swapped (host blocks only),
  and the swap mappings: device ids out are the request's table, host ids in are its host table;
* free device blocks == total - distinct blocks held (cached-but-unreferenced blocks are free),
  free host blocks == total - host blocks held; ``allocate_slots`` / admission succeed exactly
  when that many free blocks exist, and change nothing when they do not;
* prefix hits are sound and bounded. Sound: a hit block holds the computed KV of exactly that
  chained prefix, and only computed blocks can hit. Bounded above: never the whole sequence (the
  last token is always computed). Bounded below: a full block becomes cached when the compute that
  completes it finishes, unless that content is already cached (first copy wins), and stays a hit
  until its block is handed out again (the design's LRU contract: cached blocks survive until
  their space is needed). So a block that must be shared is shared;
* two requests holding one block hold it at the same position with the same token prefix.

The model does not predict *which* free block the engine hands out (that is eviction policy, which
``tests/engine/test_block_manager.py`` pins down exactly for the reference engine); it learns each id from
the engine and then holds the engine to it.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbench.core.block_introspection import BlockManagerUnderTest

__all__ = [
    "PROFILES",
    "BlockManagerMachine",
    "BlockManagerUnderTest",
    "machine_settings",
    "make_state_machine",
    "register_profiles",
]


# ---------------------------------------------------------------------------- settings
PROFILES: dict[str, dict[str, Any]] = {
    # CI: 200 runs of up to 30 steps, seconds on one core (hypothesis's own overhead dominates;
    # docs/journal/measurements.md#the-refcount-state-machines-ci-profile).
    "kvbench-ci": {"max_examples": 200, "stateful_step_count": 30, "deadline": None},
    # Before a release or after touching the block manager: minutes, longer runs.
    "kvbench-deep": {"max_examples": 5000, "stateful_step_count": 100, "deadline": None},
}
_SUPPRESSED = (HealthCheck.too_slow, HealthCheck.filter_too_much)


def register_profiles() -> None:
    """Register the ``kvbench-ci`` and ``kvbench-deep`` hypothesis profiles (call from a conftest
    so that ``pytest --hypothesis-profile=kvbench-deep`` works). Idempotent."""
    for name, values in PROFILES.items():
        settings.register_profile(name, suppress_health_check=_SUPPRESSED, **values)


def machine_settings(profile: str | None = None, **overrides: Any) -> settings:
    """Settings for the machine: the named kvbench profile, else the one named by the
    ``HYPOTHESIS_PROFILE`` environment variable when it is a kvbench profile, else ``kvbench-ci``.

    ``HYPOTHESIS_PROFILE=kvbench-deep pytest tests/kvbench/test_stateful.py`` runs thousands of examples.
    """
    name = profile or os.environ.get("HYPOTHESIS_PROFILE", "")
    if name not in PROFILES:
        if profile is not None:
            raise ValueError(f"profile={profile!r} is unknown: expected one of {sorted(PROFILES)}")
        name = "kvbench-ci"
    return settings(suppress_health_check=_SUPPRESSED, **{**PROFILES[name], **overrides})


# ---------------------------------------------------------------------------- the model
WAITING, RUNNING, SWAPPED = "waiting", "running", "swapped"
MAX_LIVE_REQUESTS = 6
ALPHABET_SIZE = 4  # small, so that suffixes and outputs collide into extra prefix hits
# Rule arguments are drawn up front from fixed strategies and fitted to the state by modulo
# (``pick % len(candidates)``): drawing them inside rules with ``st.data()`` tripled the run time.
# All shrink towards 0: the first candidate, one token, the whole sequence.
PICK = st.integers(0, 63)
SUFFIX_LEN = st.integers(0, 63)
SUFFIX_DIGITS = st.integers(0, 2**64 - 1)  # base-ALPHABET_SIZE digits of a suffix
TOKEN = st.integers(0, ALPHABET_SIZE - 1)
NUM_FAMILIES = 3  # shared "system prompts"; requests start with 0-3 of a family's blocks
FAMILY_BLOCKS = 3
FRESH_TOKEN_BASE = 1000  # tokens no other request uses: content that can never hit
ALL_TOKENS = 1 << 30  # an admission chunk that covers the whole remaining sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ModelRequest:
    """What one request must hold, as the model sees it."""

    tokens: list[int]
    state: str = WAITING
    num_computed: int = 0
    num_scheduled: int = 0  # allocated for but not yet computed
    num_registered: int = 0  # leading full blocks whose registration has been considered
    table: list[int] = field(default_factory=list)  # device block ids, learned from the engine
    host: list[int] = field(default_factory=list)  # host block ids, learned from the engine


class BlockManagerMachine(RuleBasedStateMachine):
    """Rules over a :class:`BlockManagerUnderTest` and its plain-Python model.

    Use :func:`make_state_machine` to bind it to an engine; this class has no factory.
    """

    factory: Callable[[], BlockManagerUnderTest] | None = None

    def __init__(self) -> None:
        super().__init__()
        if self.factory is None:
            raise TypeError("BlockManagerMachine has no factory: build one with make_state_machine(factory)")
        self.bm = type(self).factory()  # a plain function stored on the class, not a method
        self._exception_outside = sys.exc_info()[1]  # see teardown
        self.bs = self.bm.block_size
        self.requests: dict[str, ModelRequest] = {}
        # Cached content: chained prefix -> the block that must serve hits for it ("first copy wins").
        self.canonical: dict[tuple[int, ...], int] = {}
        # Every block holding computed KV of a full block: block id -> its chained prefix.
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0
        self.next_fresh_token = FRESH_TOKEN_BASE
        self.families = [[10 * (f + 1) + i % 3 for i in range(FAMILY_BLOCKS * self.bs)] for f in range(NUM_FAMILIES)]

    # ------------------------------------------------------------------ model helpers
    def _ids(self, state: str) -> list[str]:
        return sorted((rid for rid, r in self.requests.items() if r.state == state), key=lambda s: int(s[1:]))

    def _refs(self) -> Counter[int]:
        return Counter(b for r in self.requests.values() for b in r.table)

    def _free_gpu(self) -> int:
        return self.bm.num_gpu_blocks - len(self._refs())

    def _free_cpu(self) -> int:
        return self.bm.num_cpu_blocks - sum(len(r.host) for r in self.requests.values())

    def _key(self, r: ModelRequest, i: int) -> tuple[int, ...]:
        """The chained identity of block ``i``: every token up to its end."""
        return tuple(r.tokens[: (i + 1) * self.bs])

    @staticmethod
    def _suffix(length: int, digits: int, min_len: int, max_len: int) -> list[int]:
        """``min_len..max_len`` alphabet tokens (by ``length``), read off ``digits`` in base ``ALPHABET_SIZE``."""
        n = min_len + length % (max_len - min_len + 1)
        return [(digits // ALPHABET_SIZE**i) % ALPHABET_SIZE for i in range(n)]

    @staticmethod
    def _pick(candidates: list[str], pick: int) -> str:
        return candidates[pick % len(candidates)]

    def _new_request(self, prompt: list[int]) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = ModelRequest(tokens=list(prompt))
        self.bm.add_request(rid, prompt)
        note(f"add {rid}: {len(prompt)} tokens {prompt}")
        return rid

    def _take_fresh(self, ids: Sequence[int], what: str) -> None:
        """The engine handed out ``ids`` as new blocks: they must have been free; their old content is gone."""
        refs = self._refs()
        assert len(set(ids)) == len(ids), f"{what}: the same block handed out twice in {list(ids)}"
        for b in ids:
            assert 0 <= b < self.bm.num_gpu_blocks, f"{what}: block id {b} is out of range"
            assert refs[b] == 0, f"{what}: block {b} handed out while held by {self._holders(b)}"
            old = self.content.pop(b, None)
            if old is not None and self.canonical.get(old) == b:
                del self.canonical[old]
                event("a cached block was evicted")

    def _holders(self, block: int) -> list[str]:
        return [rid for rid, r in self.requests.items() if block in r.table]

    def _register(self, r: ModelRequest) -> None:
        """After compute: full computed blocks not yet considered hold their content, and become
        the cached copy unless that content is already cached."""
        num_full = min(r.num_computed // self.bs, len(r.table))
        for i in range(r.num_registered, num_full):
            key = self._key(r, i)
            self.content[r.table[i]] = key
            if self.bm.prefix_caching and key not in self.canonical:
                self.canonical[key] = r.table[i]
        r.num_registered = max(r.num_registered, num_full)

    def _check_hits(self, rid: str, hits: list[int]) -> None:
        """Hits are a sound prefix, never the whole sequence, and include every block that must hit."""
        r = self.requests[rid]
        cap = (len(r.tokens) - 1) // self.bs if self.bm.prefix_caching else 0
        must = 0
        while must < cap and self._key(r, must) in self.canonical:
            must += 1
        present = set(self.content.values())
        may = 0
        while may < cap and self._key(r, may) in present:
            may += 1
        for i, b in enumerate(hits):
            assert self.content.get(b) == self._key(r, i), (
                f"{rid}: hit {i} is block {b}, which does not hold the computed KV of that prefix "
                f"(it holds {self.content.get(b)!r})")
        assert len(hits) <= cap, (
            f"{rid}: {len(hits)} hit blocks for {len(r.tokens)} tokens: the last token must be computed")
        assert must <= len(hits) <= may, (
            f"{rid}: {len(hits)} hit blocks, expected between {must} (cached) and {may} (computed somewhere)")

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.requests) < MAX_LIVE_REQUESTS)
    @rule(family=st.integers(0, NUM_FAMILIES - 1), shared=st.integers(0, FAMILY_BLOCKS),
          suffix_len=SUFFIX_LEN, suffix_digits=SUFFIX_DIGITS)
    def add_request(self, family: int, shared: int, suffix_len: int, suffix_digits: int) -> None:
        """A prompt of 0-3 blocks of a shared "system prompt", then 1 to 2 blocks' worth of tokens."""
        suffix = self._suffix(suffix_len, suffix_digits, 1, 2 * self.bs)
        self._new_request(self.families[family][: shared * self.bs] + suffix)

    @precondition(lambda self: any(r.state == WAITING for r in self.requests.values()))
    @rule(pick=PICK, chunk=st.integers(0, 63))
    def admit(self, pick: int, chunk: int) -> None:
        """Admit a waiting request with its prefix hits: whole (chunk 0) or a chunked prefill."""
        self._admit(self._pick(self._ids(WAITING), pick), 1 + (chunk - 1) % (2 * self.bs) if chunk else ALL_TOKENS)

    def _admit(self, rid: str, max_new: int) -> bool:
        r = self.requests[rid]
        free_before, refs = self._free_gpu(), self._refs()
        hits, ok = self.bm.admit(rid, max_new)
        note(f"admit {rid} ({'whole' if max_new == ALL_TOKENS else f'chunk of {max_new}'}): hits {hits}, admitted={ok}")
        self._check_hits(rid, hits)
        cached = len(hits) * self.bs
        num_new = min(len(r.tokens) - cached, max_new)
        needed = cdiv(cached + num_new, self.bs) - len(hits)
        reclaimed = sum(1 for b in hits if refs[b] == 0)  # cached-but-free hits leave the free pool too
        expected = needed <= free_before - reclaimed
        assert ok == expected, (
            f"admit {rid}: engine said {ok}, model expected {expected} "
            f"({needed} new blocks, {free_before} free of which {reclaimed} are hits)")
        if not ok:
            event("admission refused: pool short")
            return False
        table = self.bm.block_table(rid)
        assert table[: len(hits)] == hits, f"admit {rid}: table {table} does not start with its hits {hits}"
        assert len(table) == len(hits) + needed, f"admit {rid}: {len(table)} blocks, expected {len(hits) + needed}"
        self._take_fresh(table[len(hits):], f"admit {rid}")
        r.table, r.state = table, RUNNING
        r.num_computed, r.num_scheduled, r.num_registered = cached, num_new, 0
        if hits:
            event("admission with a prefix hit")
        return True

    @precondition(lambda self: any(r.state == RUNNING and r.num_scheduled == 0 for r in self.requests.values()))
    @rule(pick=PICK, chunk=st.integers(0, 63))
    def allocate_slots(self, pick: int, chunk: int) -> None:
        """Schedule the next chunk (a decode, or the rest of a chunked prefill)."""
        rid = self._pick([i for i in self._ids(RUNNING) if self.requests[i].num_scheduled == 0], pick)
        r = self.requests[rid]
        n = min(len(r.tokens) - r.num_computed, 1 + chunk % (2 * self.bs))
        needed = max(0, cdiv(r.num_computed + n, self.bs) - len(r.table))
        expected = needed <= self._free_gpu()
        ok = self.bm.allocate_slots(rid, n)
        note(f"allocate_slots {rid} +{n} tokens: {ok}")
        assert ok == expected, f"allocate_slots {rid}: engine said {ok}, model expected {expected} ({needed} needed)"
        table = self.bm.block_table(rid)
        if not ok:
            event("allocate_slots refused: pool short")
            assert table == r.table, f"allocate_slots {rid} failed but changed the table {r.table} -> {table}"
            return
        assert table[: len(r.table)] == r.table, f"allocate_slots {rid} changed held blocks {r.table} -> {table}"
        assert len(table) == len(r.table) + needed, (
            f"allocate_slots {rid}: {len(table)} blocks, expected {len(r.table) + needed}")
        self._take_fresh(table[len(r.table):], f"allocate_slots {rid}")
        r.table, r.num_scheduled = table, n

    @precondition(lambda self: any(r.state == RUNNING and r.num_scheduled > 0 for r in self.requests.values()))
    @rule(pick=PICK, token=TOKEN)
    def compute(self, pick: int, token: int) -> None:
        """The model ran over a scheduled chunk; when it reached the end, ``token`` is sampled."""
        rid = self._pick([i for i in self._ids(RUNNING) if self.requests[i].num_scheduled > 0], pick)
        r = self.requests[rid]
        n, r.num_scheduled = r.num_scheduled, 0
        self.bm.compute(rid, n)
        r.num_computed += n
        self._register(r)
        note(f"compute {rid} {n} tokens -> {r.num_computed}/{len(r.tokens)}")
        if r.num_computed == len(r.tokens):
            self.bm.append_token(rid, token)
            r.tokens.append(token)

    @precondition(lambda self: len(self.requests) < MAX_LIVE_REQUESTS
                  and any(r.state == RUNNING and r.num_computed >= self.bs for r in self.requests.values()))
    @rule(pick=PICK, blocks=st.integers(0, 63), suffix_len=SUFFIX_LEN, suffix_digits=SUFFIX_DIGITS)
    def share_prefix(self, pick: int, blocks: int, suffix_len: int, suffix_digits: int) -> None:
        """A new request repeating the computed leading blocks of a running one must share them.

        The suffix may be empty: a prompt made only of cached blocks must still compute its last
        token, so it may hit all blocks but the last."""
        candidates = [i for i in self._ids(RUNNING) if self.requests[i].num_computed >= self.bs]
        source = self.requests[self._pick(candidates, pick)]
        k = 1 + blocks % (source.num_computed // self.bs)
        rid = self._new_request(source.tokens[: k * self.bs] + self._suffix(suffix_len, suffix_digits, 0, self.bs))
        self._admit(rid, ALL_TOKENS)

    @precondition(lambda self: bool(self.requests))
    @rule(pick=PICK)
    def finish(self, pick: int) -> None:
        """Finish or abort a request in any state."""
        rid = self._pick(sorted(self.requests, key=lambda s: int(s[1:])), pick)
        note(f"finish {rid} ({self.requests[rid].state})")
        self.bm.finish(rid)
        del self.requests[rid]

    @precondition(lambda self: any(r.state == RUNNING for r in self.requests.values()))
    @rule(pick=PICK)
    def preempt_recompute(self, pick: int) -> None:
        rid = self._pick(self._ids(RUNNING), pick)
        note(f"preempt {rid} by recompute")
        self.bm.preempt_recompute(rid)
        self._to_waiting(self.requests[rid])

    def _to_waiting(self, r: ModelRequest) -> None:
        r.table, r.state = [], WAITING
        r.num_computed = r.num_scheduled = r.num_registered = 0

    @precondition(lambda self: any(r.state == RUNNING for r in self.requests.values()))
    @rule(pick=PICK)
    def preempt_swap(self, pick: int) -> None:
        """Swap out when the host pool has room, else fall back to recompute (as the scheduler does)."""
        rid = self._pick(self._ids(RUNNING), pick)
        r = self.requests[rid]
        fits = len(r.table) <= self._free_cpu()
        assert self.bm.can_swap_out(rid) == fits, (
            f"can_swap_out {rid}: engine said {not fits}, {len(r.table)} blocks and {self._free_cpu()} host free")
        if not fits:
            note(f"preempt {rid}: host pool full, falls back to recompute")
            event("swap fell back to recompute")
            self.bm.preempt_recompute(rid)
            self._to_waiting(r)
            return
        held_host = {h for q in self.requests.values() for h in q.host}
        mapping = self.bm.swap_out(rid)
        note(f"swap out {rid}: {mapping}")
        assert [d for d, _ in mapping] == r.table, f"swap_out {rid}: copies {mapping}, but holds {r.table}"
        host = [h for _, h in mapping]
        assert len(set(host)) == len(host), f"swap_out {rid}: host block used twice in {mapping}"
        for h in host:
            assert 0 <= h < self.bm.num_cpu_blocks, f"swap_out {rid}: host id {h} is out of range"
            assert h not in held_host, f"swap_out {rid}: host block {h} is already held"
        r.host, r.table, r.state = host, [], SWAPPED
        r.num_scheduled = r.num_registered = 0  # the chunk in flight is dropped; computed tokens stay
        event("swapped out")

    @precondition(lambda self: any(r.state == SWAPPED for r in self.requests.values()))
    @rule(pick=PICK)
    def swap_in(self, pick: int) -> None:
        rid = self._pick(self._ids(SWAPPED), pick)
        r = self.requests[rid]
        fits = len(r.host) <= self._free_gpu()
        assert self.bm.can_swap_in(rid) == fits, (
            f"can_swap_in {rid}: engine said {not fits}, {len(r.host)} blocks and {self._free_gpu()} free")
        if not fits:
            note(f"swap in {rid}: device pool short, stays swapped")
            return
        mapping = self.bm.swap_in(rid)
        note(f"swap in {rid}: {mapping}")
        assert [h for h, _ in mapping] == r.host, f"swap_in {rid}: copies {mapping}, but host holds {r.host}"
        table = [d for _, d in mapping]
        self._take_fresh(table, f"swap_in {rid}")
        r.table, r.host, r.state = table, [], RUNNING
        # The copies hold computed KV again. Whether an engine re-offers them as cache entries is
        # its choice, so they count as content (hits allowed) but not as cached (hits not required).
        num_full = min(r.num_computed // self.bs, len(table))
        for i in range(num_full):
            self.content[table[i]] = self._key(r, i)
        r.num_registered = num_full
        event("swapped in")

    @precondition(lambda self: len(self.requests) < MAX_LIVE_REQUESTS and self._free_gpu() > 0
                  and any(self._refs()[b] == 0 for b in self.canonical.values()))
    @rule()
    def evict(self) -> None:
        """Allocate every free block to fresh content: all cached-but-unreferenced blocks are evicted."""
        n = self._free_gpu() * self.bs
        prompt = list(range(self.next_fresh_token, self.next_fresh_token + n))
        self.next_fresh_token += n
        rid = self._new_request(prompt)
        assert self._admit(rid, ALL_TOKENS), f"evict: {rid} needs exactly the free blocks, yet was refused"
        refs = self._refs()
        assert all(refs[b] > 0 for b in self.canonical.values()), "a free cached block survived a full pool"
        assert self.bm.num_free_gpu_blocks() == 0, "evict: the pool should be full"

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        """After every step: the engine's self-check, engine == model, sound sharing.

        One invariant calling three checks, not three invariants: hypothesis's per-invariant
        overhead was a fifth of the machine's run time."""
        self.bm.check_invariants()
        self.engine_agrees_with_model()
        self.shared_blocks_hold_the_same_prefix()

    def engine_agrees_with_model(self) -> None:
        for rid, r in self.requests.items():
            table, host = self.bm.block_table(rid), self.bm.host_table(rid)
            assert table == r.table, f"{rid} ({r.state}) holds {table}, model says {r.table}"
            assert host == r.host, f"{rid} ({r.state}) holds host {host}, model says {r.host}"
            if r.state == RUNNING:
                expected = cdiv(r.num_computed + r.num_scheduled, self.bs)
                assert len(table) >= expected, f"{rid}: {len(table)} blocks cannot hold {expected * self.bs} tokens"
                assert not host, f"running {rid} holds host blocks {host}"
            elif r.state == SWAPPED:
                assert not table and host, f"swapped {rid}: device {table}, host {host}"
            else:
                assert not table and not host, f"waiting {rid} holds blocks: device {table}, host {host}"
        free_gpu, free_cpu = self.bm.num_free_gpu_blocks(), self.bm.num_free_cpu_blocks()
        assert free_gpu == self._free_gpu(), f"{free_gpu} free device blocks, model says {self._free_gpu()}"
        assert free_cpu == self._free_cpu(), f"{free_cpu} free host blocks, model says {self._free_cpu()}"

    def shared_blocks_hold_the_same_prefix(self) -> None:
        positions: dict[int, list[tuple[str, int]]] = {}
        for rid, r in self.requests.items():
            for i, b in enumerate(r.table):
                positions.setdefault(b, []).append((rid, i))
        for b, holders in positions.items():
            if len(holders) < 2:
                continue
            rid0, i0 = holders[0]
            key = self._key(self.requests[rid0], i0)
            for rid, i in holders:
                r = self.requests[rid]
                assert i == i0 and self._key(r, i) == key, f"block {b} shared by different prefixes: {holders}"
                assert r.num_computed >= (i + 1) * self.bs, f"block {b} shared before {rid} computed it"

    def teardown(self) -> None:
        # teardown runs in a `finally`: when a step already failed, let that failure through
        # unmasked (an exception that was already being handled around the whole run is not ours).
        if sys.exc_info()[1] not in (None, self._exception_outside):
            return
        for rid in list(self.requests):
            self.bm.finish(rid)
            del self.requests[rid]
            self.bm.check_invariants()
        assert self.bm.num_free_gpu_blocks() == self.bm.num_gpu_blocks, "device blocks leaked after finishing all"
        assert self.bm.num_free_cpu_blocks() == self.bm.num_cpu_blocks, "host blocks leaked after finishing all"
        assert self.bm.is_whole(), "the pool is not whole after every request finished"


def make_state_machine(factory: Callable[[], BlockManagerUnderTest],
                       name: str = "BlockManagerStateMachine") -> type[BlockManagerMachine]:
    """A machine class bound to ``factory`` (called once per example for a fresh, empty manager).

    Run it with ``Machine.TestCase`` (unittest/pytest collection) or
    ``hypothesis.stateful.run_state_machine_as_test(Machine, settings=machine_settings())``.
    """
    return type(name, (BlockManagerMachine,), {"factory": staticmethod(factory), "__module__": __name__})
