"""The refcount state machine on the reference block manager, and proof that it catches bugs.

A machine that never fails proves nothing: each deliberately broken manager below must make it
fail, and a counting adapter shows that every mechanism (prefix hits, chunked admission, swap out
and in, swap fallback, recompute, refused allocation, eviction) actually fired.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvbench.conformance.stateful import (
    PROFILES,
    BlockManagerMachine,
    BlockManagerUnderTest,
    machine_settings,
    make_state_machine,
    register_profiles,
)
from kvbench.engines.inprocess.reference_blocks import ReferenceBlockManager, reference_block_manager
from reference_engine.block_manager import BlockManager
from reference_engine.request import Request

# ---------------------------------------------------------------------------- the reference, >= 200 examples
ReferenceMachine = make_state_machine(reference_block_manager(), name="ReferenceMachine")
TestReferenceBlockManager = ReferenceMachine.TestCase
TestReferenceBlockManager.settings = machine_settings()

# Caching off: no hit may ever happen, everything else must still hold. Cheaper: fewer examples.
NoCachingMachine = make_state_machine(reference_block_manager(enable_caching=False), name="NoCachingMachine")
TestReferenceBlockManagerWithoutCaching = NoCachingMachine.TestCase
TestReferenceBlockManagerWithoutCaching.settings = machine_settings(max_examples=50)


def quick_settings(**overrides: Any) -> settings:
    """Deterministic and database-free, so that these tests neither flake nor replay old failures."""
    values: dict[str, Any] = {"max_examples": 100, "derandomize": True, "database": None,
                              "report_multiple_bugs": False}
    return machine_settings(**{**values, **overrides})


# ---------------------------------------------------------------------------- every mechanism fires
class CountingReference(ReferenceBlockManager):
    """Counts the events each mechanism produces, across every example of a run."""

    def __init__(self, counts: Counter[str]):
        super().__init__()
        self.counts = counts

    def admit(self, request_id: str, max_new_tokens: int) -> tuple[list[int], bool]:
        before = self.manager.pool.num_evictions
        hits, ok = super().admit(request_id, max_new_tokens)
        req = self.requests[request_id]
        self.counts["admitted" if ok else "admission refused"] += 1
        self.counts["prefix hit"] += bool(ok and hits)
        self.counts["hit on an unreferenced cached block"] += ok and any(
            self.manager.pool.blocks[b].ref_cnt == 1 for b in hits)
        self.counts["hit on a block another request holds"] += ok and any(
            self.manager.pool.blocks[b].ref_cnt > 1 for b in hits)
        self.counts["chunked admission"] += bool(ok and req.num_computed_tokens + max_new_tokens < req.num_tokens)
        self.counts["eviction"] += self.manager.pool.num_evictions - before
        return hits, ok

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        ok = super().allocate_slots(request_id, num_new_tokens)
        self.counts["allocate_slots refused"] += not ok
        return ok

    def preempt_recompute(self, request_id: str) -> None:
        self.counts["recompute"] += 1
        super().preempt_recompute(request_id)

    def can_swap_out(self, request_id: str) -> bool:
        fits = super().can_swap_out(request_id)
        self.counts["swap out refused"] += not fits
        return fits

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        self.counts["swap out"] += 1
        return super().swap_out(request_id)

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        self.counts["swap in"] += 1
        return super().swap_in(request_id)


def test_every_mechanism_fires() -> None:
    counts: Counter[str] = Counter()
    machine = make_state_machine(lambda: CountingReference(counts))
    run_state_machine_as_test(machine, settings=quick_settings(max_examples=150, phases=[Phase.generate]))
    mechanisms = ["admitted", "admission refused", "prefix hit", "hit on an unreferenced cached block",
                  "hit on a block another request holds", "chunked admission", "eviction",
                  "allocate_slots refused", "recompute", "swap out refused", "swap out", "swap in"]
    missing = [m for m in mechanisms if counts[m] == 0]
    assert not missing, f"never exercised: {missing}; counts: {dict(counts)}"


# ---------------------------------------------------------------------------- broken managers are caught
class LeaksASharedReference(BlockManager):
    """free() drops a shared block from the table without releasing its reference, and the
    engine's own self-check is off: only the model can notice."""

    def free(self, request_id: str) -> None:
        table = self.block_tables.get(request_id, [])
        shared = next((b for b in table if b.ref_cnt > 1), None)
        if shared is not None:
            table.remove(shared)
        super().free(request_id)

    def check_invariants(self) -> None:
        pass


