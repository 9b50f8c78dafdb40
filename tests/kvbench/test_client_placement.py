"""kvbench's client beside a server it launched: off the cores the server binds its engine to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvbench.engines.http.server import ServerAdapter
from kvbench.launch.placement import (
    client_cores,
    engine_cores,
    group_pids,
    helpers_back,
    helpers_onto_engine_cores,
    off_the_engine_cores,
    thread_ids,
)

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may run on")


def _group(bind: list[int] | None) -> Iterator[int]:
    """A process group as a server makes one: a leader (the front end, unbound) and a child (the engine)
    bound to ``bind`` (None: not bound). Yields the leader's pid, the group's id."""
    child = ("import os, time\n"
             f"{'os.sched_setaffinity(0, ' + repr(bind) + ')' if bind is not None else ''}\n"
             "print('ready', flush=True); time.sleep(60)")
    code = ("import subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
            "print(c.stdout.readline().decode().strip(), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture
def bound_to_first_core() -> Iterator[int]:
    yield from _group([CORES[0]])


@pytest.fixture
def unbound() -> Iterator[int]:
    yield from _group(None)


@needs_two_cores
def test_the_client_gets_the_cores_the_server_leaves_free(bound_to_first_core: int) -> None:
    pids = group_pids(bound_to_first_core)
    assert len(pids) == 2 and bound_to_first_core in pids
    assert engine_cores(pids, set(CORES)) == {CORES[0]}
    assert client_cores(bound_to_first_core) == set(CORES[1:])


@needs_two_cores
def test_a_server_that_binds_nothing_leaves_the_client_where_it_is(unbound: int) -> None:
    assert client_cores(unbound) is None
    with off_the_engine_cores(unbound) as moved:
        assert moved is None and os.sched_getaffinity(0) == set(CORES)


@needs_two_cores
def test_every_thread_moves_for_the_block_and_goes_back_after(bound_to_first_core: int) -> None:
    release = threading.Event()
    seen: dict[str, set[int]] = {}

    def waiter(name: str) -> None:
        release.wait(30)
        seen[name] = os.sched_getaffinity(0)

    before = threading.Thread(target=waiter, args=("before",))
    before.start()
    time.sleep(0.05)
    with off_the_engine_cores(bound_to_first_core) as moved:
        assert moved == set(CORES[1:])
        inside = threading.Thread(target=waiter, args=("inside",))
        inside.start()
        assert os.sched_getaffinity(0) == set(CORES[1:])
        release.set()
        before.join(10)
        inside.join(10)
    assert seen == {"before": set(CORES[1:]), "inside": set(CORES[1:])}  # the older thread moved too
    assert os.sched_getaffinity(0) == set(CORES)

    late = threading.Thread(target=lambda: seen.__setitem__("late", os.sched_getaffinity(0)))
    late.start()
    late.join(10)
    assert seen["late"] == set(CORES)


def _group_of(binds: list[list[int] | None]) -> Iterator[tuple[int, list[int]]]:
    """A leader (unbound) with one child per entry of ``binds`` (bound to it, or None: unbound, with a second
    thread). Yields the leader's pid and the children's pids."""
    child = ("import os, sys, threading, time\n"
             "b = eval(sys.argv[1])\n"
             "b is not None and os.sched_setaffinity(0, b)\n"
             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
             "print('ready', os.getpid(), flush=True); time.sleep(60)")
    code = ("import subprocess, sys, time\n"
            f"cs = [subprocess.Popen([sys.executable, '-c', {child!r}, a], stdout=subprocess.PIPE) for a in "
            f"{[repr(b) for b in binds]!r}]\n"
            "print(' '.join(c.stdout.readline().decode().split()[1] for c in cs), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        yield proc.pid, [int(p) for p in proc.stdout.readline().split()]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(tid) for tid in thread_ids(pid)]


@needs_two_cores
def test_a_helper_that_binds_nothing_goes_to_the_engines_cores_and_the_front_end_stays() -> None:
    for leader, (engine, helper) in _group_of([[CORES[0]], None]):
        assert set().union(*_affinities(helper)) == set(CORES)
        assert helpers_onto_engine_cores(leader) == {helper: {CORES[0]}}
        assert _affinities(helper) == [{CORES[0]}] * 2  # every thread of it
        assert _affinities(engine) == [{CORES[0]}] * 2
        assert os.sched_getaffinity(leader) == set(CORES)  # the front end keeps the machine
        assert helpers_onto_engine_cores(leader) == {}  # bound now: left alone


@needs_two_cores
def test_helpers_back_unbinds_what_was_bound_and_leaves_the_engine() -> None:
    for leader, (engine, helper) in _group_of([[CORES[0]], None]):
        moved = helpers_onto_engine_cores(leader)
        assert _affinities(helper) == [{CORES[0]}] * 2
        helpers_back(moved)
        assert _affinities(helper) == [set(CORES)] * 2  # every thread free again, as before
        assert _affinities(engine) == [{CORES[0]}] * 2  # the engine's own binding is not the helpers'
        helpers_back({})  # nothing moved: nothing to do


def test_a_quiet_block_binds_the_served_servers_helpers_and_unbinds_them_on_exit(monkeypatch, model_dir) -> None:
    """Inside :meth:`ServerAdapter.quiet` a run places the server's helpers beside its engine (as helper_cores=engine
    does), and the block's end puts them back; outside a quiet block, with helper_cores=free, nothing moves."""
    from types import SimpleNamespace

    import kvbench.engines.http.server as server_module

    bound, unbound = [], []
    monkeypatch.setattr(server_module, "helpers_onto_engine_cores",
                        lambda pgid: bound.append(pgid) or {pgid + 1: {0}})
    monkeypatch.setattr(server_module, "helpers_back", lambda moved: unbound.append(dict(moved)))
    adapter = ServerAdapter(model_dir, {"preset": "reference", "client_cores": "off"})  # starts nothing yet
    server = SimpleNamespace(pgid=100)
    with adapter._client_placed(server):
        pass
    assert bound == []
    with adapter.quiet():
        with adapter._client_placed(server):
            pass
        assert bound == [100] and unbound == []
    assert unbound == [{101: {0}}] and adapter._quiet_helpers == {}


