"""Building the engine's C++ sources for the CPU with torch's extension tooling (``csrc/``).

One source file, one extension, built on first use and cached by torch (``$TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``): tens of seconds once, then well under a second per process.
Used by :mod:`reference_engine.kernels.cpu_attention` (paged decode attention) and
:mod:`reference_engine.kernels.cpu_elementwise` (fused RMSNorm and SwiGLU).

Each build is made from a copy of its source in a folder named by a digest of the source, the flags, torch and
Python (:func:`content_addressed_source`), not from the checkout's file: the build command names the source's
path, so two checkouts of one version building from their own paths changed ninja's command each time and
rebuilt over each other's build, a server waiting on each rebuild. Content-addressed, the copy is written once
and never changes, so every checkout of one version shares one build and checkouts of different versions keep
theirs.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def content_addressed_source(source: Path, prefix: str, cflags: Sequence[str]) -> tuple[str, Path]:
    """The extension's name (``prefix`` and a digest) and the copy of ``source`` it is built from."""
    data = source.read_bytes()
    # the torch and Python it links against are part of what is built (torch's own default folder is per
    # Python and build); a peer's environment with another torch gets a build of its own
    built_for = f"{' '.join(cflags)} torch {torch.__version__} python {sys.version_info[:2]}"
    digest = hashlib.sha256(data + built_for.encode()).hexdigest()[:12]
    name = f"{prefix}_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / source.name
    if not copy.is_file() or copy.read_bytes() != data:  # rewritten only when absent or torn
        partial = folder / f".{source.name}.{os.getpid()}"
        partial.write_bytes(data)
        os.replace(partial, copy)  # atomic: a concurrent build sees the whole file or none
    return name, copy


def build(source: Path, prefix: str, cflags: Sequence[str], ldflags: Sequence[str] = ()) -> Any:
    """The compiled module of ``source``, built now if torch's cache has no build of this version.
    Raises whatever the build raises (no compiler, no ninja, a compile error)."""
    from torch.utils.cpp_extension import load

    name, copy = content_addressed_source(source, prefix, cflags)
    return load(name=name, sources=[str(copy)], build_directory=str(copy.parent), extra_cflags=list(cflags),
                extra_ldflags=list(ldflags), verbose=False)


class LazyExtension:
    """One C++ source, built on the first :meth:`load` and kept (serialised across threads; torch's own
    lock serialises builds across processes). A build that fails is not tried again in this process:
    ``error`` says why, and every later :meth:`load` raises it."""

    def __init__(self, source: Path, prefix: str, cflags: Sequence[str], what: str):
        """``what``: the kernel's name in messages ("the CPU attention kernel")."""
        self.source, self.prefix, self.cflags, self.what = source, prefix, tuple(cflags), what
        self.module: Any = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> Any:
        """The compiled module; RuntimeError naming why it cannot be built."""
        with self._lock:
            if self.module is not None:
                return self.module
            if self.error is not None:
                raise RuntimeError(self.error)
            try:
                self.module = build(self.source, self.prefix, self.cflags, ["-fopenmp"])
            except Exception as exc:  # no compiler, no ninja, a build error: the torch paths still work
                self.error = f"{self.what} could not be built ({type(exc).__name__}: {str(exc)[:300]})"
                raise RuntimeError(self.error) from exc
            return self.module

    def content_addressed_source(self) -> tuple[str, Path]:
        """The extension's name and the copy of its source it is built from."""
        return content_addressed_source(self.source, self.prefix, self.cflags)
