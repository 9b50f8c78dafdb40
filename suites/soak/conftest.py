"""Fixtures of the soak suite (the ``--soak`` and ``--soak-minutes`` options are the kvbench plugin's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def soak_minutes(request: pytest.FixtureRequest) -> float:
    """``--soak-minutes``: how long the HTTP soak loads the server, in total over the preemption modes."""
    return float(request.config.getoption("soak_minutes"))