@needs_two_cores
def test_with_no_engine_bound_no_helper_moves() -> None:
    for leader, (a, b) in _group_of([None, None]):
        assert helpers_onto_engine_cores(leader) == {}
        assert set().union(*_affinities(a), *_affinities(b)) == set(CORES)


def test_helper_cores_takes_free_or_engine_and_names_itself_otherwise() -> None:
    ServerAdapter.validate_options({"preset": "reference", "helper_cores": "engine"})
    with pytest.raises(ValueError, match="helper_cores must be free or engine"):
        ServerAdapter.validate_options({"preset": "reference", "helper_cores": "1"})


def test_the_option_takes_auto_or_off_and_names_itself_otherwise() -> None:
    ServerAdapter.validate_options({"preset": "reference", "client_cores": "off"})
    with pytest.raises(ValueError, match="client_cores must be auto or off"):
        ServerAdapter.validate_options({"preset": "reference", "client_cores": "1"})


@pytest.mark.server
@needs_two_cores
@pytest.mark.parametrize("option, on_engine_core", [("auto", False), ("off", True)])
def test_the_server_adapter_sends_from_off_the_reference_servers_engine_core(
        tiny_ckpt: str, monkeypatch, option: str, on_engine_core: bool) -> None:
    from kvbench.core.requests import GenRequest
    from kvbench.engines.http.openai import OpenAIAdapter

    seen: list[set[int]] = []
    real = OpenAIAdapter.generate

    def recording(self, requests, knobs):
        seen.append(os.sched_getaffinity(0))
        return real(self, requests, knobs)

    monkeypatch.setattr(OpenAIAdapter, "generate", recording)
    adapter = ServerAdapter(tiny_ckpt, {"preset": "reference", "client_cores": option})
    try:
        result = adapter.generate([GenRequest("p", [5, 6, 7], 4)])
    finally:
        adapter.close()
    assert len(result.outputs) == 1
    # the reference server binds its engine process to the first core (--bind-cpus)
    assert (CORES[0] in seen[0]) is on_engine_core
    assert os.sched_getaffinity(0) == set(CORES)


@pytest.mark.server
@needs_two_cores
@pytest.mark.parametrize("option", ["free", "engine"])
def test_helper_cores_engine_binds_the_reference_servers_unbound_helper_and_free_leaves_it(
        tiny_ckpt: str, option: str) -> None:
    """The reference server's group: its HTTP process (the leader, bound by itself to the cores its engine
    leaves), its engine process (bound), and multiprocessing's resource tracker, which binds nothing: the
    helper ``helper_cores=engine`` puts on the engine's cores."""
    from kvbench.core.requests import GenRequest

    adapter = ServerAdapter(tiny_ckpt, {"preset": "reference", "helper_cores": option})
    try:
        assert len(adapter.generate([GenRequest("p", [5, 6, 7], 4)]).outputs) == 1
        pgid = adapter.process.pgid
        leader_cores = os.sched_getaffinity(pgid)
        others = [pid for pid in group_pids(pgid) if pid != pgid]
        engine = engine_cores(others, set(CORES))
        unbound = [pid for pid in others if not engine_cores([pid], set(CORES))]
        assert engine, "the reference server binds its engine process"
        if option == "free":
            assert unbound, "a helper the server leaves unbound (else this test shows nothing)"
        else:
            assert not unbound and all(set().union(*_affinities(pid)) == engine for pid in others)
            assert os.sched_getaffinity(pgid) == leader_cores  # the front end is not moved
    finally:
        adapter.close()
