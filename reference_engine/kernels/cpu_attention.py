"""Compiled paged decode attention for the CPU (``attention_backend="cpp"``): one C++ function,
``csrc/paged_decode.cpp``, built on first use with torch's C++ extension tooling.

Why it exists: on CPU the torch path (:func:`reference_engine.attention.paged_attention`) first gathers every
sequence's blocks into a padded copy and then runs SDPA over the copy. That gather is a memory-bound copy of
the whole batch's K and V per layer, and at a large decode batch it took more time than the attention itself
(the profile: docs/journal/reference-engine.md, "The compiled decode kernel"). The kernel reads K
and V in place through the block table, once each, and does the same float32 math (scores, max-subtracted
softmax, weighted sum of values). Prefills and prefill chunks stay on the torch path; the torch path stays the
oracle, and the tests hold the kernel to it (``tests/engine/test_cpu_attention.py``).

The build needs a C++ compiler and ninja (both on the machines this project runs on); it takes tens of
seconds once, then torch caches it (:mod:`reference_engine.kernels.cpu_build`).
:func:`cpu_kernel_available` says whether it built; ``attention_backend="auto"`` uses it on CPU when it
did and the sliced torch path when it did not, after one warning naming the reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from reference_engine.kernels import cpu_build

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_PREFIX = "reference_engine_paged_decode"
# -ffast-math lets the compiler vectorise the dot products' sums and exp; it is a compile flag only (not
# passed to the link, which could set flush-to-zero for the whole process: a test checks it does not).
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
#: the kernel, built on first use; tests point its ``source`` elsewhere or set its ``error``
EXTENSION = cpu_build.LazyExtension(_SOURCE, _PREFIX, _CFLAGS, "the CPU attention kernel")


def _load() -> Any:
    """The compiled module, built on the first call; RuntimeError naming why it cannot be built."""
    return EXTENSION.load()


def _build_source() -> tuple[str, Path]:
    """The extension's name and the copy of its source it is built from
    (:func:`~reference_engine.kernels.cpu_build.content_addressed_source`)."""
    return EXTENSION.content_addressed_source()


def cpu_kernel_available() -> bool:
    """True when the kernel is built (building it now if it has not been tried in this process)."""
    try:
        _load()
    except RuntimeError as exc:
        _log.warning("%s; decode attention uses the sliced torch path instead", exc)
        return False
    return True


def why_unavailable() -> str:
    """Why the kernel could not be built ("" when it was, or has not been tried)."""
    return EXTENSION.error or ""


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor) -> torch.Tensor:
    """Decode attention, one query per sequence, read through the block table.

    q: [B, Hq, D] in the cache's dtype; kv_cache: [num_blocks, num_layers, 2, block_size, Hkv, D],
    contiguous; block_tables: [B, max_blocks] int64 (entries past a sequence's length are not read);
    seq_lens: [B] int64, keys each sequence attends to (>= 1). Returns [B, Hq, D] in q's dtype: what the
    torch path's decode group returns, within float32 rounding (tested).
    """
    module = EXTENSION.module or _load()  # built once; no lock per call on the decode path (every layer, every step)
    return module.paged_decode(q.to(kv_cache.dtype), kv_cache, layer, block_tables, seq_lens).to(q.dtype)
