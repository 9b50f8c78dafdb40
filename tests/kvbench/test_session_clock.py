"""One clock per session: a session whose engines cannot all be stepped runs every engine on the wall
clock; a session of steppable engines stays on the step clock (kvbench.bench.clock_rule)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbench.bench.clock_rule import RULE, session_clock
from kvbench.bench.scenarios.common import STEP_SECONDS
from kvbench.engines.registry import parse_engine_spec
from tests.kvbench.test_gate_interleave import TwoJobs, _Item, _no_bar, _scheduler


def test_the_rule_puts_everyone_on_the_wall_clock_when_one_engine_cannot_be_stepped():
    rule = session_clock({"reference": True, "reference:preemption_mode=swap": True, "hf-cb": False}, 0.01)
    assert rule.clock == "wall" and rule.step_seconds is None and rule.not_steppable == ("hf-cb",)
    assert "hf-cb cannot be stepped" in rule.why
    stepped = session_clock({"reference": True, "reference:preemption_mode=swap": True}, 0.01)
    assert stepped.clock == "step" and stepped.step_seconds == 0.01 and not stepped.not_steppable
    assert stepped.to_dict()["rule"] == RULE and rule.to_dict()["not_steppable"] == ["hf-cb"]
    with pytest.raises(ValueError, match="at least one engine"):
        session_clock({}, 0.01)
    with pytest.raises(ValueError, match="step_seconds"):
        session_clock({"reference": True}, 0)


def _serve_all(monkeypatch, names: list[str]):
    specs = [parse_engine_spec(n) for n in names]
    log: list[str] = []
    scheduler = _scheduler(monkeypatch, log, specs)
    session = SimpleNamespace(items=[])
    session.items = [_Item(s, session) for s in specs]
    # the fakes declare themselves steppable as the reference engine does; hf-cb's fake does not
    for s in specs:
        scheduler.adapter(s).steppable = s.kind != "hf-cb"
    outcomes = [scheduler.outcome(item, spec, TwoJobs(), _no_bar) for item, spec in zip(session.items, specs,
                                                                                         strict=True)]
    return scheduler, outcomes


def test_a_session_of_step_and_wall_engines_runs_all_on_the_wall_clock(monkeypatch):
    scheduler, outcomes = _serve_all(monkeypatch, ["reference", "reference:preemption_mode=swap", "hf-cb"])
    assert scheduler.clock.clock == "wall"
    # the in-process engines too: no step clock anywhere, every trace timed and released on the wall
    assert [o.step_seconds for o in outcomes] == [None, None, None]
    assert all(e.trace.step_seconds is None for o in outcomes for e in o.entries)


def test_a_step_only_session_stays_on_the_step_clock(monkeypatch):
    scheduler, outcomes = _serve_all(monkeypatch, ["reference", "reference:preemption_mode=swap"])
    assert scheduler.clock.clock == "step"
    assert [o.step_seconds for o in outcomes] == [STEP_SECONDS["quick"]] * 2
    assert all(e.trace.step_seconds == STEP_SECONDS["quick"] for o in outcomes for e in o.entries)


def test_results_name_the_workload_served_and_the_machine_load_of_each_repeat(monkeypatch):
    """What lets the report find one workload measured twice (``workload_key``) and show why such
    measurements differ (each repeat's ``machine_load_1min``)."""
    import kvbench.bench.scenarios.common as common
    from kvbench.bench.results import Results
    from tests.kvbench.test_gate_interleave import MODEL, FakeAdapter

    loads = iter([0.5, 3.5, 1.0])
    monkeypatch.setattr(common, "machine_load", lambda: next(loads))
    outcome = common.run(TwoJobs(), FakeAdapter("A", []), MODEL, "quick", repeats=2)
    results = Results()
    common.record(outcome, results, {"name": "A", "kind": "fake"})
    job1, job2 = results.scenario("two_jobs")["results"]
    # the two jobs serve the same requests (ids aside) under the same knobs: one workload, one key
    assert job1["workload_key"] == job2["workload_key"] and len(job1["workload_key"]) == 16
    assert [r["machine_load_1min"] for r in job1["repeats"]] == [0.5, 3.5]
    # the same job served again elsewhere carries the same key
    again = common.run(TwoJobs(), FakeAdapter("A", []), MODEL, "quick", repeats=1)
    assert again.job_keys[id(again.entries[0].trace)] == job1["workload_key"]
    # other knobs: another key
    from dataclasses import replace

    from kvbench.engines.base import DEFAULT_KNOBS

    job = TwoJobs().plan("quick", MODEL)[0]
    assert common.job_key(replace(job, knobs=replace(DEFAULT_KNOBS, max_num_seqs=2))) != common.job_key(job)


def test_a_baseline_on_another_clock_is_not_compared_and_not_picked_by_default(tmp_path):
    """A run from before the one-clock rule (reference on the step clock) against today's (all on the wall):
    its cells say "not compared", no regression is claimed across the clocks, and a later run does not pick
    it as its previous run."""
    from kvbench.bench.results import Results
    from kvbench.report.render import baseline_section, previous_run

    def run(created: str, clock: str, tp: float) -> Results:
        res = Results()
        res.data["created"] = created
        for engine in ("reference", "hf-cb"):
            res.add_engine({"name": engine, "kind": engine})
            res.add_scenario_result("flash_crowd", engine, {"output_throughput": tp if engine == "hf-cb" else 100.0},
                                    clock={"clock": clock if engine == "reference" else "wall"},
                                    parameters={"scale": "quick"})
        return res

    before, now = run("2026-01-01", "step", 1000.0), run("2026-01-02", "wall", 100.0)
    section = baseline_section(now, before)  # hf-cb's throughput ÷ the reference's fell tenfold, across clocks
    assert not section["regressions"] and "flash_crowd / hf-cb" in section["not_compared"]
    # the same tenfold drop on one clock is a regression
    assert baseline_section(now, run("2026-01-01", "wall", 1000.0))["regressions"]
    for name, res in (("a", before), ("b", now)):
        res.save(tmp_path / name / "results.json")
    assert previous_run(tmp_path, now, exclude=tmp_path / "b") is None
