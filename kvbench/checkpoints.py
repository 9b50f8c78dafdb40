"""The built-in checkpoints that suites and benchmarks run on, written once and cached.

``builtin_checkpoint("tiny")`` returns a directory with a seeded random Llama checkpoint in
Hugging Face format. It is generated locally (nothing is downloaded) under
``$KVBENCH_CACHE`` (default ``~/.cache/kvbench``) the first time and reused afterwards; the
directory name carries the preset, the seed and a digest of the generator's source, so a change
to the generator never reuses a stale checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def builtin_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    from reference_engine import checkpoint, tokenizer

    # Both generators (weights + config, and the tokenizer) key the cache.
    source = inspect.getsource(checkpoint) + inspect.getsource(tokenizer)
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]
    target = cache_root() / "checkpoints" / f"{preset}-seed{seed}-{digest}"
    complete = ("config.json", "tokenizer.json")
    if all((target / name).is_file() for name in complete) and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so concurrent runs never see half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    checkpoint.write_checkpoint(staging, preset=preset, seed=seed)
    try:
        staging.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return target
