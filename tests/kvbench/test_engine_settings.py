"""What each engine ran with: recorded per scenario result (``settings``: asked, confirmed, launch, version) and shown
side by side in the report's "Engine settings" (kvbench.bench.job_settings, kvbench.report.engine_settings)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import kvbench
from kvbench.bench import scenarios as sc
from kvbench.bench.job_settings import distinct, job_settings, redact_argv
from kvbench.bench.matched_knobs import stated
from kvbench.bench.results import Results
from kvbench.bench.workloads import Workload
from kvbench.core.requests import WorkloadRequest
from kvbench.engines.base import DEFAULT_KNOBS, Knobs
from kvbench.engines.inprocess.reference import ReferenceAdapter
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint
from kvbench.report import engine_settings
from kvbench.report.render import render_report

KNOBS = Knobs(block_size=16, num_gpu_blocks=8)
CACHING = KNOBS.merged(Knobs(enable_prefix_caching=True))
#: what the engines are given: the scenario's knobs and the behaviour every job states (kvbench.bench.matched_knobs)
ASKED, ASKED_CACHING = stated(KNOBS, None), stated(CACHING, None)
SECRET = "sekrit-4711"


def _workload(name: str) -> Workload:
    requests = [WorkloadRequest(f"{name}-{i}", [5, 6, 7, 8], 3, 0.0) for i in range(2)]
    return Workload(name, requests, None, {"name": name})


class TinySweep(sc.Scenario):
    """Two sweep points under one knob set and one entry under another (prefix caching on): seconds to serve."""

    name = "tiny_settings"
    sizes = {"quick": None}  # noqa: RUF012

    def plan(self, scale: str, model: sc.Model) -> list[sc.Job]:
        return [sc.Job(_workload("a"), KNOBS, x=1.0), sc.Job(_workload("b"), KNOBS, x=2.0),
                sc.Job(_workload("c"), CACHING, mode="pc")]

    def parameters(self, scale: str, model: sc.Model) -> dict[str, Any]:
        return {"scale": scale}

    def judge(self, served: list[sc.Served], scale: str, model: sc.Model) -> sc.Outcome:
        out = self.outcome(scale, model)
        out.entries = [sc.ResultEntry(served[-1].trace, "pc")]
        out.points = [sc.SweepPoint("x", "x", s.job.x or 0.0, s.metrics) for s in served[:2]]
        out.claims = {sc.common.SANITY_CLAIM: all(sc.all_finished(s.trace) for s in served)}
        return out


@pytest.fixture(scope="module")
def model() -> sc.Model:
    return sc.Model.from_dir(builtin_checkpoint("tiny"), "tiny")


def _recorded(adapter: Any, model: sc.Model) -> dict[str, Any]:
    outcome = sc.run(TinySweep(), adapter, model, "quick")
    assert not outcome.failures(), outcome.explain()
    results = Results()
    sc.record(outcome, results, adapter.describe())
    return results.scenarios[0]


# --------------------------------------------------------------------------------------------
# recording


def test_the_inprocess_reference_records_what_it_was_asked_and_what_its_config_resolves(model):
    recorded = _recorded(ReferenceAdapter(model.path), model)
    (entry,) = recorded["results"]
    settings = entry["settings"]
    assert settings["asked"] == ASKED_CACHING.as_dict()
    # the engine's own resolved configuration: what was asked, and what it fills in itself (max_model_len from
    # the model's positions, the defaults of what was not asked), never copied from what kvbench asked for
    confirmed = settings["confirmed"]
    assert {k: confirmed[k] for k in settings["asked"]} == settings["asked"]
    assert confirmed["max_model_len"] == 1024 and confirmed["scheduling_policy"] == "fcfs"
    assert "max_model_len" not in settings["asked"]
    assert "launch" not in settings  # no server was launched
    assert (settings["package"], settings["version"]) == ("kvbench", kvbench.__version__)
    # the two sweep jobs of one knob set are one record; the entry's job is the other
    assert [(s["engine"], s["modes"], s["asked"]) for s in recorded["settings"]] == [
        ("reference", [], ASKED.as_dict()), ("reference", ["pc"], ASKED_CACHING.as_dict())]
    json.dumps(recorded, allow_nan=False)  # plain JSON


def test_engines_served_in_lockstep_record_their_settings_too(model):
    adapters = {name: ReferenceAdapter(model.path, name=name) for name in ("a", "b")}
    assert all(a.steppable for a in adapters.values())  # two steppable engines: served in lockstep
    result = sc.run_interleaved(TinySweep(), adapters, model, "quick", step_seconds=0.01)
    results = Results()
    for name, outcome in result.items():
        assert isinstance(outcome, sc.Outcome), outcome
        sc.record(outcome, results, adapters[name].describe())
    (recorded,) = results.scenarios
    assert [(s["engine"], s["modes"]) for s in recorded["settings"]] == [("a", []), ("a", ["pc"]), ("b", []),
                                                                          ("b", ["pc"])]
    assert [r["settings"]["asked"] for r in recorded["results"]] == [ASKED_CACHING.as_dict()] * 2


class _StatesOther(ReferenceAdapter):
    """An engine that says it runs blocks of 32 whatever it is asked: recorded as it says."""

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        return {"block_size": 32}


class _CannotSay(ReferenceAdapter):
    """An engine whose settings cannot be read: the run still counts, its record has no ``confirmed``."""

    def confirmed_settings(self, knobs: Knobs = DEFAULT_KNOBS) -> dict[str, Any]:
        raise RuntimeError("the settings endpoint is down")


def test_confirmed_is_the_engines_word_and_an_unreadable_one_is_left_out(model):
    said = _recorded(_StatesOther(model.path), model)["results"][0]["settings"]
    assert said["asked"]["block_size"] == 16 and said["confirmed"] == {"block_size": 32}
    unread = _recorded(_CannotSay(model.path), model)["results"][0]["settings"]
    assert "confirmed" not in unread and unread["asked"]["block_size"] == 16


def test_distinct_keeps_each_knob_set_once_with_its_modes():
    a, b = {"asked": {"block_size": 16}}, {"asked": {"block_size": 32}}
    assert distinct([(None, a), ("x", a), ("y", b), ("x", dict(a)), (None, {})]) == [
        {**a, "modes": ["x"]}, {**b, "modes": ["y"]}]


def test_launch_commands_show_no_secret():
    argv = ["srv", "--api-key", SECRET, f"--token={SECRET}", f"--url=http://u:{SECRET}@h", "--port", "1"]
    shown = redact_argv(argv, [SECRET])
    assert SECRET not in " ".join(shown)
    assert shown[:4] == ["srv", "--api-key", "***", "--token=***"] and shown[-2:] == ["--port", "1"]
    assert redact_argv(["srv", "--api-key", "k"]) == ["srv", "--api-key", "***"]  # by the flag alone


@pytest.mark.server
def test_a_launched_reference_server_records_its_launch_and_its_own_word(model, tmp_path):
    adapter = make_adapter(parse_engine_spec(f"server:preset=reference,api_key={SECRET},log_dir={tmp_path},"
                                             f"args=--api-key {SECRET}"), model.path)
    try:
        recorded = _recorded(adapter, model)
        served_by = list(adapter.process.argv)
    finally:
        adapter.close()
    settings = recorded["results"][0]["settings"]
    assert settings["asked"] == ASKED_CACHING.as_dict()
    # the server's own labels: every knob, those kvbench left unset included (at the server's defaults)
    assert {k: settings["confirmed"][k] for k in ASKED_CACHING.as_dict()} == ASKED_CACHING.as_dict()
    assert settings["confirmed"]["max_num_seqs"] >= 1 and "max_num_seqs" not in settings["asked"]
    launch = settings["launch"]
    assert launch[launch.index("--port") + 1] == served_by[served_by.index("--port") + 1]  # the server that served
    assert {"--block-size", "--enable-prefix-caching"} <= set(launch) and launch[-2:] == ["--api-key", "***"]
    # (the engine's name still quotes its args= option: that is how the spec names it, outside these records)
    assert SECRET not in json.dumps([[s.pop("engine"), s][1] for s in recorded["settings"]])
    assert (settings["package"], settings["version"]) == ("kvbench", kvbench.__version__)
    # reading the settings started no server: one launch served all three jobs (the second knob set given in place)
    assert len(adapter.logs) == 1
    # a server that is gone says nothing: no launch, no confirmed, and still no new server
    gone = job_settings(adapter, KNOBS)
    assert "launch" not in gone and "confirmed" not in gone and len(adapter.logs) == 1


# --------------------------------------------------------------------------------------------
# the report


def _results(settings_by_engine: dict[str, dict[str, Any] | None], scenarios: tuple[str, ...] = ("storm",)) -> Results:
    results = Results()
    for name in scenarios:
        for engine, settings in settings_by_engine.items():
            entry = results.add_scenario_result(name, engine, {"output_throughput": 100.0})
            if settings is not None:
                entry["settings"] = settings
    return results


REFERENCE = {"asked": {"block_size": 16, "num_gpu_blocks": 8, "enable_prefix_caching": False},
             "confirmed": {}, "package": "kvbench", "version": "0.1.0", "dtype": "float32"}
VLLM = {"asked": {"block_size": 32, "num_gpu_blocks": 4, "enable_prefix_caching": True},
        "confirmed": {"block_size": 32, "num_gpu_blocks": 4, "enable_prefix_caching": True, "max_num_seqs": 256},
        "launch": ["vllm", "serve", "/m", "--port", "4000", "--api-key", "hidden-value"],
        "package": "vllm", "version": "0.11.0"}


def _rows(table: dict[str, Any]) -> dict[str, tuple[list[str], str]]:
    return {r["label"]: ([c["text"] for c in r["cells"]], r["flag"]) for r in table["rows"]}


def _section(html: str) -> str:
    start = html.index('<section id="engine-settings">')
    return html[start:html.index("</section>", start)]


def test_rows_that_engines_ran_differently_are_flagged_not_matched():
    view = engine_settings.section(_results({"reference": REFERENCE, "vllm": VLLM}))
    (table,) = view["tables"]
    assert table["columns"] == ["reference", "vllm"]
    rows = _rows(table)
    # each engine's own block granularity differs by design: what is matched is the pool in tokens
    assert rows["block size (tokens)"] == (["16", "32"], "")
    assert rows["prefix caching"] == (["off", "on"], "not matched")
    assert rows["KV pool (tokens)"] == (["128", "128"], "")  # the same pool in tokens: matched
    # kvbench left max_num_seqs unset: the reference does not say what it runs, vLLM states its default
    assert rows["max_num_seqs"] == (["not stated", "256 (default)"], "")
    assert rows["dtype"] == (["float32", "not stated"], "")
    assert table["unmatched"] == ["prefix caching"]
    reference, vllm = table["engines"]
    assert reference["launch"] == "not stated" and vllm["launch"].endswith("--api-key '***'")
    assert (reference["version"], vllm["version"]) == ("kvbench 0.1.0", "vllm 0.11.0")


def test_asked_and_confirmed_that_differ_show_both_and_same_settings_show_one_table():
    lying = {"asked": {"block_size": 16}, "confirmed": {"block_size": 32}}
    view = engine_settings.section(_results({"a": lying, "b": {"asked": {"block_size": 16}}}, ("one", "two")))
    (table,) = view["tables"]  # both scenarios ran the same settings: shown once
    assert table["title"] == "Every scenario (2)"
    # a ran 32 by its own word, b was asked 16 and states nothing: shown both ways (its own granularity, so the
    # row itself is not flagged; a pool of other tokens would be)
    assert _rows(table)["block size (tokens)"] == (["16 / 32", "16"], "")
    matched = engine_settings.section(_results({"a": {"asked": {"block_size": 16}, "confirmed": {"block_size": 16}},
                                                "b": {"asked": {"block_size": 16}}}))
    assert _rows(matched["tables"][0])["block size (tokens)"] == (["16", "16"], "")
    apart = _results({"a": lying}, ("one",))
    apart.add_scenario_result("two", "a", {"output_throughput": 1.0})["settings"] = {"asked": {"block_size": 32}}
    assert [t["title"] for t in engine_settings.section(apart)["tables"]] == ["One", "Two"]  # each its own
    part = _section(render_report(apart))  # several tables fold under one line: the section adds no screens
    assert part.count('<details class="sbs">') == 3 and "One table per scenario (2)" in part
    assert "0 with settings not matched" in part and " open" not in part  # one engine: nothing to match


def test_the_section_renders_collapsed_with_not_stated_for_what_is_missing():
    html = render_report(_results({"reference": REFERENCE, "vllm": VLLM}))
    part = _section(html)
    assert '<details class="sbs">' in part and "<details class=\"sbs\" open" not in part  # collapsed
    assert "not matched" in part and "not stated" in part and "256 (default)" in part
    # a credential flag's value is not shown (recording already hid it; this file was written by hand)
    assert "hidden-value" not in part and "--api-key &#39;***&#39;" in part
    assert 'href="#engine-settings"' in html


def test_an_old_results_file_without_settings_still_renders():
    html = render_report(_results({"reference": None, "vllm": None}))
    assert 'id="engine-settings"' not in html and "Engines side by side" in html
    partly = Results()
    partly.add_scenario_result("old", "reference", {"output_throughput": 1.0})
    partly.add_scenario_result("new", "reference", {"output_throughput": 1.0})["settings"] = REFERENCE
    part = _section(render_report(Results.from_dict(json.loads(json.dumps(partly.data)))))
    assert "No settings recorded for: Old" in part


def test_engine_text_in_a_setting_is_escaped():
    evil = "<script>alert(1)</script>"
    settings = {"asked": {"scheduling_policy": "fcfs"}, "confirmed": {"scheduling_policy": evil},
                "launch": ["srv", evil], "package": evil, "version": "1"}
    html = render_report(_results({"x": settings}))
    part = _section(html)
    assert "<script>" not in part and "&lt;script&gt;alert(1)&lt;/script&gt;" in part
    assert len(re.findall(r"<script>alert", html)) == 0


def test_a_pool_of_other_tokens_is_not_matched_though_each_block_size_is_the_engines_own():
    smaller = {**VLLM, "asked": {**VLLM["asked"], "num_gpu_blocks": 2}, "confirmed": {}}  # 64 tokens against 128
    (table,) = engine_settings.section(_results({"reference": REFERENCE, "vllm": smaller}))["tables"]
    rows = _rows(table)
    assert rows["KV pool (tokens)"] == (["128", "64"], "not matched")
    assert rows["block size (tokens)"][1] == "" and rows["KV pool (blocks)"][1] == ""
