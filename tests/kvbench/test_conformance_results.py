"""The ``conformance`` key of results.json: validated, optional in older files, replaced by nodeid."""

from __future__ import annotations

import json

import pytest

from kvbench.bench.results import Results, ResultsError

RECORD = {"engine": "reference:preemption_mode=swap", "kind": "reference", "check": "recompute_preemption_equivalence",
          "nodeid": "suites/conformance/test_equivalence.py::test_recompute_preemption_equivalence[x]",
          "outcome": "passed", "evidence": {"preemptions_recompute": 31}, "near_ties": 0, "reason": None,
          "knob_overrides": {"preemption_mode": ("swap", "recompute")}}


def test_records_round_trip_through_a_file(tmp_path):
    results = Results()
    results.add_conformance(RECORD)
    results.add_conformance({**RECORD, "outcome": "failed", "reason": "recompute preemption did not happen"})
    assert len(results.conformance) == 1  # the same nodeid replaces, never duplicates
    loaded = Results.load(results.save(tmp_path / "results.json"))
    assert loaded.conformance == [{**RECORD, "outcome": "failed", "reason": "recompute preemption did not happen",
                                   "knob_overrides": {"preemption_mode": ["swap", "recompute"]},
                                   "proven": [], "pressured": True}]


def test_a_file_written_before_the_key_existed_still_reads(tmp_path):
    results = Results()
    data = results.to_dict()
    del data["conformance"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Results.load(path).conformance == []


def test_optional_fields_are_filled():
    record = {k: RECORD[k] for k in ("engine", "check", "nodeid", "outcome")}
    assert Results().add_conformance(record) == {**record, "kind": None, "reason": None, "evidence": {},
                                                 "knob_overrides": {}, "near_ties": 0, "proven": [],
                                                 "pressured": True}


@pytest.mark.parametrize(("change", "message"), [
    ({"outcome": "won"}, r"conformance\[0\] \(recompute_preemption_equivalence\): 'outcome' must be one of passed, "
                         r"failed, skipped, undecided, xfailed, xpassed, error, got 'won'"),
    ({"engine": ""}, r"conformance\[0\] needs a non-empty string 'engine'"),
    ({"check": None}, r"conformance\[0\] needs a non-empty string 'check'"),
    ({"evidence": [1]}, r"'evidence' must be an object"),
    ({"near_ties": "2"}, r"'near_ties' must be an integer"),
    ({"reason": 3}, r"'reason' must be a string or null"),
    ({"knob_overrides": {"preemption_mode": "recompute"}}, r"knob_overrides\['preemption_mode'\] must be "
                                                           r"\[option value given, value used\]"),
])
def test_a_malformed_record_is_refused_naming_the_field(change, message):
    data = json.loads(json.dumps(Results().to_dict()))
    data["conformance"] = [json.loads(json.dumps({**RECORD, **change}))]
    with pytest.raises(ResultsError, match=message):
        Results.from_dict(data)


def test_conformance_must_be_a_list():
    data = Results().to_dict()
    data["conformance"] = {}
    with pytest.raises(ResultsError, match="'conformance' must be a list, got dict"):
        Results.from_dict(data)
