"""scripts/gpu_measure.py without a GPU: its arguments, its roofline arithmetic (checked against what
reference_engine really builds), and a --dry-run of every step on CPU at tiny sizes.

The figures a GPU gives are not tested here (none is lent to CI); scripts/gpu_check.sh runs them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_measure", ROOT / "scripts" / "gpu_measure.py")
gm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gm)


def test_defaults_follow_dry_run():
    full = gm.parse_args([])
    assert (full.device, full.model, full.dtype, full.batches, full.context) == ("cuda", "1b", "bfloat16",
                                                                                 [1, 16, 64], 1024)
    dry = gm.parse_args(["--dry-run", "--batches", "2,3"])
    assert (dry.device, dry.model, dry.dtype, dry.batches) == ("cpu", "tiny", "float32", [2, 3])


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "a,b"], ["--context", "-5"],
                                  ["--model", "70b"], ["--dry-run", "--context", "1020"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        gm.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_parameter_count_matches_the_checkpoint_written(tmp_path: Path):
    from safetensors import safe_open

    gm.write_random_checkpoint(tmp_path, "tiny", "float32")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = sum(_prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not a dict)
    assert gm.parameter_count(gm.MODEL_SHAPES["tiny"]) == written
    # and reference_engine loads it (the names and shapes are the ones its loader expects, strictly)
    from reference_engine.model import load_model

    assert load_model(tmp_path).config.hidden_size == gm.MODEL_SHAPES["tiny"]["hidden_size"]


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_the_1b_shape_is_about_a_billion_parameters():
    assert 1.05e9 < gm.parameter_count(gm.MODEL_SHAPES["1b"]) < 1.15e9
    # a decode step reads every weight but the embedding table: 2 bytes each in bf16
    weights = gm.weight_bytes_per_step(gm.MODEL_SHAPES["1b"], "bfloat16")
    assert weights == 2 * (gm.parameter_count(gm.MODEL_SHAPES["1b"]) - 32000 * 2048)


def test_kv_bytes_per_token_match_the_kv_cache_block():
    import torch

    from reference_engine.kv_cache import KVCache

    shape = gm.MODEL_SHAPES["1b"]
    cache = KVCache(1, 0, shape["num_hidden_layers"], 16, shape["num_key_value_heads"], gm.head_dim(shape),
                    torch.bfloat16, torch.device("cpu"))
    assert gm.kv_bytes_per_token(shape, "bfloat16") * 16 == cache.block_bytes
    assert gm.kv_bytes_per_token(shape, "bfloat16") == 16 * 2 * 8 * 64 * 2  # 32 KiB: layers x K,V x heads x dim x 2


def test_roofline_arithmetic():
    shape, dtype = gm.MODEL_SHAPES["1b"], "bfloat16"
    w, kv = gm.weight_bytes_per_step(shape, dtype), gm.kv_bytes_per_token(shape, dtype)
    assert gm.decode_step_bytes(shape, dtype, 64, 1024) == w + 64 * 1024 * kv
    assert gm.decode_step_bytes(shape, dtype, 1, 1) == w + kv
    assert gm.roofline_seconds(4_000_000_000, 4e12) == pytest.approx(1e-3)
    # at H200-class bandwidth, batch 1 is weight-bound (~2 GB per step) and batch 64 x 1k context doubles it
    assert gm.roofline_seconds(gm.decode_step_bytes(shape, dtype, 64, 1024), 4.3e12) == pytest.approx(
        (w + 64 * 1024 * kv) / 4.3e12)
    assert 0.9 < (64 * 1024 * kv) / w < 1.1
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        gm.roofline_seconds(1, 0.0)


def test_cuda_requested_without_cuda_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gm.main(["--out", "/nonexistent-not-written"]) == 2
    assert "use --dry-run" in capsys.readouterr().err


def test_dry_run_runs_every_step_and_writes_results_and_report(tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_measure.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    raw = json.loads((tmp_path / "gpu_measure.json").read_text())
    assert raw["bandwidth"]["bandwidth_bytes_s"] > 0
    assert {(r["backend"], r["batch"]) for r in raw["decode"]} >= {("torch", 1), ("torch", 4)}
    assert all(r["efficiency"] > 0 and r["roofline_s"] > 0 for r in raw["decode"])
    assert raw["swap"]["swap_out"]["median_s"] > 0 and raw["swap"]["plain_h2d"]["median_s"] > 0
    assert raw["storm"]["failures"] == []
    results = json.loads((tmp_path / "results.json").read_text())
    names = {sc["name"] for sc in results["scenarios"]}
    assert {"gpu_bandwidth", "gpu_decode_roofline", "gpu_swap_copies", "preemption_storm"} <= names
    assert (tmp_path / "report.html").is_file()
    assert not (tmp_path / "model").exists(), "the random checkpoint must not be left in OUT"
    assert "efficiency" in done.stdout and "storm: preemption_storm" in done.stdout
