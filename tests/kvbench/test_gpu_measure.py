"""``kvbench measure-gpu`` without a GPU: its flags, its roofline arithmetic (checked against what
reference_engine really builds), and a ``--dry-run`` of every step on CPU at tiny sizes, through the
command itself.

The figures a GPU gives are not tested here (none is lent to CI); ``scripts/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvbench.bench import gpu_measure as gm
from kvbench.cli import main


def test_defaults_follow_dry_run(tmp_path: Path):
    full = gm.Settings.for_run(tmp_path)
    assert (full.device, full.model, full.dtype, full.batches, full.context) == ("cuda", "1b", "bfloat16",
                                                                                 (1, 16, 64), 1024)
    dry = gm.Settings.for_run(tmp_path, dry_run=True, batches=(2, 3))
    assert (dry.device, dry.model, dry.dtype, dry.batches) == ("cpu", "tiny", "float32", (2, 3))


@pytest.mark.parametrize(("argv", "message"), [
    (["--batches", "0"], "--batches [0]: expected one or more integers >= 1"),
    (["--batches", "a,b"], "--batches must be comma-separated integers, got 'a,b'"),
    (["--context", "-5"], "--context -5: expected an integer >= 1"),
    (["--model", "70b"], "--model '70b': expected one of ['1b', 'tiny']"),
    (["--dtype", "int8"], "--dtype 'int8': expected one of"),
    (["--dry-run", "--context", "1020"], "--context 1020 + decode_steps=3: does not fit the tiny model's 1024"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, message, tmp_path: Path, capsys):
    assert main(["measure-gpu", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing is written before the flags are checked"


def test_parameter_count_matches_the_checkpoint_written(tmp_path: Path):
    from safetensors import safe_open

    gm.write_random_checkpoint(tmp_path, "tiny", "float32")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = sum(_prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not a dict)
    assert gm.model_shape("tiny").num_params() == written
    # and reference_engine loads it (the names and shapes are the ones its loader expects, strictly)
    from reference_engine.model import load_model

    assert load_model(tmp_path).config.hidden_size == gm.MODEL_SHAPES["tiny"]["hidden_size"]


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_the_1b_shape_is_about_a_billion_parameters():
    shape = gm.model_shape("1b")
    assert 1.05e9 < shape.num_params() < 1.15e9
    # a decode step reads every weight but the embedding table: 2 bytes each in bf16
    assert gm.weight_bytes_per_step(shape, "bfloat16") == 2 * (shape.num_params() - 32000 * 2048)


def test_kv_bytes_per_token_match_the_kv_cache_block():
    import torch

    from reference_engine.kv_cache import KVCache

    shape = gm.model_shape("1b")
    cache = KVCache(1, 0, shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, torch.bfloat16,
                    torch.device("cpu"))
    assert shape.kv_bytes_per_token(2) * 16 == cache.block_bytes
    assert shape.kv_bytes_per_token(2) == 16 * 2 * 8 * 64 * 2  # 32 KiB: layers x K,V x heads x dim x 2


def test_roofline_arithmetic():
    shape, dtype = gm.model_shape("1b"), "bfloat16"
    w, kv = gm.weight_bytes_per_step(shape, dtype), shape.kv_bytes_per_token(2)
    assert gm.decode_step_bytes(shape, dtype, 64 * 1024) == w + 64 * 1024 * kv
    assert gm.decode_step_bytes(shape, dtype, 1) == w + kv
    assert gm.roofline_seconds(4_000_000_000, 4e12) == pytest.approx(1e-3)
    # batch 1 is weight-bound (~2 GB per step); batch 64 x 1k context reads about as much KV again
    assert 0.9 < (64 * 1024 * kv) / w < 1.1
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        gm.roofline_seconds(1, 0.0)


def test_cuda_asked_for_without_cuda_says_so(tmp_path: Path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["measure-gpu", "--out", str(tmp_path)]) == 2
    assert "--device cuda: CUDA is not available here; --dry-run rehearses" in capsys.readouterr().err


def test_dry_run_runs_every_step_and_writes_results_and_report(tmp_path: Path):
    out = io.StringIO()
    assert main(["measure-gpu", "--dry-run", "--out", str(tmp_path)], out=out) == 0, out.getvalue()[-2000:]
    raw = json.loads((tmp_path / "gpu_measure.json").read_text())
    assert raw["bandwidth"]["bandwidth_bytes_s"] > 0
    assert {(r["backend"], r["batch"]) for r in raw["decode"]} >= {("torch", 1), ("torch", 4)}
    assert all(r["efficiency"] > 0 and r["roofline_s"] > 0 for r in raw["decode"])
    assert raw["storm"]["failures"] == []
    results = json.loads((tmp_path / "results.json").read_text())
    names = {sc["name"] for sc in results["scenarios"]}
    assert {"gpu_bandwidth", "gpu_decode_roofline", "preemption_storm"} <= names
    assert (tmp_path / "report.html").is_file()
    assert not (tmp_path / "model").exists(), "the random checkpoint must not be left in OUT"
    text = out.getvalue()
    assert "efficiency" in text and "storm: preemption_storm" in text
