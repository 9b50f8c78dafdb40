"""The torch thread policy every timed run shares: the storm benchmarks and ``kvbench demo``.

``KVBENCH_TORCH_THREADS`` if set; else 1 on CPU, at both scales; else (CUDA) torch's default. Why one
thread: on a shared machine with few cores, OpenMP threads that spin while waiting for a busy core made
every step many times slower, and by different amounts from run to run, so a demo showed a large
"difference" between two modes that vanished with one thread; the same held at ``full`` scale on the
``small`` model, most of all beside another process (the figures:
docs/journal/measurements.md#torch-threads-on-a-shared-machine). Both faces pin the same number so that what the
demo shows is what the benchmarks measure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: environment variable that overrides the policy (a positive integer)
ENV_VAR = "KVBENCH_TORCH_THREADS"


def torch_threads(scale: str = "quick") -> int | None:
    """The intra-op thread count to pin at ``scale`` (None: leave torch's default). The policy is the
    same at both scales; ``scale`` stays so that callers keep naming theirs.

    Raises ValueError naming ``KVBENCH_TORCH_THREADS`` when it is set to anything but a positive integer.
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            threads = int(env)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"{ENV_VAR}={env!r}: expected a positive integer (threads for torch)")
        return threads
    import torch

    return None if torch.cuda.is_available() else 1


@contextlib.contextmanager
def pinned_torch_threads(scale: str = "quick") -> Iterator[int]:
    """Pin torch's intra-op threads by :func:`torch_threads` for the block; yields the number in force.
    The previous number is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    wanted = torch_threads(scale)
    if wanted:
        torch.set_num_threads(wanted)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def describe(threads: int) -> str:
    """One line for a terminal: the number in force and how to change it."""
    source = f"from {ENV_VAR}" if os.environ.get(ENV_VAR, "").strip() else f"{ENV_VAR} to change"
    return f"torch threads: {threads} ({source})"
