"""The simulator's commands through ``kvbench``'s entry point: ``validate-sim`` (the simulator against the
reference engine, leave-one-out), ``predict`` (against real engines; here the reference engine alone, small
designs, one round) and ``admission-sweep`` (admission settings against static). Tiny sizes; no server."""

from __future__ import annotations

import io
import json
import re

import pytest

from kvbench.bench.admission_tradeoff import parse_setting
from kvbench.bench.results import Results
from kvbench.cli import main
from kvbench.sim.validation import SIM_ENGINE

#: the two quick scenarios that serve fastest, so each is fitted on the other's steps
SCENARIOS = ("prefix_caching_recompute", "swap_space_exhaustion")


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.mark.slow
def test_validate_sim_fits_each_scenario_on_the_others_and_counts_match(tmp_path) -> None:
    args = [a for name in SCENARIOS for a in ("--scenario", name)]
    code, text = run("validate-sim", *args, "--repeats", "2", "--warmup", "0", "--out", str(tmp_path / "out"),
                     "--profile-out", str(tmp_path / "fit.json"))
    assert code == 0, text
    for name in SCENARIOS:
        assert f"{name}: fitted without it" in text
    assert "counts (preemptions by mode, recomputed tokens) equal on the step clock: True" in text
    # the swap scenario preempts by swap: the counts compared are not zeros on both sides
    assert re.search(r"swap_space_exhaustion \[\w+\]\s+preemptions_swap\s+([1-9]\d*) \[\S+\]\s+\1\s+equal", text)
    results = Results.load(tmp_path / "out" / "results.json")
    engines = {r["engine"] for sc in results.scenarios for r in sc["results"]}
    assert SIM_ENGINE in engines and len(engines) == 2
    assert "Simulator vs measured" in (tmp_path / "out" / "report.html").read_text()
    assert json.loads((tmp_path / "fit.json").read_text())["name"] == "this-machine-served"


def test_validate_sim_refuses_an_unknown_scenario_and_bad_counts(capsys) -> None:
    assert run("validate-sim", "--scenario", "no_such")[0] == 2
    assert "--scenario: scenario 'no_such' is unknown; expected one of" in capsys.readouterr().err
    assert run("validate-sim", "--repeats", "0")[0] == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert run("validate-sim", "--profile-out", "/nonexistent-folder/fit.json")[0] == 2  # before any serving
    assert "--profile-out '/nonexistent-folder/fit.json': the folder" in capsys.readouterr().err


@pytest.mark.slow
def test_predict_the_reference_engine_small(tmp_path) -> None:
    code, text = run("predict", "--engines", "reference", "--rounds", "1", "--small", "--cool-down", "0",
                     "--no-client-fit-reference", "--json", str(tmp_path / "p.json"))
    assert code == 0, text
    result = json.loads((tmp_path / "p.json").read_text())
    assert set(result["predicted"]) == {"reference"} and len(result["measured"]["reference"]) == 1
    measured = result["measured"]["reference"][0]
    predicted = result["predicted"]["reference"]
    # every storm point and the surge, measured and predicted; the storm's top preempts in both
    assert len(measured["preemption_storm"]) == len(predicted["preemption_storm"]) == len(result["xs"]) > 1
    assert measured["preemption_storm"][-1]["preemptions"] > 0 and predicted["preemption_storm"][-1]["preemptions"] > 0
    assert measured["evening_surge"][0]["requests_finished"] == predicted["evening_surge"][0]["requests_finished"] > 0
    assert f"| reference | storm c={result['xs'][-1]:g} | preemptions |" in text
    assert "reference: median count error" in text and "knee predicted" in text
    assert "# kvbench predict --rounds 1 --engines reference" in text  # the header reproduces the run


def test_predict_refuses_unknown_engines_and_a_missing_vllm(monkeypatch, tmp_path, capsys) -> None:
    assert run("predict", "--engines", "reference,tgi")[0] == 2
    assert "--engines: engines='reference,tgi' is invalid: expected one or more of reference, vllm" in \
        capsys.readouterr().err
    monkeypatch.setenv("KVBENCH_VLLM", str(tmp_path / "no-vllm"))
    assert run("predict", "--engines", "vllm", "--rounds", "1")[0] == 2  # refused before any calibration
    assert "--engines includes vllm" in capsys.readouterr().err


@pytest.mark.slow
def test_admission_sweep_serves_static_and_each_setting() -> None:
    code, text = run("admission-sweep", "--scale", "quick", "--repeats", "1", "0.05:-")
    assert code == 0, text
    static = re.search(r"^  static\s+preemptions (\d+) ", text, re.M)
    gated = re.search(r"^  headroom 0\.05, pacing -\s+preemptions (\d+) .*goal (met|not met|undecided)$", text, re.M)
    assert static and gated, text
    # the surge preempts under static admission; the watermark's headroom admits fewer at once
    assert int(static.group(1)) > int(gated.group(1))


@pytest.mark.parametrize("text", ["1:1", "0.2:0", "x:1", "-0.1:-"])
def test_admission_settings_outside_their_range_are_refused(text: str, capsys) -> None:
    with pytest.raises(ValueError, match=r"HEADROOM in \[0, 1\) and PACING >= 1"):
        parse_setting(text)
    assert run("admission-sweep", "--scale", "quick", "--", text)[0] == 2  # "--": "-0.1:-" is no option
    assert f"setting {text!r} is invalid" in capsys.readouterr().err


def test_admission_setting_names_its_knobs() -> None:
    knobs = parse_setting("0.2:1")
    assert (knobs.admission_policy, knobs.admission_headroom, knobs.prefill_pacing_tokens) == ("watermark", 0.2, 1)
    assert parse_setting("0.05:-").prefill_pacing_tokens is None
