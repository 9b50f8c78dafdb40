"""Values made JSON-safe, the one way every file kvbench writes (results, capacity plans, workload specs)
does it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def jsonable(value: Any) -> Any:
    """Floats that JSON cannot hold (NaN, inf) become None; tuples become lists; mapping keys, strings;
    numpy scalars, Python numbers; anything else, its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item"):  # numpy scalar
        return jsonable(value.item())
    return str(value)
