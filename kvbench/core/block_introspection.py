"""The block-introspection protocol: what an adapter with the ``block_introspection`` capability
hands the refcount state machine (``kvbench.conformance.stateful``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockManagerUnderTest(Protocol):
    """What the machine needs from an engine's block manager. Every call is keyed by request id.

    The adapter owns the engine's request objects: it tracks each request's tokens and its count
    of computed tokens exactly as the engine's scheduler would.
    """

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    prefix_caching: bool

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Create a waiting request (no blocks, nothing computed)."""

    def admit(self, request_id: str, max_new_tokens: int) -> tuple[list[int], bool]:
        """Admit a waiting request: look up its cached prefix (``h`` hit blocks, never the whole
        sequence), then give it blocks for ``h * block_size + min(remaining, max_new_tokens)``
        tokens, sharing the hits. On success its computed tokens become ``h * block_size``.
        Returns ``(hit block ids, admitted)``; when not admitted nothing changed."""

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        """Grow a running request's table to cover ``computed + num_new_tokens`` tokens.
        False, changing nothing, when the pool is short."""

    def compute(self, request_id: str, num_tokens: int) -> None:
        """The model ran over the next ``num_tokens`` tokens: advance computed tokens and
        register the blocks that are now full (after compute, never before)."""

    def append_token(self, request_id: str, token_id: int) -> None:
        """Append a sampled output token (no allocation: the next ``allocate_slots`` does that)."""

    def preempt_recompute(self, request_id: str) -> None:
        """Free a running request's device blocks and reset its computed tokens to zero."""

    def can_swap_out(self, request_id: str) -> bool:
        """True when the host pool has room for all of the request's device blocks."""

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move a running request's blocks to the host pool: ``(device id, host id)`` pairs in
        block-table order. Its computed tokens are kept."""

    def can_swap_in(self, request_id: str) -> bool:
        """True when the device pool has room for all of a swapped request's host blocks."""

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped request back: ``(host id, device id)`` pairs in block-table order."""

    def finish(self, request_id: str) -> None:
        """Drop the request in any state, freeing its device and host blocks."""

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block ids in order (empty when it holds none)."""

    def host_table(self, request_id: str) -> list[int]:
        """The request's host block ids in order (empty when it holds none)."""

    def num_free_gpu_blocks(self) -> int:
        """Device blocks that can be handed out, cached-but-unreferenced ones included."""

    def num_free_cpu_blocks(self) -> int:
        """Host blocks that can be handed out."""

    def check_invariants(self) -> None:
        """Raise AssertionError when the engine's own bookkeeping is inconsistent."""

    def is_whole(self) -> bool:
        """True when no request holds any block."""


