"""The built-in checkpoints that suites and benchmarks run on, written once and cached.

``builtin_checkpoint("tiny")`` returns a directory with a seeded random Llama checkpoint in
Hugging Face format. The presets cover what real checkpoints vary (:mod:`kvbench.models.random_llama`):
``tiny``, the default of every suite, has grouped-query attention and attention and MLP biases, so the
default conformance run exercises an engine's bias path; ``small`` has grouped-query attention and no
bias, as Llama. A variant turns biases or tied embeddings on or off
(``builtin_checkpoint("tiny", attention_bias=False, mlp_bias=False)``: tiny's bias-free twin, the same
weight matrices without the biases). It is generated locally (nothing is downloaded) under
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

#: the settings a variant of a preset may change, and the word each adds to the directory name
#: ("no" before it when the variant turns the setting off)
VARIANT_WORDS = {"attention_bias": "attnbias", "mlp_bias": "mlpbias", "tie_word_embeddings": "tied"}


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def variant_name(preset: str, head_dim: int | None = None, **variant: bool) -> str:
    """The name of a preset's variant: the preset, ``-hd<N>`` for a head size, then a word per setting of
    ``variant`` that differs from the preset (``tiny-hd32``, ``tiny-noattnbias-nomlpbias``, ``small-tied``).
    ValueError naming the allowed settings for any other key, and for a value that is not a bool."""
    from kvbench.models.random_llama import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    unknown = sorted(set(variant) - set(VARIANT_WORDS))
    if unknown:
        raise ValueError(f"unknown variant setting(s) {unknown}: expected among {sorted(VARIANT_WORDS)}")
    name = preset + (f"-hd{head_dim}" if head_dim else "")
    for key, word in VARIANT_WORDS.items():
        value = variant.get(key, PRESETS[preset][key])
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is invalid: expected True or False")
        if value != PRESETS[preset][key]:
            name += f"-{word}" if value else f"-no{word}"
    return name


def builtin_checkpoint(preset: str = "tiny", seed: int = 0, head_dim: int | None = None, **variant: bool) -> Path:
    """The directory of the built-in ``preset`` checkpoint, written on first use (once, under a lock).

    ``head_dim`` reshapes the attention heads (the preset's hidden size and head counts stay), for engines
    whose kernels do not take the preset's head size (vLLM's CPU attention: 32 and up). ``variant`` turns the
    settings of :data:`VARIANT_WORDS` on or off (``attention_bias``, ``mlp_bias``, ``tie_word_embeddings``);
    the directory is named by :func:`variant_name`, so each variant is cached apart."""
    from kvbench.models import random_llama as checkpoint

    digest = hashlib.sha256(inspect.getsource(checkpoint).encode()).hexdigest()[:10]
    name = variant_name(preset, head_dim, **variant)
    overrides = {**({"head_dim": head_dim} if head_dim else {}), **variant}
    target = cache_root() / "checkpoints" / f"{name}-seed{seed}-{digest}"
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


def checkpoint_for(layouts: list, preset: str = "tiny", seed: int = 0, **variant: bool) -> Path:
    """The built-in ``preset`` (or its ``variant``: :func:`builtin_checkpoint`) in a shape every engine of
    the run loads: the preset itself where each layout (:class:`kvbench.core.kv_budget.KVLayout`) takes its
    head size, else the variant with the smallest head size they all take. ValueError when no head size
    suits them all."""
    natural = builtin_head_dim(preset)
    if all(layout.takes_head_size(natural) for layout in layouts):
        return builtin_checkpoint(preset, seed, **variant)
    for size in (32, 64, 128):
        if all(layout.takes_head_size(size) for layout in layouts):
            return builtin_checkpoint(preset, seed, head_dim=size, **variant)
    raise ValueError(f"no head size of 32, 64 or 128 is taken by every engine of the run: {layouts}")
