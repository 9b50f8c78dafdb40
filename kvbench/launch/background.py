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
every process of its group.

The class alone is not enough where the kernel groups tasks by session (``CONFIG_SCHED_AUTOGROUP``, on in most
distributions' kernels): a server is started in a session of its own, so it is a group of its own, and the kernel
shares the CPU between groups first, whatever the class of the tasks inside. Seen on this 2-core machine: two
busy loops in the idle class, in a session of their own, took half the CPU from two normal ones in another session;
with their session's autogroup at nice 19 they took about 1%. So a start ahead also has its autogroup reniced to 19
(:func:`to_idle`), back to 0 when claimed (:func:`to_normal`); only the server's own session, never the caller's.

Returning a thread from ``SCHED_IDLE`` to the normal class needs privilege (root, or
``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that allows nice 0): :func:`available` says whether this process has it;
where it has not, nothing is started in the idle class, since a server left there would be starved by the next one
started.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from kvbench.launch.placement import group_pids, thread_ids

log = logging.getLogger("kvbench")

#: the nice value a thread returns to: the normal class at the default priority
_NORMAL_NICE = 0
#: the nice value of a start ahead's session autogroup: the weakest there is (weight 15 against 1024)
IDLE_AUTOGROUP_NICE = 19
#: how long a write to an autogroup's nice may be retried: without CAP_SYS_ADMIN the kernel takes one such write
#: a tenth of a second, machine-wide, and answers EAGAIN to the others
_AUTOGROUP_RETRY_S = 2.0


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
    """Put every thread of process ``pid`` in the idle class (its later threads and children inherit it), and its
    session's autogroup at :data:`IDLE_AUTOGROUP_NICE` where ``pid`` leads a session of its own. Returns whether
    the class was set; a process already gone is not an error."""
    _autogroup_nice(pid, IDLE_AUTOGROUP_NICE)
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
    Returns how many threads moved; threads of processes that are gone are skipped. The group's session autogroup
    (where the group leads a session of its own) goes back to nice 0 first."""
    _autogroup_nice(pgid, _NORMAL_NICE)
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


def _autogroup_path(pid: int) -> Path | None:
    """``/proc/PID/autogroup`` where ``pid`` leads a session of its own (not the caller's) on a kernel that groups
    by session; else None: renicing any other autogroup would renice the caller's own."""
    path = Path(f"/proc/{pid}/autogroup")
    try:
        own = os.getsid(pid) == pid and os.getsid(pid) != os.getsid(0)
    except OSError:
        return None
    return path if own and path.exists() else None


def _autogroup_nice(pid: int, nice: int) -> bool:
    """Set the nice value of the autogroup of the session ``pid`` leads. Returns whether it was set; no session of
    its own, no autogroups, a process gone: False, and nothing else changes."""
    path = _autogroup_path(pid)
    if path is None:
        return False
    deadline = time.monotonic() + _AUTOGROUP_RETRY_S
    while True:
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: another write this tenth of a second
            if time.monotonic() > deadline:
                log.warning("kvbench could not set the autogroup nice of server %d to %d: the kernel kept "
                            "answering EAGAIN", pid, nice)
                return False
            time.sleep(0.11)
        except OSError:
            return False


def autogroup_nice(pid: int) -> int | None:
    """The nice value of the autogroup of the session ``pid`` leads, None where it has none of its own (for tests
    and diagnostics)."""
    path = _autogroup_path(pid)
    try:
        return int(path.read_text().split("nice")[1]) if path is not None else None
    except (OSError, IndexError, ValueError):
        return None


def autogroups_on() -> bool:
    """Whether the kernel groups tasks by session (``/proc/sys/kernel/sched_autogroup_enabled`` is 1)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def yields(pid: int) -> bool:
    """Whether server ``pid``, put in the idle class by :func:`to_idle`, truly gives way to the normal class: its
    threads are idle and, where the kernel groups by session and it leads a session of its own, that session's
    autogroup is at :data:`IDLE_AUTOGROUP_NICE` (without it, the idle class gives way only inside its own group)."""
    if idle_threads(pid) == 0:
        return False
    if not autogroups_on() or _autogroup_path(pid) is None:
        return True
    return autogroup_nice(pid) == IDLE_AUTOGROUP_NICE
