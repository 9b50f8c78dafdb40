"""``--kvbench-expectations``: checks expected to fail per engine, settled as strict, pinned xfails."""

from __future__ import annotations

from typing import Any

import pytest

from kvbench.plugin.conformance_records import adapter_kind, check_id, one_line
from kvbench.plugin.session import KvbenchSession, engine_spec_of


class ExpectedFailures:
    """Settles each conformance test an expectations entry names (engine kind or family, check id,
    the engine's versions) as a strict, pinned xfail, from its call report: a failure whose message
    the entry's ``match`` finds is the expected failure; any other failure stays a failure, saying
    which entry it did not match; a pass is a failure saying the entry is stale. Keeps the findings
    for the terminal summary. Registered only when ``--kvbench-expectations`` is given.

    Decided when the test has run, not at collection: the engine's family and versions are the
    adapter's to say (a server adapter asks its server), and the adapter exists only then."""

    def __init__(self, ks: KvbenchSession):
        self.ks = ks

    def _expectation_for(self, item: pytest.Item) -> Any:
        from kvbench.conformance.expectations import matching

        spec = engine_spec_of(item)
        if spec is None or item.get_closest_marker("conformance") is None:
            return None
        adapter = getattr(item, "funcargs", {}).get("engine")
        if adapter is not None and callable(getattr(adapter, "family", None)):
            return matching(self.ks.expectations, adapter.kind, check_id(item), adapter.engine_version,
                            adapter.family())
        return matching(self.ks.expectations, adapter_kind(self.ks, spec.name) or spec.kind, check_id(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any):
        report = yield
        if report.when != "call" or report.skipped or hasattr(report, "wasxfail"):
            return report
        expectation = self._expectation_for(item)
        if expectation is None:
            return report
        where = f"{expectation.source} (engine {expectation.engine!r}, check {expectation.check!r})"
        if report.passed:
            report.outcome = "failed"
            report.longrepr = f"[XPASS(strict)] now passes: the expectation is stale, remove it from {where}"
            self.ks.findings.append(f"NOW PASSES {item.nodeid}: the expectation is stale: remove {expectation.engine}"
                                    f" / {expectation.check} from {expectation.source}")
            return report
        message = call.excinfo.exconly() if call.excinfo is not None else str(report.longrepr)
        if expectation.matches_failure(message):
            report.outcome = "skipped"
            report.wasxfail = f"expected failure ({expectation.source}): {expectation.reason}"
            self.ks.findings.append(f"expected failure {item.nodeid}: {expectation.describe()}")
            return report
        pinned = f"match {expectation.match!r}" if expectation.match else "no match pattern"
        headline = (f"[UNEXPECTED FAILURE] failed, but not as the expected failure in {where} pins it ({pinned}): "
                    f"{one_line(message)}")
        report.longrepr = f"{headline}\n\n{report.longreprtext}"
        self.ks.findings.append(f"UNEXPECTED FAILURE {item.nodeid}: does not match {expectation.engine} / "
                                f"{expectation.check} ({pinned}) in {expectation.source}")
        return report

