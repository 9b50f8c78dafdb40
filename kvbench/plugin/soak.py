"""``--soak``: the long soak tests (suites/soak) run only when asked for."""

from __future__ import annotations

import pytest


class SoakGate:
    """Skips tests marked ``soak`` unless ``--soak`` was given: an option, not ``-m "not soak"`` in
    addopts, so a user's own ``-m`` expression neither re-enables nor is overridden by it."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.enabled:
            return
        skip = pytest.mark.skip(reason="soak test: run with --soak (and --soak-minutes)")
        for item in items:
            if item.get_closest_marker("soak") is not None:
                item.add_marker(skip)


def configure_soak(config: pytest.Config) -> None:
    """The ``soak`` marker, ``--soak-minutes`` checked, :class:`SoakGate` registered."""
    config.addinivalue_line("markers", "soak: a long soak run (runs only with --soak)")
    if config.getoption("soak_minutes") <= 0:
        raise pytest.UsageError(f"--soak-minutes must be > 0, got {config.getoption('soak_minutes')}")
    config.pluginmanager.register(SoakGate(config.getoption("soak")), "kvbench-soak-gate")
