"""Which memory allocator the engine process runs on (``--engine-malloc``).

Why: a step allocates and frees many short-lived tensors, and glibc's malloc returns large blocks to the kernel
and asks for them again, step after step. TCMalloc keeps them. vLLM's CPU installation page asks its users to
preload it for this reason; the reference server does the same for its engine process where the machine has
it. Measured (docs/benchmarks.md, "Measured again 2026-12-07": ``small`` float32, the head-to-head's closed
loop, 2 cores, three interleaved rounds against ``--engine-malloc system``): 1.01x, 1.01x, 1.03x output
throughput at concurrency 16 and 1.04x, 1.01x, 1.00x at 64, TTFT level. The choice changes no output:
allocation is not arithmetic.

The contract: ``auto`` (the default) preloads the first TCMalloc library found in the system's library folders
(:data:`LIB_DIRS`: Debian's ``libtcmalloc-minimal4`` or ``libgoogle-perftools4``) and goes on with the system
allocator where there is none; ``tcmalloc`` demands it (:class:`AllocatorMissing`, saying how to install it,
where there is none); ``system`` preloads nothing. Only the engine process is started with it (the ``spawn``
start method runs a fresh interpreter, which the dynamic loader gives the preload); the HTTP process keeps the
allocator it was started with. A ``LD_PRELOAD`` already in the environment is kept, the library put after it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

CHOICES = ("auto", "tcmalloc", "system")
#: where :func:`find_tcmalloc` looks, in order
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
#: the library files tried in each folder, in order (the minimal build first: no heap profiler)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
#: TCMalloc's threshold for reporting a large allocation on stderr (bytes)
QUIET_LARGE_ALLOCS = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
HOW_TO_INSTALL = "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu), dnf install gperftools-libs (Fedora)"


class AllocatorMissing(RuntimeError):
    """``--engine-malloc tcmalloc`` on a machine without TCMalloc."""


def find_tcmalloc(lib_dirs: Sequence[str] = LIB_DIRS) -> Path | None:
    """The first TCMalloc library file in ``lib_dirs``, or None."""
    for folder in lib_dirs:
        for name in TCMALLOC_NAMES:
            candidate = Path(folder) / name
            if candidate.is_file():
                return candidate
    return None


def engine_preload(choice: str, lib_dirs: Sequence[str] = LIB_DIRS) -> Path | None:
    """The library the engine process is to preload for ``choice`` (one of :data:`CHOICES`), or None for the
    system allocator. ValueError naming the flag for another choice; :class:`AllocatorMissing` for
    ``tcmalloc`` where none is installed."""
    if choice not in CHOICES:
        raise ValueError(f"--engine-malloc={choice!r} is invalid: expected one of {', '.join(CHOICES)}")
    if choice == "system":
        return None
    found = find_tcmalloc(lib_dirs)
    if found is None and choice == "tcmalloc":
        raise AllocatorMissing(f"--engine-malloc=tcmalloc: no TCMalloc library ({', '.join(TCMALLOC_NAMES)}) in "
                               f"{', '.join(lib_dirs)}; install it with {HOW_TO_INSTALL}, or use "
                               "--engine-malloc=system")
    return found


@contextlib.contextmanager
def preloading(library: Path | None) -> Iterator[None]:
    """While in the block, ``LD_PRELOAD`` names ``library`` after whatever it named, and TCMalloc's report of
    large allocations is off unless set: a process started then (the engine process) loads it; the environment
    is as it was after the block. Nothing changes for None."""
    if library is None:
        yield
        return
    before = {name: os.environ.get(name) for name in ("LD_PRELOAD", QUIET_LARGE_ALLOCS)}
    os.environ["LD_PRELOAD"] = f"{before['LD_PRELOAD']} {library}" if before["LD_PRELOAD"] else str(library)
    # TCMalloc reports every allocation over 1 GiB on stderr; a KV pool is one, and no fault
    os.environ.setdefault(QUIET_LARGE_ALLOCS, str(1 << 62))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def loaded_allocator(maps: str | None = None) -> str:
    """"tcmalloc" when this process has a TCMalloc library mapped, else "system" (read from
    ``/proc/self/maps``, or ``maps``): what the engine process reports it runs on."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"
