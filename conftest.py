"""Root conftest. The kvbench plugin is loaded through its ``pytest11`` entry point once the project
is installed (``pip install -e .``); this makes the suites in this checkout work even before that."""

from __future__ import annotations

import importlib.metadata

_installed = any(ep.value == "kvbench.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
if not _installed:
    pytest_plugins = ["kvbench.plugin"]
