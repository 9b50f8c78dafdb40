"""``kvbench calibrate`` -> ``kvbench simulate`` as a new user runs them (docs/simulator.md): the command
calibrate prints works as printed; a fit that explains nothing is refused unless --force, saying why;
an existing profile is not overwritten without --force; a model too big for the profile's memory or too
short for the workload is an error naming the fix, not a traceback."""

from __future__ import annotations

import dataclasses
import io
import json
import shlex

import pytest

from kvbench.cli import main
from kvbench.models.builtin import builtin_checkpoint
from kvbench.sim import calibration
from reference_engine.costs import load_profile

#: a small design (a few seconds here): its fit is poor by construction, hence --force where it is saved
SMALL_DESIGN = ["--contexts", "16,48", "--batches", "1,4", "--prefills", "8,32", "--heldout", "48", "--repeats", "1",
                "--rounds", "2"]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(builtin_checkpoint("tiny"))


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def _printed_simulate_command(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.startswith("plan capacity with it: ")]
    assert len(lines) == 1, text
    argv = shlex.split(lines[0].removeprefix("plan capacity with it: "))
    assert argv[:2] == ["kvbench", "simulate"], lines[0]
    return argv[1:]


def _fake_calibration(r2_train: float | None, r2_heldout: float | None) -> calibration.Calibration:
    """What ``calibrate`` returns, with the fit figures given (no serving: these tests are about what
    is done with a fit)."""
    def part(r2: float | None) -> dict:
        return {"intervals": 100, "median_rel_error": 0.4, "p90_rel_error": 0.9, "r2": r2, "total_rel_error": 0.01}

    fit = {"model": "tiny", "torch_threads": 1, "fit_contexts": [32, 512], "heldout_contexts": [192],
           "train": part(r2_train), "heldout": part(r2_heldout), "load_average": 7.5, "cpus": 2}
    profile = dataclasses.replace(load_profile("h200"), name="this-machine", fit=fit, source="test")
    return calibration.Calibration(profile, [], [])


# ------------------------------------------------------------------------------ as printed
@pytest.mark.slow
def test_the_simulate_command_calibrate_prints_runs_as_printed(tmp_path, tiny, capsys):
    """Calibrate on a named model, then run the exact ``kvbench simulate`` line it printed: it plans
    (the tiny model has 1,024 positions, so the line carries --fit-lengths and the run says the scale).
    Before, the advice was ``--engine sim:hardware=PATH``, which ended in 'does not fit tiny'."""
    path = tmp_path / "profiles" / "this-machine.json"
    code, text = _run("calibrate", "-o", str(path), "--model", tiny, *SMALL_DESIGN, "--force")
    assert code == 0, text + capsys.readouterr().err
    argv = _printed_simulate_command(text)
    assert f"sim:hardware={path},model={tiny}" in argv and "--fit-lengths" in argv, argv
    code, text = _run(*argv)
    err = capsys.readouterr().err
    assert code == 0, text + err
    assert "simulating 10,000 requests of evening_surge" in text and "--fit-lengths: every prompt" in text, text
    assert "Traceback" not in err and "error" not in err, err


def test_the_printed_command_omits_the_default_model_and_fit_lengths_when_not_needed(tmp_path, tiny):
    """Without --model calibrate ran on the built-in tiny model, simulate's default too; a model whose
    context holds the workload gets no --fit-lengths."""
    from kvbench.cli.simulator import simulate_command

    path = tmp_path / "p.json"
    _fake_calibration(0.8, 0.8).profile.save(path)
    assert simulate_command(path, None) == f"kvbench simulate --engine sim:hardware={path} --fit-lengths"
    assert simulate_command(path, "llama-3-8b") == f"kvbench simulate --engine sim:hardware={path},model=llama-3-8b"


def test_simulate_refuses_a_short_model_naming_fit_lengths_and_serves_it_scaled_with_it(capsys, tiny):
    engine = f"sim:hardware=h200,model={tiny},num_gpu_blocks_override=2000"
    code, text = _run("simulate", "--requests", "40", "--engine", engine)
    err = capsys.readouterr().err
    assert code == 2 and "longest request is 4,072 tokens" in err and "--fit-lengths" in err and "x0.251" in err, err
    code, text = _run("simulate", "--requests", "40", "--engine", engine, "--fit-lengths")
    assert code == 0, text + capsys.readouterr().err
    assert "every prompt, output and shared prefix x0.251" in text and "1,024 positions" in text, text


