"""scripts/storm_ratios.py: per-point ratios of two engines from a results file, round by round, with the
direction of each metric (higher throughput, lower TTFT is better), and the exit status of --at-least."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("storm_ratios", ROOT / "scripts" / "storm_ratios.py")
sr = importlib.util.module_from_spec(_spec)
sys.modules["storm_ratios"] = sr
_spec.loader.exec_module(sr)


def _point(x, engine, throughputs, ttfts):
    repeats = [{"output_throughput": t, "ttft_p50": f} for t, f in zip(throughputs, ttfts, strict=True)]
    return {"x": x, "engine": engine, "metrics": {"output_throughput": sorted(throughputs)[1],
                                                   "ttft_p50": sorted(ttfts)[1]}, "repeats": repeats}


RESULTS = {"scenarios": [{"name": "preemption_storm", "sweeps": [{"name": "concurrency", "points": [
    _point(2, "reference", [1000, 1100, 900], [0.010, 0.012, 0.011]),
    _point(2, "server:preset=reference", [950, 1045, 990], [0.020, 0.024, 0.022]),
    _point(16, "reference", [2000, 2000, 2000], [0.100, 0.100, 0.100]),
    _point(16, "server:preset=reference", [1600, 1800, 1700], [0.050, 0.050, 0.050]),
]}]}]}


def test_ratios_per_point_round_by_round_in_each_metrics_direction():
    ratios = {(r.x, r.metric): r for r in sr.point_ratios(RESULTS, "preemption_storm", "reference",
                                                          "server:preset=reference",
                                                          ["output_throughput", "ttft_p50"])}
    low = ratios[(2.0, "output_throughput")]
    assert low.round_ratios == pytest.approx([0.95, 0.95, 1.1])  # round i against round i
    assert low.median_round_ratio == pytest.approx(0.95)
    assert low.ratio_of_medians == pytest.approx(990 / 1000)
    assert low.baseline_spread == pytest.approx(200 / 1000)
    assert ratios[(2.0, "ttft_p50")].median_round_ratio == pytest.approx(0.5), "twice the TTFT: 0.5x, not 2x"
    assert ratios[(16.0, "ttft_p50")].median_round_ratio == pytest.approx(2.0)
    assert ratios[(16.0, "output_throughput")].median_round_ratio == pytest.approx(0.85)


def test_at_least_fails_on_a_point_below_and_a_missing_engine_is_named(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    assert sr.main([str(path), "--metrics", "output_throughput", "--at-least", "0.9"]) == 1
    assert "below 0.9: output_throughput at 16: 0.85" in capsys.readouterr().out
    assert sr.main([str(path), "--metrics", "output_throughput", "--at-least", "0.8"]) == 0
    assert sr.main([str(path), "--engine", "vllm"]) == 2
    assert "engine 'vllm' has no point" in capsys.readouterr().err
