"""KV pressure stated in tokens, and each engine's terms for it.

A check or scenario says how much KV its workload gets as a :class:`KVBudget` in tokens, relative to the
workload itself ("the pool holds the largest request alone, not a third of all of them"). An engine
declares what pools it accepts as a :class:`KVLayout` (the block sizes it takes, whether its pool must
hold ``max_model_len``, the head sizes its attention kernels take), and :func:`pool_knobs` turns the one
into the other. So a check means the same pressure on every engine: on the reference engine (any block
size; 16 preferred) the pressured conformance pool is 24 blocks of 16, on vLLM's CPU build (multiples of
32) 12 blocks of 32: the same 384 tokens.

A slot-based cache (llama.cpp's server) has no blocks: its KV cells hold one token each, so its block size
is 1 and its pool is a number of tokens (``-c``), which the engine rounds up (llama.cpp: to a multiple of
256). Its slots either draw on one pool (unified KV) or each own an equal share of it (``slots="per_slot"``):
then each share must hold the largest request, and the pool is sized so that it does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvbench.core.knobs import Knobs


@dataclass(frozen=True)
class KVLayout:
    """What KV pools an engine accepts.

    ``block_multiple``: block sizes must be multiples of this (vLLM's CPU attention: 32; 1: any).
    ``preferred_block_size``: the size used when a check does not insist (rounded up to the multiple).
    ``pool_holds_max_model_len``: the engine refuses to start with a pool smaller than ``max_model_len``
    (vLLM), so a pool is given together with the ``max_model_len`` its workload needs.
    ``head_sizes``: head sizes its attention takes (None: any).
    ``only_block_size``: the one block size the engine has, whatever a check asks (a slot-based cache of
    one-token cells: 1); None: sizes as ``block_multiple`` says.
    ``pool_multiple``: the engine rounds its pool up to a multiple of this many tokens (llama.cpp pads its
    context to 256), so a pool is asked for in those steps and is what the engine really runs.
    ``slots``: None for a paged pool shared block by block; ``"unified"``: slots draw on one pool of tokens;
    ``"per_slot"``: the pool is split evenly among ``default_slots`` slots, each padded to ``pool_multiple``.
    """

    block_multiple: int = 1
    preferred_block_size: int = 16
    pool_holds_max_model_len: bool = False
    head_sizes: frozenset[int] | None = None
    only_block_size: int | None = None
    pool_multiple: int = 1
    slots: str | None = None
    default_slots: int | None = None

    def __post_init__(self) -> None:
        if self.slots not in (None, "unified", "per_slot"):
            raise ValueError(f"KVLayout.slots must be None, 'unified' or 'per_slot', got {self.slots!r}")
        if self.slots == "per_slot" and not self.default_slots:
            raise ValueError("KVLayout.slots='per_slot' needs default_slots: the pool is split among them")
        if self.pool_multiple < 1:
            raise ValueError(f"KVLayout.pool_multiple must be >= 1, got {self.pool_multiple}")

    def block_size(self, wanted: int | None = None) -> int:
        """``wanted`` (or the preferred size) rounded up to a size this engine takes."""
        if self.only_block_size is not None:
            return self.only_block_size
        size = wanted or self.preferred_block_size
        return max(self.block_multiple, math.ceil(size / self.block_multiple) * self.block_multiple)

    def takes_block_size(self, size: int) -> bool:
        if self.only_block_size is not None:
            return size == self.only_block_size
        return size > 0 and size % self.block_multiple == 0

    def pool_tokens(self, tokens: int, largest: int) -> int:
        """The pool, in tokens, that gives at least ``tokens`` and that this engine runs as asked: rounded up to
        ``pool_multiple``; for per-slot pools, each slot's share at least ``largest``, in whole multiples."""
        step = self.pool_multiple
        if self.slots == "per_slot":
            assert self.default_slots
            share = max(math.ceil(tokens / self.default_slots), largest)
            return self.default_slots * math.ceil(share / step) * step
        return math.ceil(max(tokens, largest) / step) * step

    def takes_head_size(self, size: int) -> bool:
        return self.head_sizes is None or size in self.head_sizes


#: an engine that takes any block size (the reference engine, transformers' continuous batching)
ANY_LAYOUT = KVLayout()


@dataclass(frozen=True)
class KVBudget:
    """A KV pool in tokens: ``tokens`` slots, for a workload whose largest request needs ``largest`` alone.

    The pool is never smaller than the largest request (in whole blocks), so every request can run.
    """

    tokens: int
    largest: int
    #: the pool must hold every request at once (an unpressured run), not only the largest
    holds_all: bool = False
    #: any pool within a factor of two of ``tokens`` (and holding ``largest``) puts the workload under the pressure
    #: it is meant for: an engine whose every launch is a fresh start may round it to a pool other runs share
    #: (:func:`shared_pool`)
    roundable: bool = False
    #: the pool must hold ``tokens`` at once besides any block the engine keeps back (a run that sends all its
    #: requests together and must not preempt): a :attr:`roundable` budget is then rounded up, never down
    #: (:func:`shared_pool`)
    all_at_once: bool = False

    def __post_init__(self) -> None:
        if self.largest < 1 or self.tokens < 1:
            raise ValueError(f"a KV budget needs tokens >= 1 and largest >= 1, got {self}")


def request_tokens(prompt_len: int, max_tokens: int) -> int:
    """The KV slots one request needs at its end: its prompt and all but the last output token (the last
    sampled token is never fed back, but engines reserve it; count it, as vLLM's max_model_len does)."""
    return prompt_len + max_tokens


def pressured(needs: Iterable[int], factor: float = 2.0) -> KVBudget:
    """A pool that holds the largest request alone (``factor`` times it) but far from all of them at once.

    ``needs`` are the requests' token needs (:func:`request_tokens`)."""
    largest = max(needs, default=1)
    return KVBudget(tokens=math.ceil(factor * largest), largest=largest)


def shared_pool(budget: KVBudget, layout: KVLayout, block_size: int | None = None,
                max_len: int | None = None) -> KVBudget:
    """A :attr:`~KVBudget.roundable` budget rounded to the nearest whole power of two of blocks (within a factor
    of sqrt(2) of the pool asked: the pressure it was meant to have, give or take), never below what holds the
    largest request; where the engine's pool must hold ``max_model_len``, ``largest`` raised to all the pool
    lets a request have (at most ``max_len``, the model's positions), so that ``max_model_len`` depends on the
    pool alone. Checks whose workloads differ then share one launch of an engine that starts afresh for every
    knob set (vLLM: half a minute a start on two cores), instead of each starting its own.

    Other budgets are returned unchanged."""
    if not budget.roundable or budget.holds_all:
        return budget
    size = layout.block_size(block_size)
    held_back = 1 if layout.pool_holds_max_model_len else 0
    least = math.ceil(budget.largest / size) + held_back
    if budget.all_at_once:  # all of it at once, and the block the engine keeps back besides
        blocks = max(least, 2 ** math.ceil(math.log2(max(1.0, math.ceil(budget.tokens / size) + held_back))))
    else:
        blocks = max(least, 2 ** round(math.log2(max(1.0, budget.tokens / size))))
    if layout.slots is not None or layout.pool_multiple > 1:  # a cache of cells: its own steps round it already
        return budget
    largest = budget.largest
    if layout.pool_holds_max_model_len:
        largest = max(largest, min((blocks - held_back) * size, max_len or (blocks - held_back) * size))
    return KVBudget(tokens=blocks * size, largest=largest)


def together(needs: Iterable[int], block_size: int) -> KVBudget:
    """A pool that holds every request at once, each in whole blocks of ``block_size``, and no more: a run that
    sends all its requests together and must preempt none (what :func:`roomy` gives with room to spare). Where
    every launch is a fresh start it is rounded up to a pool other checks share (:attr:`KVBudget.all_at_once`)."""
    needs = list(needs) or [1]
    tokens = sum(math.ceil(n / block_size) * block_size for n in needs)
    return KVBudget(tokens=tokens, largest=max(needs), roundable=True, all_at_once=True)


def roomy(needs: Iterable[int]) -> KVBudget:
    """A pool that holds every request at once with room to spare: nothing is ever preempted."""
    needs = list(needs)
    return KVBudget(tokens=max(1, 4 * sum(needs) + 64 * len(needs)), largest=max(needs, default=1), holds_all=True)


def pool_knobs(budget: KVBudget, layout: KVLayout = ANY_LAYOUT, block_size: int | None = None) -> Knobs:
    """``budget`` in an engine's terms: block size, pool in blocks and, where the engine needs it,
    ``max_model_len`` (the largest request rounded up to a block, never more than the pool holds).

    ``block_size`` asks for a size (rounded up to one the engine takes)."""
    size = layout.block_size(block_size)
    largest_blocks = math.ceil(budget.largest / size)
    # an engine whose pool must hold max_model_len keeps one block out of every request's reach (vLLM's null
    # block) and refuses to start when the rest cannot hold max_model_len: a pool sized by its largest request
    # gets that block on top
    held_back = 1 if layout.pool_holds_max_model_len else 0
    blocks = max(math.ceil(budget.tokens / size) + (held_back if budget.all_at_once else 0), largest_blocks + held_back)
    if layout.slots is not None or layout.pool_multiple > 1:
        blocks = math.ceil(layout.pool_tokens(blocks * size, budget.largest) / size)
    knobs = Knobs(block_size=size, num_gpu_blocks=blocks)
    if layout.slots == "per_slot":  # the share each slot gets depends on how many there are: say it
        knobs = knobs.merged(Knobs(max_num_seqs=layout.default_slots))
    if layout.pool_holds_max_model_len:
        knobs = knobs.merged(Knobs(max_model_len=largest_blocks * size))
    return knobs


def in_engine_terms(knobs: Knobs, layout: KVLayout, needs: Iterable[int]) -> Knobs:
    """Knobs written in one engine's terms (block size, pools in blocks) restated for ``layout`` with the same
    pools in tokens: a scenario that gives the reference engine 128 blocks of 16 gives vLLM's CPU build 64
    blocks of 32, and ``max_model_len`` where that engine needs it (the largest of ``needs``, in whole blocks).

    Unchanged when the engine takes the block size and has no start-up constraint, or when no pool is set."""
    if knobs.block_size is None or knobs.num_gpu_blocks is None:
        return knobs
    if layout.takes_block_size(knobs.block_size) and not layout.pool_holds_max_model_len:
        return knobs
    needs = list(needs)
    size = layout.block_size(knobs.block_size)
    budget = KVBudget(tokens=knobs.num_gpu_blocks * knobs.block_size, largest=max(needs) if needs else 1)
    pool = pool_knobs(budget, layout, size)
    if knobs.max_model_len is not None:  # the scenario's own cap wins where it set one
        pool = Knobs(block_size=pool.block_size, num_gpu_blocks=max(pool.num_gpu_blocks or 0,
                                                                    math.ceil(knobs.max_model_len / size)),
                     max_model_len=knobs.max_model_len if layout.pool_holds_max_model_len else None)
    cpu = None if knobs.num_cpu_blocks is None else math.ceil(knobs.num_cpu_blocks * knobs.block_size / size)
    return knobs.merged(pool).merged(Knobs(num_cpu_blocks=cpu))
