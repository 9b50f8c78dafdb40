"""The near-tie rule per dtype: tolerances, the engine's dtype as each adapter knows it, the gap check that
keeps bfloat16's wide tolerance from excusing KV-cache bugs, and the noise measurement they come from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kvbench.conformance.equivalence import TOLERANCES, compare, confirm_near_tie, tolerance_for
from kvbench.conformance.prove import compare_outputs, exact_only, near_tie_tolerance
from kvbench.core.requests import GenOutput, GenRequest, GenResult
from kvbench.engines.http.server import dtype_of_flags

pytest_plugins = ["pytester"]


def test_tolerance_per_dtype():
    assert tolerance_for(None) == tolerance_for("float32") == 1e-3
    assert tolerance_for("bfloat16") == 2.0
    assert tolerance_for("float16") == 0.25
    assert TOLERANCES["float16"] < TOLERANCES["bfloat16"]
    with pytest.raises(ValueError, match="int8"):
        tolerance_for("int8")


def test_a_near_tie_needs_the_engines_token_close_to_the_best():
    near = compare([1, 2], [1, 3], margins=[5.0, 0.5], tolerance=2.0)
    assert near.status == "near_tie"
    assert confirm_near_tie(near, 0.5) == near  # the runner-up: noise can do that
    assert confirm_near_tie(near, None) == near  # unknown: the verdict stands
    far = confirm_near_tie(near, 12.0)  # a token far down the list: not noise
    assert (far.status, far.cause, far.position, far.margin) == ("mismatch", "divergence", 1, 0.5)
    assert "12" in far.explain() and "far down" in far.explain()
    exact = compare([1], [1])
    assert confirm_near_tie(exact, 99.0) is exact


def _engine(kind: str, dtype: str | None):
    return SimpleNamespace(kind=kind, compute_dtype=lambda: dtype, name=f"{kind}:{dtype}")


def test_compare_outputs_takes_the_engines_dtype_and_confirms_near_ties():
    requests = [GenRequest("a", [5], 2), GenRequest("b", [6], 2)]
    truth = GenResult([GenOutput("a", [1, 2], "length"), GenOutput("b", [1, 2], "length")])
    got = GenResult([GenOutput("a", [1, 3], "length"), GenOutput("b", [1, 4], "length")])
    margins = lambda prompt, tokens: [5.0, 0.5]  # noqa: E731
    gaps = {3: 0.5, 4: 9.0}  # token 3 is the runner-up; token 4 sits far below the best

    def gap_of(prompt, tokens, position, token):
        assert position == 1
        return gaps[token]

    bf16 = _engine("hf-cb", "bfloat16")
    assert near_tie_tolerance(bf16) == 2.0 and near_tie_tolerance(bf16, 0.1) == 0.1
    plain = compare_outputs(bf16, got, truth, requests, margins, "run")
    assert [v.status for _, v in plain.verdicts] == ["near_tie", "near_tie"]
    checked = compare_outputs(bf16, got, truth, requests, margins, "run", gap_of=gap_of)
    assert [v.status for _, v in checked.verdicts] == ["near_tie", "mismatch"]
    # float32: 0.5 is far above 1e-3, so both are mismatches whatever the gap
    f32 = compare_outputs(_engine("hf-cb", "float32"), got, truth, requests, margins, "run", gap_of=gap_of)
    assert [v.status for _, v in f32.verdicts] == ["mismatch", "mismatch"]


def test_the_reference_engine_is_exact_only_in_float32():
    assert exact_only(_engine("reference", "float32"))
    assert not exact_only(_engine("reference", "bfloat16"))
    assert not exact_only(_engine("reference", "float16"))
    assert not exact_only(_engine("hf-cb", "float32"))


def test_each_adapter_says_its_dtype(tmp_path):
    from kvbench.engines.hf.generate import HFAdapter
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    assert ReferenceAdapter(str(tmp_path)).compute_dtype() == "float32"
    assert ReferenceAdapter(str(tmp_path), {"dtype": "bfloat16"}).compute_dtype() == "bfloat16"
    assert HFAdapter(str(tmp_path)).compute_dtype() == "float32"
    assert HFAdapter(str(tmp_path), {"dtype": "bfloat16"}).compute_dtype() == "bfloat16"
    with pytest.raises(ValueError, match="dtype='bf15'"):
        HFAdapter.validate_options({"dtype": "bf15"})


def test_a_servers_dtype_is_its_last_dtype_flag():
    assert dtype_of_flags(["vllm", "serve", "m", "--dtype", "float32", "--dtype", "bfloat16"]) == "bfloat16"
    assert dtype_of_flags(["x", "--dtype=half"]) == "float16"
    assert dtype_of_flags(["x", "--dtype", "auto"]) is None
    assert dtype_of_flags(["x", "--port", "1"]) is None


def test_a_server_adapter_reads_its_dtype_from_its_command(tmp_path):
    from kvbench.engines.http.server import ServerAdapter

    cmd = "{python} -m reference_engine.serve --model {model} --port {port}"
    adapter = ServerAdapter(str(tmp_path), {"preset": "reference", "cmd": cmd, "args": "--dtype bfloat16",
                                            "log_dir": str(tmp_path)})
    assert adapter.compute_dtype() == "bfloat16"
    plain = ServerAdapter(str(tmp_path), {"preset": "reference", "cmd": cmd, "log_dir": str(tmp_path)})
    assert plain.compute_dtype() is None


def test_differences_measure_the_gain_on_the_top1():
    from kvbench.models.logit_noise import differences

    reference = torch.tensor([[[3.0, 2.0, 0.0], [1.0, 0.0, 0.0]]])  # [N=1, T=2, V=3]
    other = torch.tensor([[[3.0, 2.5, 0.0], [1.0, 0.0, 2.0]]])  # token 1 gains 0.5; then token 2 gains 2 and wins
    d = differences(reference, other)
    assert d["gain"]["max"] == pytest.approx(2.0) and d["gain"]["median"] == pytest.approx(1.25)
    assert d["max_abs"]["max"] == pytest.approx(2.0)
    assert d["argmax_flips"] == 1


def test_measure_margins_with_a_dtype_measures_the_engines_noise(capsys):
    from kvbench.models.builtin import builtin_checkpoint
    from kvbench.models.random_llama import main

    model = str(builtin_checkpoint("tiny"))
    assert main(["--measure-margins", model, "--dtype", "bfloat16", "--num-prompts", "2", "--prompt-len", "16",
                 "--new-tokens", "6"]) == 0
    noise = json.loads(capsys.readouterr().out)["engine_noise"]
    assert noise["dtype"] == "bfloat16" and noise["num_positions"] == 12
    pairs = noise["pairs"]
    assert pairs["float32 engine vs float64"]["max_abs"]["max"] < 1e-3  # float32 noise, as documented
    # bfloat16 rounds: far larger than float32 against float64, and not zero between its own kernels
    assert pairs["decode_batched vs float64"]["max_abs"]["max"] > 1e-2
    assert {"decode_batched vs decode_alone", "decode_batched vs recompute_batched",
            "decode_batched vs dense_batched"} <= set(pairs)
    assert noise["worst_gain"] == max(p["gain"]["max"] for k, p in pairs.items() if not k.startswith("float32"))


def test_the_near_tie_tolerance_option(pytester):
    pytester.makepyfile("""
        def test_it(kvbench_session):
            assert kvbench_session.near_tie_tolerance == 0.5
    """)
    pytester.runpytest_subprocess("--kvbench-near-tie-tolerance", "0.5").assert_outcomes(passed=1)
    bad = pytester.runpytest_subprocess("--kvbench-near-tie-tolerance", "-1")
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(["*--kvbench-near-tie-tolerance*-1*"])


def test_sampling_scores_reproduce_the_engines_seeded_picks():
    """A seeded pick is the argmax of ReferenceAdapter.sampling_scores over the logits that predicted it
    (float32: the ground truth's logits are the engine's within 1e-4), and another seed's scores pick
    otherwise somewhere."""
    from dataclasses import replace

    from kvbench.engines.hf.generate import HFAdapter
    from kvbench.engines.inprocess.reference import ReferenceAdapter
    from kvbench.models.builtin import builtin_checkpoint

    model = str(builtin_checkpoint("tiny"))
    engine, truth = ReferenceAdapter(model), HFAdapter(model)
    requests = [GenRequest(f"s{i}", [5 + i, 9, 30 + i, 7], 12, temperature=1.0, seed=40 + i) for i in range(3)]
    outputs = engine.generate(requests).outputs
    mismatched = 0
    for request, out in zip(requests, outputs, strict=True):
        for position, token in enumerate(out.token_ids):
            logits = truth.next_logits(request.prompt_token_ids, out.token_ids, position)
            assert int(engine.sampling_scores(request, position, logits).argmax()) == token
            reseeded = engine.sampling_scores(replace(request, seed=request.seed + 1), position, logits)
            mismatched += int(reseeded.argmax()) != token
    assert mismatched > 0
    assert engine.sampling_scores(replace(requests[0], temperature=0.0), 0, logits) is None
    assert engine.sampling_scores(replace(requests[0], top_k=5), 0, logits) is None
