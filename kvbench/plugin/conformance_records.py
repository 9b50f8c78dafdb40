"""Conformance results as data: each conformance test's identity (engine, check), what it proved
(``prove()``'s counters, the engine options its knobs overrode, near-ties) on its ``user_properties``,
and the record its reports settle (:func:`conformance_record`), kept by :class:`ConformanceRecorder`
and written into ``results.json`` under ``"conformance"``. A run that decided nothing for an engine is
not green."""

from __future__ import annotations

from typing import Any

import pytest

from kvbench.conformance.verdict import UNDECIDED_PREFIX
from kvbench.core.evidence import collecting, evidence_of, proven_of
from kvbench.engines.registry import EngineSpecError, adapter_class
from kvbench.plugin.session import SESSION_KEY, KvbenchSession, engine_spec_of, is_simulator

ENGINE_PROPERTY, CHECK_PROPERTY = "kvbench.engine", "kvbench.check"
OVERRIDES_PROPERTY, NEAR_TIES_PROPERTY = "kvbench.knob_overrides", "kvbench.near_ties"
#: whether the check puts the engine under pressure (``@pytest.mark.conformance(pressured=False)`` says not)
PRESSURED_PROPERTY = "kvbench.pressured"
#: a pin's state where it is neither expected nor stale (``{"state": "not_exercised", ...}``: its precondition did not
#: hold, :mod:`kvbench.plugin.expected_failures`), carried to the record as ``pin``
PIN_PROPERTY = "kvbench.pin"


def check_id(item: pytest.Item) -> str:
    """The check a conformance test is: ``@pytest.mark.conformance(check="...")`` if given, else the test
    function's name without ``test_``; parameters other than the engine follow in brackets
    (``chunked_prefill_equivalence[16]``), so each variant is its own row of the engine x check matrix."""
    marker = item.get_closest_marker("conformance")
    name = (marker.kwargs.get("check") if marker is not None else None) or \
        getattr(item, "originalname", item.name).removeprefix("test_")
    callspec = getattr(item, "callspec", None)
    params = [v for k, v in (callspec.params.items() if callspec is not None else ()) if k != "engine_spec"]
    return f"{name}[{'-'.join(map(str, params))}]" if params else name


