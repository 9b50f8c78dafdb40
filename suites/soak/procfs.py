"""What a soak watches in a process, read from Linux's /proc (no psutil needed).

Every reader takes a pid (default: this process) and returns None where /proc is not there (not
Linux), so a caller can skip rather than fail on another OS.
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size in bytes (/proc/<pid>/statm, second field, in pages)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return None


def thread_count(pid: int | str = "self") -> int | None:
    """Threads of the process (the ``Threads:`` line of /proc/<pid>/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def socket_count(pid: int | str = "self") -> int | None:
    """Open sockets of the process: its file descriptors that link to ``socket:[inode]``."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    count = 0
    for name in names:
        try:
            count += os.readlink(fd_dir / name).startswith("socket:")
        except OSError:  # closed between listdir and readlink
            continue
    return count


def process_tree(pid: int | str = "self") -> list[int] | None:
    """``pid`` and every process below it (/proc/<pid>/task/*/children), parents first: a server's
    memory and threads include those of the processes it started (the reference server's engine)."""
    root = os.getpid() if pid == "self" else int(pid)
    if not Path(f"/proc/{root}").exists():
        return None
    tree, todo = [], [root]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # exited meanwhile
        for task in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
            except OSError:
                continue
    return tree


def tree_total(reader, pid: int | str = "self") -> int | None:
    """``reader`` (``rss_bytes``, ``thread_count``, ...) summed over :func:`process_tree`; None when
    ``pid`` itself cannot be read."""
    tree = process_tree(pid)
    if not tree:
        return None
    values = [reader(p) for p in tree]
    if values[0] is None:
        return None
    return sum(v for v in values if v is not None)


def growth(samples: list[float]) -> float:
    """Relative growth from the first quarter of ``samples`` to the last: max(last quarter) over
    max(first quarter), minus 1. Maxima, because a leak raises every later peak while start-up
    allocations (loaded weights, warmed allocators) are already inside the first quarter's peak."""
    if len(samples) < 4:
        raise ValueError(f"need at least 4 samples to compare quarters, got {len(samples)}")
    quarter = len(samples) // 4
    first, last = max(samples[:quarter]), max(samples[-quarter:])
    return last / first - 1.0
