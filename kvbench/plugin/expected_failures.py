"""``--kvbench-expectations``: checks expected to fail per engine, settled as strict, pinned xfails that
excuse one assertion each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvbench.conformance.preconditions import precondition_held
from kvbench.conformance.verdict import UNDECIDED_PREFIX, PinScope, failure_message, is_undecided, pinned
from kvbench.plugin.conformance_records import PIN_PROPERTY, adapter_kind, check_id, one_line, skip_reason
from kvbench.plugin.session import KvbenchSession, engine_spec_of

_SCOPE_KEY = pytest.StashKey[PinScope]()
_PIN_KEY = pytest.StashKey["_Pin | None"]()


def _unmeasured(report: pytest.TestReport, e: Any) -> str:
    """A stale verdict's note when the entry needs a precondition the check never recorded (None: not measured, so
    it excuses nothing, and the stale verdict stands)."""
    needs = getattr(e, "needs", "")
    if needs and precondition_held(report.user_properties, needs) is None:
        return f" (the entry needs {needs}, which this check did not record)"
    return ""


@dataclass(frozen=True)
class _Pin:
    """The entry in force for one test, and the release it is outside of (``{package: version}``: the same
    finding reproducing on another release), empty when the entry's versions hold."""

    expectation: Any
    outside: dict[str, str]

    @property
    def where(self) -> str:
        e = self.expectation
        return f"{e.source} (engine {e.engine!r}, check {e.check!r})"

    def still_reproduces(self) -> str:
        on = ", ".join(f"{p} {v}" for p, v in self.outside.items())
        pinned_to = ", ".join(f"{p} {s}" for p, s in self.expectation.versions.items())
        return (f"still reproduces on {on} (the entry is pinned to {pinned_to}: widen its versions once traced on "
                f"this release)")


