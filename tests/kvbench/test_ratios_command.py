"""``kvbench ratios``: per-point ratios of two engines from a results file, round by round, in each
metric's direction (higher throughput, lower TTFT is better), and the exit status of ``--at-least``."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvbench.bench.point_ratios import point_ratios
from kvbench.bench.results import Results
from kvbench.cli import main

SERVER = "server:preset=reference"


def _add(results: Results, x: int, engine: str, throughputs: list[float], ttfts: list[float],
         mode: str | None = None) -> None:
    repeats = [{"output_throughput": t, "ttft_p50": f} for t, f in zip(throughputs, ttfts, strict=True)]
    results.add_sweep_point("preemption_storm", "concurrency", x, engine,
                            {"output_throughput": sorted(throughputs)[1], "ttft_p50": sorted(ttfts)[1]},
                            mode=mode, repeats=repeats)


def _results() -> Results:
    results = Results(device="cpu (test)")
    results.add_engine({"name": "reference", "kind": "reference"})
    _add(results, 2, "reference", [1000, 1100, 900], [0.010, 0.012, 0.011])
    _add(results, 2, SERVER, [950, 1045, 990], [0.020, 0.024, 0.022])
    _add(results, 16, "reference", [2000, 2000, 2000], [0.100, 0.100, 0.100])
    _add(results, 16, SERVER, [1600, 1800, 1700], [0.050, 0.050, 0.050])
    return results


@pytest.fixture()
def results_file(tmp_path: Path) -> str:
    path = tmp_path / "results.json"
    _results().save(path)
    return str(path)


def test_ratios_per_point_round_by_round_in_each_metrics_direction() -> None:
    ratios = {(r.x, r.metric): r for r in point_ratios(_results(), "preemption_storm", "reference", SERVER,
                                                         ["output_throughput", "ttft_p50"])}
    low = ratios[(2.0, "output_throughput")]
    assert low.round_ratios == pytest.approx([0.95, 0.95, 1.1])  # round i against round i
    assert low.median_round_ratio == pytest.approx(0.95)
    assert low.ratio_of_medians == pytest.approx(990 / 1000)
    assert low.baseline_range == pytest.approx(200 / 1000)  # (max - min) / median of the baseline's rounds
    assert ratios[(16.0, "output_throughput")].baseline_range == 0.0
    assert ratios[(2.0, "ttft_p50")].median_round_ratio == pytest.approx(0.5), "twice the TTFT: 0.5x, not 2x"
    assert ratios[(16.0, "ttft_p50")].median_round_ratio == pytest.approx(2.0)
    assert ratios[(16.0, "output_throughput")].median_round_ratio == pytest.approx(0.85)


def test_the_table_and_at_least_through_the_command(results_file: str) -> None:
    out = io.StringIO()
    # the baseline defaults to the run's reference engine, the engine to every other one of the sweep
    assert main(["ratios", results_file, "--metrics", "output_throughput", "--at-least", "0.9"], out=out) == 1
    text = out.getvalue()
    assert f"{SERVER} against reference" in text
    assert "| 2 | - | output_throughput | 1000 | 990 | 0.99 | 0.95 [0.95-1.10] | 20% / 10% |" in text
    assert "below 0.9: server:preset=reference, output_throughput at 16: 0.85" in text
    assert "at 2:" not in text
    assert main(["ratios", results_file, "--metrics", "output_throughput", "--at-least", "0.8"],
                out=io.StringIO()) == 0


def test_modes_are_kept_apart(tmp_path: Path) -> None:
    results = _results()
    _add(results, 2, "reference", [500, 500, 500], [0.2, 0.2, 0.2], mode="swap")
    _add(results, 2, SERVER, [250, 250, 250], [0.2, 0.2, 0.2], mode="swap")
    path = tmp_path / "modes.json"
    results.save(path)
    out = io.StringIO()
    assert main(["ratios", str(path), "--metrics", "output_throughput", "--mode", "swap"], out=out) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| 2 ")]
    assert rows == ["| 2 | swap | output_throughput | 500 | 250 | 0.50 | 0.50 [0.50-0.50] | 0% / 0% |"]


def test_at_least_fails_when_nothing_was_compared(tmp_path: Path) -> None:
    results = _results()
    # a metric every benchmark records, which this sweep's points happen not to hold
    path = tmp_path / "results.json"
    results.save(path)
    out = io.StringIO()
    assert main(["ratios", str(path), "--metrics", "tbt_p99", "--at-least", "0.9"], out=out) == 1
    text = out.getvalue()
    assert "no point of 'preemption_storm' has tbt_p99 for both reference and server:preset=reference" in text
    assert "--at-least 0.9: nothing was compared for server:preset=reference against reference" in text
    # without a gate, an empty table is only said
    assert main(["ratios", str(path), "--metrics", "tbt_p99"], out=io.StringIO()) == 0


def test_a_missing_figure_reads_one_way(tmp_path: Path) -> None:
    results = Results(device="cpu (test)")
    results.add_engine({"name": "reference", "kind": "reference"})
    # one round each: no rounds' range, no round-by-round ratio
    results.add_sweep_point("preemption_storm", "concurrency", 4, "reference", {"output_throughput": 100.0})
    results.add_sweep_point("preemption_storm", "concurrency", 4, SERVER, {"output_throughput": 50.0})
    path = tmp_path / "single.json"
    results.save(path)
    out = io.StringIO()
    assert main(["ratios", str(path), "--metrics", "output_throughput"], out=out) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| 4 ")]
    assert rows == ["| 4 | - | output_throughput | 100 | 50 | 0.50 | n/a | n/a / n/a |"]


def test_an_unknown_metric_is_a_usage_error(results_file: str, capsys) -> None:
    assert main(["ratios", results_file, "--metrics", "output_throughput,thruput"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "--metrics: unknown metric key(s) 'thruput'; known keys: requests, " in err
    assert "output_throughput" in err and "ttft_p50" in err


def test_a_scenarios_own_figure_is_a_known_metric(tmp_path: Path) -> None:
    results = Results(device="cpu (test)")
    results.add_engine({"name": "reference", "kind": "reference"})
    for engine, cost in (("reference", 0.2), (SERVER, 0.4)):
        results.add_sweep_point("crossover", "seq_len", 512, engine, {"cost_s": cost}, mode="swap")
    path = tmp_path / "crossover.json"
    results.save(path)
    out = io.StringIO()
    assert main(["ratios", str(path), "--scenario", "crossover", "--metrics", "cost_s"], out=out) == 0
    assert "| 512 | swap | cost_s | 0.2 | 0.4 | 0.50 |" in out.getvalue()


@pytest.mark.parametrize(("argv", "says"), [
    (["--engine", "vllm"], "--engine 'vllm' has no point in 'preemption_storm'"),
    (["--baseline", "hf"], "--baseline 'hf' has no point"),
    (["--scenario", "evening_surge"], "--scenario 'evening_surge': not in these results (they hold: preemption_storm)"),
    (["--sweep", "seq_len"], "--sweep 'seq_len': scenario 'preemption_storm' has the sweeps concurrency"),
    (["--mode", "swap"], "--mode 'swap': no point of 'preemption_storm' has it"),
    (["--at-least", "0"], "--at-least must be a ratio > 0"),
])
def test_what_is_missing_is_named(results_file: str, argv: list[str], says: str, capsys) -> None:
    assert main(["ratios", results_file, *argv], out=io.StringIO()) == 2
    assert says in capsys.readouterr().err
