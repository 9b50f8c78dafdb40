"""Where kvbench's own client runs beside a server it launched on the same machine.

A server that binds its engine to some cores (vLLM's CPU build binds its worker's OpenMP threads to all
cores but the ones it reserves for its front end; the reference server binds its engine process) leaves
the other cores to its front end, and a client on the same machine belongs there too: it is front-end
work. Left to the OS, kvbench's client landed on the engine's core now and then, where a worker that
never sleeps held it off the CPU: on 2 cores, with the client on vLLM's worker core, streams the server
had written one event per token were read in one piece, long after they were sent, and vLLM's
throughput moved severalfold from round to round with the client's placement (the figures:
docs/journal/measurements.md#predicting-real-engines).

:func:`client_cores` reads the server's process group from ``/proc``: every thread of every process in
it but the leader (the front end kvbench started) whose affinity is narrower than the machine's is
bound, and the cores of those threads are the engine's. :func:`off_the_engine_cores` moves this
process's threads to the other cores for the length of a block and puts them back afterwards. Where
nothing is bound, or nothing would be left, it leaves the client where it is.

:func:`helpers_onto_engine_cores` (the ``server`` adapter's ``helper_cores=engine``) binds the server's
*helpers* to its engine's cores: every process of the group but the leader that binds none of its
threads. In vLLM's CPU server that is ``VLLM::EngineCore``, the scheduler. vLLM reserves a core for it
(``reserved_cpus`` in its log) but never binds it there, and it does not sleep between steps: it spins
on ``sched_yield`` while its worker computes (``SpinCondition``, ``busy_loop_s`` 1 s, in
``shm_broadcast.py``). Where the OS runs it on the front end's core, its API server is held off the CPU:
a stream's tokens reach the client in one chunk and throughput falls severalfold. With the scheduler
beside its worker, the two take turns (one computes while the other waits), the front end keeps its
core, and vLLM's throughput from round to round steadies (the figures:
docs/journal/measurements.md#predicting-real-engines; the reproduction: scripts/findings/vllm_front_end_cores.py).
Linux only (``sched_setaffinity``); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from kvbench.launch.process import group_members

log = logging.getLogger("kvbench")


def thread_ids(pid: int | str) -> list[int]:
    """The thread ids of process ``pid`` (``"self"``: this one), from /proc; empty if it is gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def group_pids(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (empty where there is no /proc)."""
    return [pid for pid, state in group_members(pgid) or () if state != "Z"]


#: seconds until a vLLM server's spinning waiters sleep after its last step (``busy_loop_s`` 1 s, with a
#: margin): how long a side-by-side measurement waits before timing the next engine on the same cores
SPIN_QUIET_S = 1.5


def machine_cores() -> set[int]:
    """Every core of the machine (those this process may use included, whatever ``cpu_count`` says)."""
    return set(range(os.cpu_count() or 1)) | os.sched_getaffinity(0)


def engine_cores(pids: list[int], machine: set[int]) -> set[int]:
    """The cores that threads of ``pids`` are bound to: those whose affinity is narrower than ``machine``."""
    bound: set[int] = set()
    for pid in pids:
        for tid in thread_ids(pid):
            try:
                cores = os.sched_getaffinity(tid)
            except OSError:  # exited meanwhile
                continue
            if cores < machine:
                bound |= cores
    return bound


def client_cores(pgid: int) -> set[int] | None:
    """The cores this process should run on beside server group ``pgid``: this process's cores less the
    engine's, or None where the server binds nothing or nothing would be left."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    machine = machine_cores()
    # The group's leader is the process kvbench started: the server's front end (vLLM's API server, the
    # reference server's HTTP process, which binds itself to the cores its engine leaves). The client
    # may share its cores; the engine's are the ones the other processes are bound to.
    left = mine - engine_cores([pid for pid in group_pids(pgid) if pid != pgid], machine)
    return left if left and left != mine else None


def helpers_onto_engine_cores(pgid: int) -> dict[int, set[int]]:
    """Bind every thread of each *helper* of server group ``pgid`` (a process other than the leader with no
    thread bound narrower than the machine) to the engine's cores (the cores its bound processes use).
    Returns ``{pid: cores}`` for the helpers bound; empty where nothing is bound or nothing is unbound.
    Idempotent: a helper bound before counts as bound and is left alone."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    machine = machine_cores()
    others = [pid for pid in group_pids(pgid) if pid != pgid]
    engine = engine_cores(others, machine)
    if not engine:
        return {}
    moved: dict[int, set[int]] = {}
    for pid in others:
        if engine_cores([pid], machine):
            continue  # the engine itself, or a helper bound already
        tids = thread_ids(pid)
        _set_threads({tid: engine for tid in tids})
        if tids:
            moved[pid] = engine
    if moved:
        log.debug("server helpers %s bound to the engine's cores %s", sorted(moved), sorted(engine))
    return moved


def helpers_back(moved: dict[int, set[int]]) -> None:
    """Undo :func:`helpers_onto_engine_cores`: every thread of each helper in ``moved`` (its return value) may run
    on every core of the machine again, as an unbound helper did before. A helper that ended meanwhile is skipped."""
    if not moved or not hasattr(os, "sched_setaffinity"):
        return
    machine = machine_cores()
    for pid in moved:
        _set_threads({tid: machine for tid in thread_ids(pid)})


def _set_threads(cores: dict[int, set[int]]) -> None:
    for tid, wanted in cores.items():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, wanted)


@contextlib.contextmanager
def off_the_engine_cores(pgid: int | None) -> Iterator[set[int] | None]:
    """For the block, every thread of this process runs off the cores server group ``pgid`` binds its
    engine to (threads started inside inherit it); yields the cores used, or None where nothing moved.
    Each thread's own affinity is put back afterwards."""
    cores = client_cores(pgid) if pgid is not None else None
    if cores is None:
        yield None
        return
    before: dict[int, set[int]] = {}
    for tid in thread_ids("self"):
        with contextlib.suppress(OSError):
            before[tid] = os.sched_getaffinity(tid)
    _set_threads({tid: cores for tid in before})
    log.debug("client moved to cores %s, off the server's engine cores", sorted(cores))
    try:
        yield cores
    finally:
        started = {tid: before.get(threading.get_native_id(), cores) for tid in thread_ids("self") if tid not in before}
        _set_threads({**before, **started})  # threads started inside get the caller's old cores
