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
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from kvbench.core.cache import cache_root

#: how long a process waits for another one to finish writing a checkpoint (the small preset takes
#: well under a minute on 2 cores; a lock held longer than this is a hung writer, not a slow one)
LOCK_TIMEOUT_S = 600.0


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def builtin_checkpoint(preset: str = "tiny", seed: int = 0, head_dim: int | None = None) -> Path:
    """The directory of the built-in ``preset`` checkpoint, written on first use (once, under a lock).

    ``head_dim`` reshapes the attention heads (the preset's hidden size and head counts stay), for engines
    whose kernels do not take the preset's head size (vLLM's CPU attention: 32 and up)."""
    from kvbench.models import random_llama as checkpoint

    digest = hashlib.sha256(inspect.getsource(checkpoint).encode()).hexdigest()[:10]
    variant = f"-hd{head_dim}" if head_dim else ""
    overrides = {"head_dim": head_dim} if head_dim else {}
    target = cache_root() / "checkpoints" / f"{preset}{variant}-seed{seed}-{digest}"
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
            checkpoint.write_checkpoint(staging, preset=preset, seed=seed, **overrides)
            staging.rename(target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not _complete(target):  # not a lost race with a lock-less writer: a real failure
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def builtin_head_dim(preset: str = "tiny") -> int:
    """The head size of the built-in ``preset`` as written without overrides."""
    from kvbench.models.random_llama import build_config

    return int(build_config(preset)["head_dim"])


def checkpoint_for(layouts: list, preset: str = "tiny", seed: int = 0) -> Path:
    """The built-in ``preset`` in a shape every engine of the run loads: the preset itself where each
    layout (:class:`kvbench.core.kv_budget.KVLayout`) takes its head size, else the variant with the
    smallest head size they all take. ValueError when no head size suits them all."""
    natural = builtin_head_dim(preset)
    if all(layout.takes_head_size(natural) for layout in layouts):
        return builtin_checkpoint(preset, seed)
    for size in (32, 64, 128):
        if all(layout.takes_head_size(size) for layout in layouts):
            return builtin_checkpoint(preset, seed, head_dim=size)
    raise ValueError(f"no head size of 32, 64 or 128 is taken by every engine of the run: {layouts}")
