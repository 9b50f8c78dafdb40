"""The results schema: build, save, load, validate, tabulate."""

from __future__ import annotations

import json
import math

import pytest

from kvbench import __version__
from kvbench.bench.results import SCHEMA_VERSION, Results, ResultsError, commit_info, machine_info
from tests.kvbench.trace_factory import make_trace, req


def small_results() -> Results:
    res = Results(device="cpu")
    res.add_engine({"name": "reference", "kind": "reference", "options": {"preemption_mode": "swap"},
                    "capabilities": ["swap", "recompute"]})
    res.add_scenario_result("storm", "reference", {"output_throughput": 100.0, "tbt_p99": 0.05, "goodput": None},
                            series={"t": [0.0, 1.0]}, checks={"preempted": True, "no leak": False},
                            notes=["hello"], parameters={"num_gpu_blocks": 64}, description="a storm")
    res.add_scenario_result("storm", "other", {"output_throughput": 80.0, "tbt_p99": math.nan})
    res.add_sweep_point("storm", "concurrency", 4, "reference", {"output_throughput": 90.0}, mode="recompute",
                        x_label="max_num_seqs")
    res.add_sweep_point("storm", "concurrency", 8, "reference", {"output_throughput": 100.0}, mode="recompute")
    return res


def test_skeleton_has_every_section():
    data = small_results().to_dict()
    assert data["schema_version"] == SCHEMA_VERSION and data["kvbench_version"] == __version__
    assert data["created"].endswith("+00:00")
    assert set(data["machine"]) == {"hostname", "platform", "python", "cpu_count", "torch", "device"}
    assert set(data["commit"]) == {"id", "branch", "dirty"}
    assert [e["name"] for e in data["engines"]] == ["reference", "other"]
    sc = data["scenarios"][0]
    assert sc["name"] == "storm" and sc["description"] == "a storm" and sc["parameters"] == {"num_gpu_blocks": 64}
    assert sc["results"][0] == {"engine": "reference", "mode": None,
                                "metrics": {"output_throughput": 100.0, "tbt_p99": 0.05, "goodput": None},
                                "series": {"t": [0.0, 1.0]}, "checks": {"preempted": True, "no leak": False},
                                "undecided": {}, "undecided_kinds": {}, "claim_evidence": {}, "notes": ["hello"],
                                "repeats": [], "spread": {}, "clock": None, "counters": None}
    sweep = sc["sweeps"][0]
    assert sweep["name"] == "concurrency" and sweep["x_label"] == "max_num_seqs"
    assert sweep["points"][1] == {"x": 8, "engine": "reference", "mode": "recompute",
                                  "metrics": {"output_throughput": 100.0}, "repeats": [], "spread": {}}


def test_save_load_round_trip_and_nan_becomes_null(tmp_path):
    res = small_results()
    path = res.save(tmp_path / "deep" / "results.json")
    text = path.read_text()
    assert "NaN" not in text
    loaded = Results.load(path)
    assert loaded.to_dict() == json.loads(text)
    assert loaded.result("storm", "other")["metrics"]["tbt_p99"] is None
    assert not list(path.parent.glob("*.tmp"))  # atomic write left nothing behind


def test_load_rejects_another_schema_version(tmp_path):
    data = small_results().to_dict()
    data["schema_version"] = 99
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsError, match=r"r\.json: schema_version 99 is not supported.*reads schema_version 1"):
        Results.load(path)


@pytest.mark.parametrize("content, message", [
    ("{not json", "invalid JSON"),
    ("[]", "expected a JSON object"),
    ('{"engines": [], "scenarios": []}', "no 'schema_version'"),
    ('{"schema_version": 1, "engines": {}, "scenarios": []}', "'engines' must be a list"),
    ('{"schema_version": 1, "engines": [], "scenarios": [{"name": "s", "results": [{"engine": "e"}]}]}',
     "needs 'engine' and 'metrics'"),
])
def test_load_explains_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ResultsError, match=message):
        Results.load(path)


def test_load_missing_file():
    with pytest.raises(FileNotFoundError):
        Results.load("/nonexistent/results.json")


def test_minimal_file_gets_optional_parts_filled(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"schema_version": 1, "engines": [{"name": "e"}], "scenarios": [
        {"name": "s", "results": [{"engine": "e", "metrics": {"x": 1}}]}]}))
    res = Results.load(path)
    assert res.result("s", "e") == {"engine": "e", "mode": None, "metrics": {"x": 1}, "series": {}, "checks": {},
                                    "undecided": {}, "undecided_kinds": {}, "claim_evidence": {}, "notes": [],
                                    "repeats": [], "spread": {}, "clock": None, "counters": None}
    assert res.scenarios[0]["sweeps"] == []


def test_to_frame_one_row_per_engine_and_scenario():
    df = small_results().to_frame()
    assert list(df["engine"]) == ["reference", "other"]
    assert list(df.columns[:5]) == ["scenario", "engine", "mode", "checks_passed", "checks_total"]
    assert df.loc[0, "output_throughput"] == 100.0 and math.isnan(df.loc[1, "tbt_p99"])
    assert df.loc[0, "checks_passed"] == 1 and df.loc[0, "checks_total"] == 2
    assert Results(device="cpu").to_frame().empty


def test_adding_the_same_engine_and_mode_replaces_the_result():
    res = small_results()
    res.add_scenario_result("storm", "reference", {"output_throughput": 1.0})
    res.add_scenario_result("storm", "reference", {"output_throughput": 2.0}, mode="swap")
    storm = res.scenario("storm")
    assert [(r["engine"], r["mode"]) for r in storm["results"]] == [("other", None), ("reference", None),
                                                                    ("reference", "swap")]
    assert res.result("storm", "reference")["metrics"] == {"output_throughput": 1.0}
    assert len(res.engines) == 2  # engines are registered once


def test_add_engine_fills_details_later_and_rejects_nameless():
    res = Results(device="cpu")
    res.add_engine("hf")
    res.add_engine({"name": "hf", "kind": "hf", "capabilities": ["sampling"]})
    assert res.engine("hf") == {"name": "hf", "kind": "hf", "options": {}, "capabilities": ["sampling"]}
    with pytest.raises(ResultsError, match="name"):
        res.add_engine({"kind": "x"})


def test_add_trace_summarizes_it():
    tr = make_trace(req("a", 0.0, [0.5, 1.0]), engine="reference", scenario="tiny", duration=1.0)
    res = Results(device="cpu")
    entry = res.add_trace(tr, slos="ttft<=1", checks={"ok": True})
    assert entry["metrics"]["output_throughput"] == 2.0 and entry["metrics"]["goodput"] == 1.0
    assert entry["series"]["ttft_cdf_x"] == [0.5]
    assert res.scenario_names() == ["tiny"] and res.engine_names() == ["reference"]


def test_unknown_scenario_lookup_names_what_exists():
    with pytest.raises(KeyError, match="have: storm"):
        small_results().scenario("nope")


def test_commit_info_without_a_repository_or_without_git(tmp_path, monkeypatch):
    assert commit_info(tmp_path) == {"id": None, "branch": None, "dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable at all
    assert commit_info() == {"id": None, "branch": None, "dirty": None}


def test_machine_info_takes_the_device_from_the_caller():
    info = machine_info("cuda:0 test")
    assert info["device"] == "cuda:0 test" and info["cpu_count"] >= 1 and info["python"].count(".") == 2


def test_saved_results_are_readable_by_others(tmp_path):
    path = Results().save(tmp_path / "results.json")
    assert path.stat().st_mode & 0o777 == 0o644
