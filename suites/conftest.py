"""What every suite shares: a test run on an engine whose adapter launches a server (``server:...``, or any
subclass of :class:`~kvbench.engines.http.server.ServerAdapter`) starts one, so it carries the ``server``
marker, as the project's own server tests do: ``pytest -m "not server"`` leaves every one of them out."""

from __future__ import annotations

import pytest

from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.registry import EngineSpecError, adapter_class
from kvbench.plugin.session import engine_spec_of


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    launches: dict[str, bool] = {}  # engine kind -> whether its adapter launches a server
    for item in items:
        spec = engine_spec_of(item)
        if spec is None:
            continue
        if spec.kind not in launches:
            try:
                launches[spec.kind] = issubclass(adapter_class(spec.kind), ServerAdapter)
            except EngineSpecError:  # the plugin has refused the spec already, naming it
                launches[spec.kind] = False
        if launches[spec.kind]:
            item.add_marker(pytest.mark.server)