def properties_of(item: pytest.Item | pytest.TestReport) -> dict[str, Any]:
    return {name: value for name, value in item.user_properties if isinstance(name, str)}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Collect what a conformance test proved (prove()'s counters, overridden options) on its item."""
    if CHECK_PROPERTY not in properties_of(item):
        return (yield)
    with collecting(item.user_properties) as collector:
        item.stash[_COLLECTOR_KEY] = collector
        return (yield)


_COLLECTOR_KEY = pytest.StashKey[Any]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    ks = item.config.stash.get(SESSION_KEY, None)
    collector = item.stash.get(_COLLECTOR_KEY, None)
    near_ties_before = len(ks.near_ties) if ks is not None else 0
    try:
        return (yield)
    finally:
        # the call's report is made after this returns, so these reach it (and --junitxml, and xdist)
        if collector is not None:
            item.user_properties.append((OVERRIDES_PROPERTY, {k: list(v) for k, v in
                                                              collector.knob_overrides.items()}))
            item.user_properties.append((NEAR_TIES_PROPERTY,
                                         len(ks.near_ties) - near_ties_before if ks is not None else 0))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An engine that cannot be had mid-run (a server refusing kvbench's credential: ``CredentialError``)
    is one message, not a traceback per check: the test of that engine fails with the message alone and
    the session stops, since every later one would fail the same way."""
    from kvbench.engines.base import EngineUnavailable

    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if report.failed and isinstance(error, EngineUnavailable) and engine_spec_of(item) is not None:
        report.longrepr = f"{type(error).__name__}: {error}"
        item.session.shouldfail = f"{type(error).__name__}: {error}"
    return report


#: the longest reason a record keeps: long enough for the figures at the end of a failure message with a long
#: engine name (a spec with its options and log folder), which a shorter cut lost
REASON_LIMIT = 1000


def one_line(text: str, limit: int = REASON_LIMIT) -> str:
    """The first non-blank line of ``text``, cut at ``limit`` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def skip_reason(report: pytest.TestReport) -> str | None:
    """A report's reason in one line: a skip's without pytest's ``Skipped:``, a failure's crash message."""
    longrepr = report.longrepr
    if longrepr is None:
        return None
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, "Skipped: why")
        return one_line(str(longrepr[2]).removeprefix("Skipped: "))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return one_line(crash.message)
    return one_line(str(longrepr))


def _outcome(report: pytest.TestReport) -> tuple[str, str | None] | None:
    """(outcome, reason) this phase settles, or None when it settles nothing (a passed setup/teardown)."""
    xfail_reason = getattr(report, "wasxfail", None)
    if report.when == "teardown":
        return ("error", skip_reason(report)) if report.failed else None
    if report.when == "setup" and report.passed:
        return None
    if report.passed:
        return ("xpassed", f"XPASS: {xfail_reason}".rstrip(": ")) if xfail_reason is not None else ("passed", None)
    if report.skipped:
        if xfail_reason is not None:
            return "xfailed", xfail_reason or None
        reason = skip_reason(report)
        if reason is not None and reason.startswith(UNDECIDED_PREFIX):
            return "undecided", reason.removeprefix(UNDECIDED_PREFIX)
        return "skipped", reason
    if report.when == "setup":
        return "error", skip_reason(report)
    if str(report.longrepr).startswith("[XPASS(strict)]"):  # an expected failure that now passes
        return "xpassed", one_line(str(report.longrepr))
    return "failed", skip_reason(report)


def conformance_record(report: pytest.TestReport, kind: str | None) -> dict[str, Any] | None:
    """The results.json record this report settles (schema: kvbench.bench.results), or None."""
    props = properties_of(report)
    if CHECK_PROPERTY not in props:
        return None
    settled = _outcome(report)
    if settled is None:
        return None
    return {"engine": props[ENGINE_PROPERTY], "kind": kind, "check": props[CHECK_PROPERTY], "nodeid": report.nodeid,
            "outcome": settled[0], "evidence": evidence_of(report.user_properties),
            "proven": proven_of(report.user_properties), "pressured": bool(props.get(PRESSURED_PROPERTY, True)),
            "near_ties": int(props.get(NEAR_TIES_PROPERTY, 0)), "reason": settled[1],
            "knob_overrides": dict(props.get(OVERRIDES_PROPERTY) or {}),
            **({"pin": props[PIN_PROPERTY]} if PIN_PROPERTY in props else {})}


def adapter_kind(ks: KvbenchSession, engine: str) -> str | None:
    spec = next((s for s in ks.engine_specs if s.name == engine), None)
    if spec is None:
        return None
    try:
        return adapter_class(spec.kind).kind or spec.kind
    except EngineSpecError:
        return spec.kind


class ConformanceRecorder:
    """Keeps each conformance test's outcome in the session, from its reports (registered in
    ``pytest_configure``; on an xdist controller too, since reports carry the properties)."""

    def __init__(self, ks: KvbenchSession):
        self.ks = ks

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if CHECK_PROPERTY not in properties_of(report):
            return
        record = conformance_record(report, adapter_kind(self.ks, properties_of(report)[ENGINE_PROPERTY]))
        if record is None:
            return
        earlier = self.ks.conformance.get(report.nodeid)
        if earlier is not None and report.when == "teardown":
            # a teardown error after a settled call: keep what the call proved, say both
            record["evidence"] = earlier["evidence"] or record["evidence"]
            record["knob_overrides"] = earlier["knob_overrides"] or record["knob_overrides"]
            record["reason"] = f"teardown error after {earlier['outcome']}: {record['reason']}"
        self.ks.conformance[report.nodeid] = record


def add_conformance_to_results(ks: KvbenchSession) -> None:
    """The session's conformance records, and the engines they name, into the run's results."""
    if not ks.conformance:
        return
    results = ks.get_results()
    for spec in ks.engine_specs:
        if spec.name in {r["engine"] for r in ks.conformance.values()} and results.engine(spec.name) is None:
            try:
                cls = adapter_class(spec.kind)
                kind, capabilities = cls.kind or spec.kind, sorted(cls.capabilities)
            except EngineSpecError:
                kind, capabilities = spec.kind, []
            results.add_engine({"name": spec.name, "kind": kind, "options": spec.public_options,
                                "capabilities": capabilities})
    for record in ks.conformance.values():
        results.add_conformance(record)


#: outcomes that decided a check (a pin's expected failure decides it too: the rest of the check ran)
DECIDED = ("passed", "failed", "xfailed", "xpassed", "error")


def undecided_engines(ks: KvbenchSession) -> dict[str, list[dict[str, Any]]]:
    """Engines whose run is not green for want of proof (*decided means proven*): no pressured check
    passed (or failed only as pinned) with its mechanism proven. Judged over the pressured checks the run
    selected; a run that selected none (``-k bad_input``) is judged over all it ran, and then only
    fails when every one was skipped or undecided. Simulators are left out: they are skipped by design
    (placeholder tokens prove nothing)."""
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for record in ks.conformance.values():
        by_engine.setdefault(record["engine"], []).append(record)
    simulated = {s.name for s in ks.engine_specs if is_simulator(s)}
    out = {}
    for engine, records in by_engine.items():
        if engine in simulated:
            continue
        pressured = [r for r in records if r.get("pressured", True)]
        if pressured:
            if not any(r["outcome"] in ("passed", "xfailed") and r.get("proven") for r in pressured):
                out[engine] = records
        elif not any(r["outcome"] in DECIDED for r in records):
            out[engine] = records
    return out


def undecided_message(engine: str, records: list[dict[str, Any]]) -> str:
    """Why the run is not green for ``engine``: what it decided, and the most common reasons it did not."""
    decided = [r for r in records if r["outcome"] in DECIDED]
    pressured = [r for r in records if r.get("pressured", True)]
    reasons: dict[str, int] = {}
    for record in records:
        if record["outcome"] in DECIDED:
            continue
        why = f"{record['outcome']}: {record['reason'] or 'no reason given'}"
        reasons[why] = reasons.get(why, 0) + 1
    common = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
    if not decided:
        head = (f"no conformance check was decided for {engine}: all {len(records)} skipped or undecided, so this "
                "run proves nothing about it (a run that decided nothing is not green).")
    else:
        head = (f"no check under pressure proved its mechanism on {engine}: {len(decided)} of {len(records)} checks "
                f"decided ({', '.join(sorted({r['check'] for r in decided})[:6])}), but of its {len(pressured)} "
                "pressured checks none passed with the mechanism it is about proven to fire, so this run "
                "proves nothing about preemption (decided means proven).")
    return "\n".join([head, "Not decided:" if common else "", *(f"  {n} x {reason}" for reason, n in common)])


def conformance_summary(tr: Any, ks: KvbenchSession) -> None:
    tr.section("kvbench conformance")
    by_engine: dict[str, dict[str, int]] = {}
    for record in ks.conformance.values():
        counts = by_engine.setdefault(record["engine"], {})
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    given = [spec.name for spec in ks.engine_specs]  # the order of --engine, however the tests ran (xdist)
    order = {name: i for i, name in enumerate(given)}
    for engine, counts in sorted(by_engine.items(), key=lambda kv: order.get(kv[0], len(given))):
        near = sum(r["near_ties"] for r in ks.conformance.values() if r["engine"] == engine)
        tr.write_line(f"{engine}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
                      + (f" ({near} near-ties)" if near else ""))
    for engine in undecided_engines(ks):
        tr.write_line(f"{engine}: NOTHING PROVEN: no pressured check passed with its mechanism proven, so the run "
                      f"fails (see kvbench::undecided[{engine}])", red=True)
    overridden: dict[tuple[str, str, str], list[str]] = {}
    for record in ks.conformance.values():
        for knob, (given, used) in record["knob_overrides"].items():
            overridden.setdefault((record["engine"], knob, str(given)), []).append(f"{record['check']} ({used})")
    for (engine, knob, given), checks in overridden.items():
        tr.write_line(f"{engine}: the checks' knob {knob} replaced the option value {given} in {len(checks)} "
                      f"check(s): {', '.join(checks)}", yellow=True)
    if ks.results_path is not None:
        tr.write_line(f"conformance results: {ks.results_path} (key \"conformance\")")

