"""Servers started in the background: their processes in Linux's idle scheduling class while they start ahead of the
run that needs them, back in the normal class once a run claims them.

A vLLM start is tens of CPU-seconds of imports. Started ahead at normal priority it takes half of a 2-core machine
from the check running meanwhile. In ``SCHED_IDLE`` a start runs only on CPU time nothing else wants: a waking task
of the normal class preempts it at once, and the start soaks up the idle moments between a check's runs. It is not
free: three idle-class starts beside a victim check still broke its streams into bursts, so a timing-sensitive
block pauses the starts in flight instead (:meth:`ServerAdapter.quiet
<kvbench.engines.http.server.ServerAdapter.quiet>`), and no more than two run side by side.

Scheduling classes are per thread: a process's later threads and children inherit its class, so the class is set
on the server's first process as soon as it exists (before it spawns anything), and restored on every thread of
every process of its group. Returning a thread from ``SCHED_IDLE`` to the normal class needs privilege (root, or
``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that allows nice 0): :func:`available` says whether this process has it;
where it has not, nothing is started in the idle class, since a server left there would be starved by the next one
started.
"""

from __future__ import annotations

import logging
import os
import sys

from kvbench.launch.placement import group_pids, thread_ids

log = logging.getLogger("kvbench")

#: the nice value a thread returns to: the normal class at the default priority
_NORMAL_NICE = 0


def available() -> bool:
    """Whether servers can be started in the idle class and brought back: Linux, and the privilege to return a
    thread to the normal class (root, or an ``RLIMIT_NICE`` soft limit that allows nice 0: 20 or more)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setscheduler"):
        return False
    if os.geteuid() == 0:
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20 - _NORMAL_NICE


def to_idle(pid: int) -> bool:
    """Put every thread of process ``pid`` in the idle class (its later threads and children inherit it). Returns
    whether it was done; a process already gone is not an error."""
    done = False
    for tid in thread_ids(pid):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done = True
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return done


def to_normal(pgid: int) -> int:
    """Return every thread of every process of group ``pgid`` that is in the idle class to the normal class.
    Returns how many threads moved; threads of processes that are gone are skipped."""
    moved = 0
    for pid in group_pids(pgid):
        for tid in thread_ids(pid):
            try:
                if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    continue
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                moved += 1
            except ProcessLookupError:
                continue
            except (PermissionError, OSError) as e:  # available() said yes: a limit changed under us; say so once
                log.warning("kvbench could not return server thread %d to the normal scheduling class: %s", tid, e)
                return moved
    return moved


def idle_threads(pgid: int) -> int:
    """How many threads of group ``pgid`` are in the idle class (for tests and diagnostics)."""
    count = 0
    for pid in group_pids(pgid):
        for tid in thread_ids(pid):
            try:
                count += os.sched_getscheduler(tid) == os.SCHED_IDLE
            except OSError:
                continue
    return count
