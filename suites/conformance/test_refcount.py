"""Check 5: refcount safety. A hypothesis state machine drives the engine's block manager through
allocate, append, share, free, preempt (both modes), swap in and evict against a plain-Python
model, checking invariants after every step; at the end the pool must be whole."""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvbench.conformance.stateful import machine_settings, make_state_machine
from kvbench.plugin import require

pytestmark = pytest.mark.conformance


def test_block_manager_state_machine(engine):
    require(engine, "block_introspection")
    machine = make_state_machine(engine.block_manager_factory(), name=f"{engine.kind}_blocks")
    run_state_machine_as_test(machine, settings=machine_settings())
