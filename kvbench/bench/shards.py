"""Splitting one run's tests across machines by hand: ``--kvbench-shard I/N``.

Contract: every machine collects the same tests (same checkout, same options) and keeps the ones
:func:`in_shard` gives its shard. The split is round-robin over the *sorted* node ids, so it depends
on nothing but the ids (not on collection order, the machine, or a hash seed), every test lands in
exactly one of the N shards, and shard sizes differ by at most one. The ids are the ones pytest
collects, before pytest-xdist appends ``@group`` to grouped tests, so a shard run with ``-n`` and
one run serially agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


class ShardError(ValueError):
    """A malformed ``--kvbench-shard`` value."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def to_dict(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}


def parse_shard(text: str) -> Shard:
    """``"2/3"`` -> ``Shard(2, 3)``; raises :class:`ShardError` saying what a valid value looks like."""
    index, sep, count = str(text).partition("/")
    try:
        shard = Shard(int(index), int(count)) if sep else None
    except ValueError:
        shard = None
    if shard is None or shard.count < 1 or not 1 <= shard.index <= shard.count:
        raise ShardError(f"--kvbench-shard {text!r} is invalid: expected I/N with 1 <= I <= N, e.g. 1/2")
    return shard


def in_shard(nodeids: Iterable[str], shard: Shard, unit_of: Callable[[str], str] | None = None) -> set[str]:
    """The node ids of ``nodeids`` that belong to ``shard``: round-robin over the sorted *units*, where
    ``unit_of(nodeid)`` names the unit a test belongs to (default: itself). Tests of one unit always
    land in the same shard: the storm benchmarks use this to keep one scenario's engines together,
    since they are served side by side and their times are only comparable within one run."""
    ids = set(nodeids)
    unit = unit_of or (lambda nodeid: nodeid)
    ordered = sorted({unit(n) for n in ids})
    kept = {u for i, u in enumerate(ordered) if i % shard.count == shard.index - 1}
    return {n for n in ids if unit(n) in kept}