class ExpectedFailures:
    """Settles each conformance test an expectations entry names (engine kind or family, check id, the
    engine's versions) as a strict, pinned xfail.

    * While the test runs, the entry is its pin (:func:`kvbench.conformance.verdict.pinned`): a
      :func:`~kvbench.conformance.verdict.claim` whose message the entry's ``match`` finds is excused and
      the check goes on, so every later assertion still runs and can fail.
    * From the call's report: a pass with an excused claim, or a failure whose message ``match`` finds, is
      the expected failure; any other failure stays a failure, naming the entry it did not match (and the
      pinned failure, where it held too); a pass with nothing excused, or a skip (an undecided check
      included), fails saying the entry is stale.
    * An entry whose versions the engine's release is outside of still excuses the failure it pins, as
      "still reproduces on <release>", a finding of its own beside new failures.
    * An entry that ``needs`` a precondition (:mod:`kvbench.conformance.preconditions`) which the check recorded
      as not holding in its run was *not exercised*: neither expected nor stale, the check's own verdict stands
      (a claim it excused is a failure again), said in the summary and as the record's ``pin``. One the check
      never recorded excuses nothing: the entry is judged as any other, its stale report saying so.

    Registered only when ``--kvbench-expectations`` is given. Decided when the test runs, not at
    collection: the engine's family and versions are the adapter's to say (a server adapter asks its
    server), and the adapter exists only then."""

    def __init__(self, ks: KvbenchSession):
        self.ks = ks

    def _pin_for(self, item: pytest.Item) -> _Pin | None:
        from kvbench.conformance.expectations import matching, out_of_range

        spec = engine_spec_of(item)
        if spec is None or item.get_closest_marker("conformance") is None:
            return None
        adapter = getattr(item, "funcargs", {}).get("engine")
        if adapter is not None and callable(getattr(adapter, "family", None)):
            kind, version_of, family = adapter.kind, adapter.engine_version, adapter.family()
        else:
            kind, version_of, family = adapter_kind(self.ks, spec.name) or spec.kind, None, None
        found = matching(self.ks.expectations, kind, check_id(item), version_of, family)
        if found is not None:
            return _Pin(found, {})
        stale_release = out_of_range(self.ks.expectations, kind, check_id(item), version_of, family)
        return _Pin(*stale_release) if stale_release is not None else None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        pin = item.stash[_PIN_KEY] = self._pin_for(item)  # once per test: a server adapter asks its server
        with pinned(pin.expectation if pin is not None else None) as scope:
            item.stash[_SCOPE_KEY] = scope
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any):
        report = yield
        if report.when != "call" or hasattr(report, "wasxfail"):
            return report
        pin = item.stash[_PIN_KEY] if _PIN_KEY in item.stash else self._pin_for(item)
        if pin is None:
            return report
        scope = item.stash.get(_SCOPE_KEY, None)
        excused = scope.excused if scope is not None else []
        e = pin.expectation
        needs = getattr(e, "needs", "")
        if needs and precondition_held(report.user_properties, needs) is False:
            return self._not_exercised(report, item, pin, excused, call)
        if report.skipped and excused:
            # the pinned failure held, then the rest of the check could not decide: the finding reproduces, and
            # the rest is said (an undecided remainder is not a pass of the check)
            why = (skip_reason(report) or "no reason given").removeprefix(UNDECIDED_PREFIX)
            return self._expected(report, item, pin, f" (the rest of the check did not decide: {why})")
        if report.skipped:
            if pin.outside:  # a release the entry is not about: a skip there says nothing of the entry
                return report
            why = skip_reason(report) or "no reason given"
            word = "undecided" if is_undecided(why) else "skips"
            return self._stale(report, item, pin, f"now {word} ({why.removeprefix(UNDECIDED_PREFIX)})"
                               + _unmeasured(report, e))
        if report.passed and not excused:
            if pin.outside:  # fixed on a newer release, and the entry is not about it: a plain pass
                return report
            return self._stale(report, item, pin, "now passes" + _unmeasured(report, e))
        message = call.excinfo.exconly() if call.excinfo is not None else str(report.longrepr)
        if report.passed or (not excused and e.matches_failure(message)):
            return self._expected(report, item, pin, " (the rest of the check passed)" if excused else "")
        pinned_by = f"match {e.match!r}" if e.match else "no match pattern"
        if excused:
            headline = (f"[FAILED BEYOND ITS EXPECTED FAILURE] the failure pinned in {pin.where} held, and then: "
                        f"{one_line(message)}")
        else:
            headline = (f"[UNEXPECTED FAILURE] failed, but not as the expected failure in {pin.where} pins it "
                        f"({pinned_by}): {one_line(message)}")
        report.longrepr = f"{headline}\n\n{report.longreprtext}"
        self.ks.findings.append(f"UNEXPECTED FAILURE {item.nodeid}: "
                                + ("beyond the pinned failure of " if excused else "does not match ")
                                + f"{e.engine} / {e.check} ({pinned_by}) in {e.source}")
        return report

    def _expected(self, report: pytest.TestReport, item: pytest.Item, pin: _Pin, rest: str) -> pytest.TestReport:
        e = pin.expectation
        finding = pin.still_reproduces() if pin.outside else e.describe()
        report.outcome = "skipped"
        report.wasxfail = f"expected failure ({e.source}): {finding if pin.outside else e.reason}{rest}"
        label = "STILL REPRODUCES" if pin.outside else "expected failure"
        self.ks.findings.append(f"{label} {item.nodeid}: {finding}{rest}")
        return report

    def _not_exercised(self, report: pytest.TestReport, item: pytest.Item, pin: _Pin, excused: list[str],
                       call: Any) -> pytest.TestReport:
        """The entry's precondition did not hold in this run: the finding could not show, so the entry is neither
        stale nor an excuse, and the check's own verdict stands (a claim the entry excused before the precondition
        was known is a failure again)."""
        from kvbench.conformance.preconditions import describe

        e = pin.expectation
        why = (f"the expectation in {pin.where} needs {e.needs} ({describe(e.needs)}), which did not hold on this "
               "checkpoint/workload: not exercised, the check's own verdict stands")
        verdict = "failed" if report.failed or excused else report.outcome
        if report.skipped and not excused and is_undecided(skip_reason(report)):
            verdict = "undecided"
        report.user_properties.append((PIN_PROPERTY, {"state": "not_exercised", "source": e.source,
                                                      "engine": e.engine, "check": e.check, "needs": e.needs,
                                                      "reason": why}))
        self.ks.findings.append(f"NOT EXERCISED {item.nodeid}: {e.engine} / {e.check} needs {e.needs} "
                                f"({describe(e.needs)}), which did not hold on this checkpoint/workload; the check's "
                                f"own verdict stands: {verdict}")
        if excused:
            report.outcome = "failed"
            failure = call.excinfo.exconly() if call.excinfo is not None else ""
            report.longrepr = "\n".join([f"[PIN NOT EXERCISED] {why}; the claims it would have excused fail:",
                                          *(f"  {failure_message(m)}" for m in excused),
                                          *([f"  and then: {one_line(failure)}"] if failure else [])])
        # a plain failure keeps its own report, so its record's reason is the check's message (the pin is told apart)
        return report

    def _stale(self, report: pytest.TestReport, item: pytest.Item, pin: _Pin, now: str) -> pytest.TestReport:
        e = pin.expectation
        report.outcome = "failed"
        report.longrepr = f"[XPASS(strict)] {now}: the expectation is stale, remove it from {pin.where}"
        self.ks.findings.append(f"STALE {item.nodeid}: {now}: remove {e.engine} / {e.check} from {e.source}")
        return report
