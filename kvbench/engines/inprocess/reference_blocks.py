"""The reference engine's block manager behind the block-introspection protocol.

The reference adapter hands these to the refcount state machine (conformance check 5); tests
substitute deliberately broken managers through ``manager_cls``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any


class ReferenceBlockManager:
    """:class:`BlockManagerUnderTest` over ``reference_engine.block_manager.BlockManager``.

    ``manager_cls`` substitutes a subclass (the tests use deliberately broken ones to prove the
    machine finds bugs). ``reference_engine`` is imported here, lazily, and nowhere else in kvbench.
    """

    def __init__(self, num_gpu_blocks: int = 12, num_cpu_blocks: int = 6, block_size: int = 4,
                 enable_caching: bool = True, manager_cls: Callable[..., Any] | None = None):
        from reference_engine.block_manager import BlockManager
        from reference_engine.request import Request
        from reference_engine.sampling_params import SamplingParams

        self._make_request = partial(Request, sampling_params=SamplingParams(), arrival_time=0.0)
        self.manager = (manager_cls or BlockManager)(num_gpu_blocks, num_cpu_blocks, block_size,
                                                     enable_caching=enable_caching)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.prefix_caching = enable_caching
        self.requests: dict[str, Any] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.requests[request_id] = self._make_request(request_id=request_id, prompt_token_ids=list(prompt_token_ids))

    def admit(self, request_id: str, max_new_tokens: int) -> tuple[list[int], bool]:
        req = self.requests[request_id]
        hits = self.manager.find_cached_prefix(req)
        cached = len(hits) * self.block_size
        num_new = min(req.num_tokens - cached, max_new_tokens)
        if not self.manager.allocate_slots(req, num_new, hits):
            return [b.block_id for b in hits], False
        req.num_computed_tokens = cached
        return [b.block_id for b in hits], True

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        return self.manager.allocate_slots(self.requests[request_id], num_new_tokens)

    def compute(self, request_id: str, num_tokens: int) -> None:
        req = self.requests[request_id]
        req.num_computed_tokens += num_tokens
        self.manager.cache_full_blocks(req)

    def append_token(self, request_id: str, token_id: int) -> None:
        self.requests[request_id].output_token_ids.append(token_id)

    def preempt_recompute(self, request_id: str) -> None:
        self.manager.free(request_id)
        self.requests[request_id].num_computed_tokens = 0

    def can_swap_out(self, request_id: str) -> bool:
        return self.manager.can_swap_out(request_id)

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        return self.manager.swap_out(request_id)

    def can_swap_in(self, request_id: str) -> bool:
        return self.manager.can_swap_in(request_id)

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        return self.manager.swap_in(self.requests[request_id])

    def finish(self, request_id: str) -> None:
        self.manager.forget(request_id)
        del self.requests[request_id]

    def block_table(self, request_id: str) -> list[int]:
        return self.manager.blocks_of(request_id)

    def host_table(self, request_id: str) -> list[int]:
        return list(self.manager.host_tables.get(request_id, []))

    def num_free_gpu_blocks(self) -> int:
        return self.manager.num_free_gpu_blocks

    def num_free_cpu_blocks(self) -> int:
        return self.manager.num_free_cpu_blocks

    def check_invariants(self) -> None:
        self.manager.check_invariants()

    def is_whole(self) -> bool:
        return self.manager.is_whole()


def reference_block_manager(num_gpu_blocks: int = 12, num_cpu_blocks: int = 6, block_size: int = 4,
                            enable_caching: bool = True,
                            manager_cls: Callable[..., Any] | None = None) -> Callable[[], ReferenceBlockManager]:
    """A factory of fresh reference adapters. The defaults (12 device blocks of 4 tokens, 6 host
    blocks, prompts up to 5 blocks, up to 6 live requests) keep the pool under constant pressure."""
    return partial(ReferenceBlockManager, num_gpu_blocks, num_cpu_blocks, block_size, enable_caching, manager_cls)