class HitsTheWholePrompt(BlockManager):
    """Forgets that the last token must be computed: a fully cached prompt is a 100% hit."""

    def find_cached_prefix(self, request: Request) -> list[Any]:
        hits = []
        for block_hash in self.block_hashes(request) if self.enable_caching else []:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class RegistersBeforeCompute(BlockManager):
    """Registers a block's hash as soon as the block is allocated (nano-vllm's in-flight hit bug):
    another request can then hit KV that was never computed."""

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[Any] = ()) -> bool:
        ok = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        if ok and self.enable_caching:
            for block, block_hash in zip(self.block_tables[request.request_id], self.block_hashes(request),
                                         strict=False):
                self.pool.register(block, block_hash)
        return ok


class DropsCacheOnFree(BlockManager):
    """Evicts a block's cache entry as soon as it is freed, so a cached prefix never outlives
    its request (the design's contract: it survives until its space is needed)."""

    def free(self, request_id: str) -> None:
        table = list(self.block_tables.get(request_id, []))
        super().free(request_id)
        for block in table:
            if block.ref_cnt == 0:
                self.pool._evict(block)


class SwapsOutOfOrder(BlockManager):
    """Reports a swap-out mapping whose host ids are not the ones it records for swap-in, so the
    KV would come back into the wrong positions."""

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        mapping = super().swap_out(request_id)
        hosts = [h for _, h in mapping][::-1]
        return [(d, h) for (d, _), h in zip(mapping, hosts, strict=True)]


@pytest.mark.parametrize(("manager_cls", "message"), [
    (LeaksASharedReference, r"free device blocks|leaked|not whole"),
    (HitsTheWholePrompt, r"the last token must be computed"),
    (RegistersBeforeCompute, r"does not hold the computed KV"),
    (DropsCacheOnFree, r"hit blocks, expected between"),
    (SwapsOutOfOrder, r"host"),
])
def test_machine_catches_a_broken_manager(manager_cls: type[BlockManager], message: str) -> None:
    machine = make_state_machine(reference_block_manager(manager_cls=manager_cls), name=manager_cls.__name__)
    # No shrinking: finding the bug is the point; a minimal example would cost seconds more.
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(machine, settings=quick_settings(max_examples=200, phases=[Phase.generate]))


# ---------------------------------------------------------------------------- plumbing
def test_reference_adapter_satisfies_the_protocol() -> None:
    assert isinstance(ReferenceBlockManager(), BlockManagerUnderTest)


def test_a_machine_needs_a_factory() -> None:
    with pytest.raises(TypeError, match="make_state_machine"):
        BlockManagerMachine()


def test_ci_settings_run_at_least_200_examples_without_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    ci = machine_settings()
    assert ci.max_examples >= 200 and ci.deadline is None and ci.stateful_step_count <= 50


def test_the_environment_selects_the_deep_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "kvbench-deep")
    assert machine_settings().max_examples == PROFILES["kvbench-deep"]["max_examples"] >= 1000
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "someone-elses-profile")  # not ours: CI defaults
    assert machine_settings().max_examples == PROFILES["kvbench-ci"]["max_examples"]
    with pytest.raises(ValueError, match="profile='deeep' is unknown"):
        machine_settings("deeep")


def test_profiles_can_be_registered_for_the_pytest_option() -> None:
    register_profiles()
    assert settings.get_profile("kvbench-deep").max_examples == PROFILES["kvbench-deep"]["max_examples"]
    assert settings.get_profile("kvbench-ci").deadline is None


def test_importing_the_machine_does_not_import_the_reference_engine() -> None:
    code = "import sys, kvbench.conformance.stateful; sys.exit('reference_engine' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
