"""Where kvbench keeps what it makes once per machine and reuses from any checkout: the built-in
checkpoints and the real peers' environments."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVBENCH_CACHE``, by default ``~/.cache/kvbench``: one per machine (and user), shared by every clone."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench")
