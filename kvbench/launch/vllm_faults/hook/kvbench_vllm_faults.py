"""Faults patched into a running vLLM V1, one function each, so that a test can show a kvbench check failing
on a real engine broken in exactly the way the check guards against.

This file runs inside vLLM's own environment (its processes import it through the ``sitecustomize.py``
beside it), so it imports nothing but the standard library at import time, and vLLM only when vLLM's own
modules load: never kvbench, never torch. kvbench reads the catalogue (:data:`FAULTS`) from the same file
(``kvbench.launch.vllm_faults``), so the names it validates are the names patched here.

How a fault reaches the engine: :func:`arm` puts an import hook first on ``sys.meta_path``. When a module
named by a fault is executed, the hook replaces the one function the fault names, right after the module's
own code has run and before anything else can use it. That holds in every process vLLM starts whatever
its start method: a spawned process runs ``sitecustomize`` (and so :func:`arm`) at start-up; a forked one
inherits the hook, and any module its parent had already patched. The API server, the EngineCore process
(where the scheduler and the KV-cache manager run) and the workers are all covered.

Every fault says what it did on the process's stderr, which is the server's log:

* ``kvbench-vllm-fault: NAME armed (pid P)``: the hook is in this process;
* ``kvbench-vllm-fault: NAME patched MODULE.QUALNAME (pid P)``: the function was replaced;
* ``kvbench-vllm-fault: NAME fired (pid P): DETAIL``: the fault changed what the engine did, said once per
  process (the proof that the run was broken, which a test must see before it judges a check).

Faults change the engine's own state or its own metrics; none touches what the API server sends back.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the environment variable naming the fault a launched vLLM runs with
FAULT_ENV = "KVBENCH_VLLM_FAULT"
#: how every line this module writes begins (tests search the server's log for it)
LOG_PREFIX = "kvbench-vllm-fault:"


@dataclass(frozen=True)
class VllmFault:
    """One fault: the function it replaces, what that breaks, and the kvbench check that guards it."""

    module: str  # the vLLM module holding the function
    qualname: str  # Class.method inside it
    breaks: str  # the property the fault breaks, as one sentence
    check: str  # the conformance check that must catch it


FAULTS: dict[str, VllmFault] = {
    "resume_keeps_computed_tokens": VllmFault(
        "vllm.v1.core.sched.scheduler", "Scheduler._preempt_request",
        "a request preempted by recompute keeps its num_computed_tokens: it resumes as if its KV were still there, "
        "over freshly allocated blocks that hold none of it",
        "recompute_preemption_equivalence"),
    "hit_takes_no_reference": VllmFault(
        "vllm.v1.core.block_pool", "BlockPool.touch",
        "a prefix-cache hit on a block another request holds takes no reference, so the block returns to the "
        "free queue when its first holder finishes and can be handed to a third request while the second still "
        "reads it (a release of a block without a reference is then let pass, keeping the pool's queue whole)",
        "prefix_caching_equivalence_and_hits"),
    "registers_block_under_wrong_hash": VllmFault(
        "vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
        "every full block is registered under the hash of the block before it (the first under none), so a "
        "later prefix hit serves the KV of the blocks that follow the prefix, not the prefix's own",
        "prefix_caching_equivalence_and_hits"),
    "eviction_keeps_hash": VllmFault(
        "vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block",
        "a cached block handed out again keeps its old hash registered, so a later hit on that hash serves "
        "whatever the block's new owner wrote",
        "recompute_preemption_equivalence"),
    "ignores_abort": VllmFault(
        "vllm.v1.core.sched.scheduler", "Scheduler.finish_requests",
        "an abort (a client closing its stream) is accepted and does nothing: the request runs to its end in the "
        "engine, holding its blocks",
        "an_abort_before_the_first_token_stops_the_request"),
    "preemptions_counted_twice": VllmFault(
        "vllm.v1.metrics.stats", "IterationStats.update_from_events",
        "each preemption is counted twice in vllm:num_preemptions_total (the per-request count, "
        "vllm:request_num_preemptions, once)",
        "counts_told_twice_agree"),
    "prefix_hits_counted_twice": VllmFault(
        "vllm.v1.core.kv_cache_manager", "KVCacheManager.record_prefix_cache_stats",
        "a request's prefix-cache hits at its first admission are counted twice in vllm:prefix_cache_hits_total "
        "(the queries once)",
        "prefix_caching_equivalence_and_hits"),
    "generation_tokens_overcounted": VllmFault(
        "vllm.v1.metrics.stats", "IterationStats.update_from_output",
        "each finished request adds one generated token more to vllm:generation_tokens_total than it generated",
        "counts_told_twice_agree"),
}

_fired: set[str] = set()


def _say(line: str) -> None:
    sys.stderr.write(f"{LOG_PREFIX} {line} (pid {os.getpid()})\n")
    sys.stderr.flush()


def fired(name: str, detail: str) -> None:
    """Say, once per process, that fault ``name`` changed what the engine did, and in which process
    (multiprocessing's name for it: vLLM calls its engine's ``EngineCore``, its front end ``MainProcess``)."""
    if name not in _fired:
        _fired.add(name)
        import multiprocessing

        sys.stderr.write(f"{LOG_PREFIX} {name} fired (pid {os.getpid()}, {multiprocessing.current_process().name}): "
                         f"{detail}\n")
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------------ the patches
# Each takes the original function and returns its replacement, with the same signature.

def _resume_keeps_computed_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        kept = request.num_computed_tokens
        result = original(self, request, *args, **kwargs)
        if kept:
            # the reset is undone: the scheduler will take the request back as if its KV were still computed
            request.num_computed_tokens = kept
            fired("resume_keeps_computed_tokens", f"{request.request_id} preempted keeping {kept} computed tokens")
        return result
    return _preempt_request


def _hit_takes_no_reference(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def touch(self: Any, blocks: Any) -> None:
        held = [b for b in blocks if b.ref_cnt > 0 and not b.is_null]
        original(self, [b for b in blocks if b.ref_cnt == 0 or b.is_null])
        if held:
            fired("hit_takes_no_reference", f"a hit on {len(held)} held blocks took no reference")
    return touch


def _free_without_reference(original: Callable[..., Any]) -> Callable[..., Any]:
    # the second half of hit_takes_no_reference: a holder whose hit took no reference releases a block that
    # is already back in the free queue; letting its count go below zero would corrupt the queue and crash
    # the engine, which would hide the wrong KV the fault is about
    @functools.wraps(original)
    def free_blocks(self: Any, ordered_blocks: Any) -> None:
        original(self, [b for b in ordered_blocks if b.ref_cnt > 0 or b.is_null])
    return free_blocks


def _registers_block_under_wrong_hash(original: Callable[..., Any]) -> Callable[..., Any]:
    # Shifted by one block, not permuted: a hit spanning a permutation of a prefix's own blocks would give
    # attention the same keys and values in another order (their positions are in the cached keys), which
    # changes nothing; shifted, a hit on a prefix serves the KV of the blocks after it.
    @functools.wraps(original)
    def cache_full_blocks(self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int,
                          block_size: int, kv_cache_group_id: int, block_mask: Any = None) -> None:
        hashes = request.block_hashes
        if num_full_blocks <= num_cached_blocks or block_size != self.hash_block_size \
                or len(hashes) < num_full_blocks:
            return original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                            block_mask)
        # block i goes under block i-1's hash; block 0, which has no block before it, under none
        request.block_hashes = [hashes[0], *hashes[:-1]]
        mask = list(block_mask) if block_mask is not None else [True] * (num_full_blocks - num_cached_blocks)
        if num_cached_blocks == 0:
            mask[0] = False
        try:
            original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, mask)
        finally:
            request.block_hashes = hashes  # the request itself keeps its true hashes (its lookups use them)
        if num_full_blocks >= 2:
            fired("registers_block_under_wrong_hash",
                  f"{request.request_id}: blocks {max(1, num_cached_blocks)}..{num_full_blocks - 1} registered "
                  "under their predecessors' hashes")
    return cache_full_blocks


def _eviction_keeps_hash(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
        if block.block_hash is None:
            return original(self, block)
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        # what the original does, less removing the block's hashes from cached_block_hash_to_block
        self.cached_block_hashes_by_block.pop(block.block_id, None)
        block.reset_hash()
        fired("eviction_keeps_hash", f"block {block.block_id} reused with its old hash still registered")
        return True
    return _maybe_evict_cached_block


def _ignores_abort(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        if getattr(finished_status, "name", "") == "FINISHED_ABORTED":
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            if ids:
                fired("ignores_abort", f"abort of {ids[:4]} ignored")
            return []
        return original(self, request_ids, finished_status)
    return finish_requests


def _preemptions_counted_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_from_events(self: Any, req_id: str, events: Any, *args: Any, **kwargs: Any) -> None:
        before = self.num_preempted_reqs
        original(self, req_id, events, *args, **kwargs)
        counted = self.num_preempted_reqs - before
        if counted:
            self.num_preempted_reqs += counted
            fired("preemptions_counted_twice", f"preemption of {req_id} counted twice in the total")
    return update_from_events


def _prefix_hits_counted_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record_prefix_cache_stats(self: Any, request: Any, num_hits: int) -> None:
        stats = self.prefix_cache_stats
        queries = stats.queries if stats is not None else None
        original(self, request, num_hits)
        if num_hits and stats is not None and stats.queries != queries:  # the original recorded this admission
            stats.record(num_tokens=0, num_hits=num_hits, preempted=request.num_preemptions > 0)
            fired("prefix_hits_counted_twice", f"{request.request_id}: {num_hits} hit tokens counted twice")
    return record_prefix_cache_stats


def _generation_tokens_overcounted(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_from_output(self: Any, output: Any, *args: Any, **kwargs: Any) -> None:
        original(self, output, *args, **kwargs)
        if output.finish_reason is not None:
            self.num_generation_tokens += 1
            fired("generation_tokens_overcounted", f"{output.request_id} finished with one token counted twice")
    return update_from_output


#: fault -> [(module, qualname, patch)]: every replacement the fault makes (most make one)
_PATCHES: dict[str, list[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]] = {
    "resume_keeps_computed_tokens": [("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request",
                                      _resume_keeps_computed_tokens)],
    "hit_takes_no_reference": [("vllm.v1.core.block_pool", "BlockPool.touch", _hit_takes_no_reference),
                               ("vllm.v1.core.block_pool", "BlockPool.free_blocks", _free_without_reference)],
    "registers_block_under_wrong_hash": [("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
                                          _registers_block_under_wrong_hash)],
    "eviction_keeps_hash": [("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", _eviction_keeps_hash)],
    "ignores_abort": [("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests", _ignores_abort)],
    "preemptions_counted_twice": [("vllm.v1.metrics.stats", "IterationStats.update_from_events",
                                   _preemptions_counted_twice)],
    "prefix_hits_counted_twice": [("vllm.v1.core.kv_cache_manager", "KVCacheManager.record_prefix_cache_stats",
                                   _prefix_hits_counted_twice)],
    "generation_tokens_overcounted": [("vllm.v1.metrics.stats", "IterationStats.update_from_output",
                                       _generation_tokens_overcounted)],
}


# ------------------------------------------------------------------------------------------------ the hook
def _patch_module(name: str, module: Any) -> None:
    for module_name, qualname, make in _PATCHES[name]:
        if module_name != module.__name__:
            continue
        owner_name, attribute = qualname.rsplit(".", 1)
        owner = getattr(module, owner_name)
        original = owner.__dict__[attribute]  # the class's own function, never an inherited one
        setattr(owner, attribute, make(original))
        _say(f"{name} patched {module_name}.{qualname}")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module a fault names, it takes the spec the other finders give and makes
    its loader patch the module right after executing it."""

    def __init__(self, name: str):
        self.name = name
        self.modules = {module for module, _, _ in _PATCHES[name]}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        execute = spec.loader.exec_module
        name = self.name

        def exec_module(module: Any) -> None:
            execute(module)
            _patch_module(name, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's own loader
        return spec


def arm(name: str) -> None:
    """Patch fault ``name`` into this process: modules already imported now, the others as they load."""
    if name not in _PATCHES:
        raise ValueError(f"{FAULT_ENV}={name!r} is not a vLLM fault; the faults: {', '.join(sorted(_PATCHES))}")
    for module_name in {module for module, _, _ in _PATCHES[name]}:
        if module_name in sys.modules:
            _patch_module(name, sys.modules[module_name])
    sys.meta_path.insert(0, _PatchOnImport(name))
    _say(f"{name} armed")
