"""The soak's checks fail when they should: each is shown failing on data broken in exactly its way.

Fast and not marked ``soak``: these run in every plain ``pytest``, so a check that could never fail
does not hide behind the soak's ``--soak`` flag.
"""

from __future__ import annotations

import gc
import mmap
import socket
import subprocess
import sys
import threading

import pytest

from suites.soak.procfs import growth, process_tree, rss_bytes, socket_count, thread_count, tree_total
from suites.soak.test_soak import SoakRequest, _check_outputs

REQUESTS = [SoakRequest("a", [5], 3, None), SoakRequest("b", [6], 3, 1), SoakRequest("c", [7], 3, None)]
EXPECTED = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
GOOD = {"a": [("length", [1, 2, 3])], "b": [("abort", [4])], "c": [("length", [7, 8, 9])]}


def test_good_outputs_pass():
    _check_outputs(REQUESTS, GOOD, {"b"}, EXPECTED)


@pytest.mark.parametrize(("broken", "aborted", "message"), [
    ({"a": GOOD["a"], "b": GOOD["b"]}, {"b"}, "lost"),
    ({**GOOD, "a": GOOD["a"] * 2}, {"b"}, "finished more than once"),
    ({**GOOD, "c": [("length", [7, 8, 0])]}, {"b"}, "differ from the unpressured run"),
    ({**GOOD, "b": [("abort", [9])]}, {"b"}, "not a prefix"),
    ({**GOOD, "b": [("length", [4])]}, {"b"}, "wrong finish reasons"),
    ({**GOOD, "b": [("length", [4, 5, 6])]}, set(), "no request was aborted"),
])
def test_each_broken_output_fails(broken, aborted, message):
    with pytest.raises(AssertionError, match=message):
        _check_outputs(REQUESTS, broken, aborted, EXPECTED)


def test_growth_flags_a_leak_and_not_a_warm_up():
    warm_up_then_flat = [100.0, 150.0, 200.0] + [200.0] * 97
    assert growth(warm_up_then_flat) == 0.0
    leaking = [100.0 + i for i in range(100)]  # +1% of the start per sample
    assert growth(leaking) > 0.05
    with pytest.raises(ValueError, match="at least 4 samples"):
        growth([1.0, 2.0])


def test_proc_readers_see_sockets_threads_and_memory_change():
    if rss_bytes() is None:
        pytest.skip("no /proc here")
    # Earlier tests' unreachable sockets (in reference cycles) close whenever the collector runs, which
    # the allocations below could trigger mid-count: collect them now, before the baselines.
    gc.collect()
    sockets_before, threads_before = socket_count(), thread_count()
    held = [socket.socket() for _ in range(3)]
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert socket_count() == sockets_before + 3
        assert thread_count() == threads_before + 1
        before = rss_bytes()
        # a mapping of its own, every page written: new resident memory whatever the allocator keeps (a
        # bytearray may reuse memory freed earlier in the process and already resident: the full suite saw
        # RSS unchanged after a 64 MiB one)
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\x01" * len(block))
        assert rss_bytes() - before > 32 * 2**20
        block.close()
    finally:
        stop.set()
        worker.join(timeout=10)
        for s in held:
            s.close()
    assert socket_count() == sockets_before


def test_tree_totals_include_child_processes():
    if rss_bytes() is None:
        pytest.skip("no /proc here")
    code = ("import threading, time\n"
            "for _ in range(3):\n    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('ready', flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in process_tree()
        assert tree_total(thread_count) >= thread_count() + thread_count(child.pid)
        assert tree_total(rss_bytes) >= rss_bytes() + rss_bytes(child.pid) > rss_bytes()
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()
    assert tree_total(thread_count, 2**22 + 7) is None  # no such process
