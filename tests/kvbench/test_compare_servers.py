"""scripts/compare_servers.py without vLLM: its table's ratios from a recorded run, and one small run of the
reference engine in process and as a server, with the server's thread settings read back.

vLLM's side needs the peer environment (``bash scripts/peers.sh vllm``) and minutes of start-up; the
figures it gives are in docs/results.md, not asserted anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_servers", ROOT / "scripts" / "compare_servers.py")
cs = importlib.util.module_from_spec(_spec)
sys.modules["compare_servers"] = cs  # its dataclass looks its module up while the module runs
_spec.loader.exec_module(cs)


def _result(**cells) -> dict:
    return {"started": "2026-12-02T09:00:00+00:00", "command": "compare_servers.py", "commit": "abc",
            "threads_mode": "matched", "threads": {}, "variants": {"old": "--engine-threads 2"},
            "cells": [{"model": "tiny-hd32", "dtype": "float32", "concurrency": 64, **cells}]}


def test_ratios_are_taken_round_by_round_with_their_spread() -> None:
    table = cs.report(_result(
        tok_s={"inproc": [400.0, 300.0], "ref-server": [200.0, 300.0], "vllm": [100.0, 300.0], "old": [50.0, 150.0]},
        ttft_p50={"inproc": [0.1, 0.1], "ref-server": [0.5, 0.3], "vllm": [1.0, 0.3], "old": [1.0, 1.0]},
        finished={}))
    # per round 2.00x and 1.00x: the median of two rounds is their mean
    assert "| ref-server | 250 [200-300] | 0.40 [0.30-0.50] | 1.50x [1.00x-2.00x] | 0.75x [0.50x-1.00x] |" in table
    assert "| ref-server / inproc | 0.75x [0.50x-1.00x] |" in table
    assert "| ref-server / old | 3.00x [2.00x-4.00x] | 0.40x [0.30x-0.50x] |" in table


def test_bad_variant_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cs.main(["--variant", "no-equals-sign"])
    assert e.value.code == 2
    assert "--variant: expected NAME=FLAGS" in capsys.readouterr().err


def test_knob_overrides_are_parsed_and_bad_ones_name_what_is_wrong(capsys) -> None:
    parser = cs.argparse.ArgumentParser()
    got = cs.parse_knob_overrides(parser, ["ref512:max_num_batched_tokens=512", "ref512:preemption_mode=swap",
                                           "vllm:enable_prefix_caching=true"])
    assert got == {"ref512": {"max_num_batched_tokens": 512, "preemption_mode": "swap"},
                   "vllm": {"enable_prefix_caching": True}}
    for bad, says in (("ref512=512", "expected ENGINE:KEY=VALUE"), ("ref512:budget=512", "unknown knob 'budget'")):
        with pytest.raises(SystemExit):
            cs.parse_knob_overrides(parser, [bad])
        assert says in capsys.readouterr().err


def test_a_knob_for_an_engine_the_run_does_not_have_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cs.main(["--engines", "inproc,ref-server", "--knob", "ref-srever:max_num_batched_tokens=512"])
    assert e.value.code == 2
    assert "--knob: no engine or variant named 'ref-srever'" in capsys.readouterr().err


def test_a_small_run_in_process_and_over_http(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run.json"
    served = []
    real_serve = cs.serve
    monkeypatch.setattr(cs, "serve", lambda adapter, job, label: served.append((adapter.name, job.knobs))
                        or real_serve(adapter, job, label))
    cs.main(["--models", "tiny", "--dtypes", "float32", "--concurrency", "4", "--rounds", "1", "--requests", "4",
             "--prompt", "8", "--output", "4", "--engines", "inproc,ref-server", "--threads", "matched",
             "--knob", "ref-server:max_num_batched_tokens=64",
             "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    # the override reaches the server's jobs, warm-up included, and only its own
    assert {knobs.max_num_batched_tokens for name, knobs in served if name == "ref-server"} == {64}
    assert {knobs.max_num_batched_tokens for name, knobs in served if name == "inproc"} == {2048}
    result = json.loads(out.read_text())
    assert result["knob_overrides"] == {"ref-server": {"max_num_batched_tokens": 64}}
    [cell] = result["cells"]
    assert cell["finished"] == {"inproc": [4], "ref-server": [4]}
    assert all(v[0] > 0 for v in cell["tok_s"].values())
    [seen] = result["threads"].values()
    assert any("engine process steps on" in line for line in seen["log"])  # the server says its thread count
    assert all(p["omp"].get("OMP_NUM_THREADS") == str(result["client_torch_threads"]) for p in seen["processes"])
