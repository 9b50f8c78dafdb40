"""The built-in checkpoints that suites and benchmarks run on, written once and cached.

``builtin_checkpoint("tiny")`` returns a directory with a seeded random Llama checkpoint in
Hugging Face format. It is generated locally (nothing is downloaded) under
``$KVBENCH_CACHE`` (default ``~/.cache/kvbench``) the first time and reused afterwards; the
directory name carries the preset, the seed and a digest of the generator's source, so a change
to the generator never reuses a stale checkpoint.

Concurrency contract: any number of processes may ask for the same checkpoint at once (pytest-xdist
workers, several pytest runs sharing one cache). Exactly one of them writes it, under a file lock
next to the target (``<target>.lock``); the others wait on the lock and then find it complete. The
writer stages into a temporary sibling and renames it into place, so even a reader that skips the
lock (an older kvbench) never sees half a checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

#: how long a process waits for another one to finish writing a checkpoint (the small preset takes
#: well under a minute on 2 cores; a lock held longer than this is a hung writer, not a slow one)
LOCK_TIMEOUT_S = 600.0


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def builtin_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The directory of the built-in ``preset`` checkpoint, written on first use (once, under a lock)."""
    from reference_engine import checkpoint

    digest = hashlib.sha256(inspect.getsource(checkpoint).encode()).hexdigest()[:10]
    target = cache_root() / "checkpoints" / f"{preset}-seed{seed}-{digest}"
    if _complete(target):  # the common case: no lock file touched
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S):
        if _complete(target):  # another process wrote it while we waited
            return target
        if target.exists():  # a crashed writer from before the lock existed: start again
            shutil.rmtree(target, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
        try:
            checkpoint.write_checkpoint(staging, preset=preset, seed=seed)
            staging.rename(target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not _complete(target):  # not a lost race with a lock-less writer: a real failure
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target