def test_simulate_names_a_model_too_big_for_the_profiles_memory_instead_of_a_traceback(tmp_path, capsys):
    """A CPU profile from calibrate holds this machine's RAM (24 GiB here): Llama-3-8B's float32 weights
    do not fit. That is the engine's own ConfigError, said as a usage error naming the field."""
    profile = dataclasses.replace(load_profile("h200"), name="small-box", memory_bytes=24 * 2**30, dtype="float32")
    path = profile.save(tmp_path / "small-box.json")
    code, _ = _run("simulate", "--requests", "20", "--engine", f"sim:hardware={path},model=llama-3-8b")
    err = capsys.readouterr().err
    assert code == 2 and "gpu_memory_utilization" in err and "29.9 GiB of weights" in err, err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------ the workloads' lengths
@pytest.mark.parametrize("workload", ["evening_surge", "mixed_victims"])
def test_fitted_lengths_fit_the_model_and_full_scale_is_unchanged(workload):
    from kvbench.sim import simulate as sim

    build, _ = sim.WORKLOADS[workload]
    scale = sim.fit_length_scale(workload, 1024)
    assert 0 < scale < 1 and sim.fit_length_scale(workload, 8192) == 1.0
    fitted = build(400, vocab_size=512, max_model_len=1024, length_scale=scale)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in fitted.requests)
    assert longest <= 1024 and longest > 0.8 * 1024, longest  # shrunk to fit, not far below
    assert f"(lengths x{scale:.3g})" in fitted.name
    full = build(400, vocab_size=512, max_model_len=8192)
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in full.requests) > 1024
    assert [r.arrival_time for r in full.requests] == [r.arrival_time for r in fitted.requests]  # arrivals kept
    with pytest.raises(ValueError, match="length_scale"):
        build(10, vocab_size=512, length_scale=1.5)


# ------------------------------------------------------------------------------ refusing
def test_a_fit_that_explains_nothing_is_refused_saying_why_and_saved_with_force(tmp_path, monkeypatch, capsys):
    """R² -890.5 on the held-out cells was once saved silently. Now nothing is written, the error names
    the figure, the threshold, the load and --force; with --force it is saved with a warning."""
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: _fake_calibration(0.62, -890.5))
    path = tmp_path / "p.json"
    code, text = _run("calibrate", "-o", str(path))
    err = capsys.readouterr().err
    assert code == 2 and not path.exists(), err
    assert "R² -890.50 on the held-out cells (contexts [192], 100 intervals) is below 0.3" in err, err
    assert "not written" in err and "load average 7.5 on 2 CPUs" in err and "--force" in err, err
    assert "R² 0.62" not in err.split("calibrated profile")[0]  # the fitted cells' R² passed: not listed

    code, text = _run("calibrate", "-o", str(path), "--force")
    err = capsys.readouterr().err
    assert code == 0 and path.exists(), text + err
    assert "warning: R² -890.50 on the held-out cells" in err and "saved anyway" in err, err
    assert json.loads(path.read_text())["fit"]["heldout"]["r2"] == -890.5


@pytest.mark.parametrize(("train", "heldout", "problems"), [
    (0.84, 0.80, 0), (0.31, 0.30, 0), (0.29, 0.8, 1), (0.8, -890.5, 1), (0.01, -0.11, 2), (None, 0.8, 1)])
def test_fit_problems_follow_the_threshold(train, heldout, problems):
    found = calibration.fit_problems(_fake_calibration(train, heldout).profile.fit)
    assert len(found) == problems, found
    assert calibration.MIN_R2 == 0.3  # the CLI's help states this figure


def test_fit_problems_ignore_a_part_without_intervals():
    fit = dict(_fake_calibration(0.8, -3.0).profile.fit or {})
    fit["heldout"] = {"intervals": 0, "r2": None}
    assert calibration.fit_problems(fit) == []


def test_an_existing_profile_is_not_overwritten_without_force(tmp_path, monkeypatch, capsys):
    """Refused before minutes of measuring; --force overwrites."""
    def must_not_run(*a, **k):
        raise AssertionError("calibrated although the profile exists")

    path = tmp_path / "p.json"
    path.write_text("{\"keep\": true}\n")
    monkeypatch.setattr(calibration, "calibrate", must_not_run)
    code, _ = _run("calibrate", "-o", str(path))
    err = capsys.readouterr().err
    assert code == 2 and "the file exists" in err and "--force" in err, err
    assert path.read_text() == "{\"keep\": true}\n"
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: _fake_calibration(0.8, 0.7))
    code, text = _run("calibrate", "-o", str(path), "--force")
    assert code == 0, text + capsys.readouterr().err
    assert json.loads(path.read_text())["name"] == "this-machine"
