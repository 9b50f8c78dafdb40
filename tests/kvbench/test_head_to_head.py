"""``kvbench head-to-head`` without vLLM: the table's ratios from a saved record, the refusals, two
in-process engines on the same work, and the reference engine in process against its server with the
server's thread settings read back.

vLLM's side needs the peer environment (``bash scripts/peers.sh vllm``) and minutes of start-up; the
figures it gives are in docs/journal/measurements.md, not asserted anywhere.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvbench.bench import interleaved_rounds
from kvbench.cli import main

SMALL_RUN = ["--model", "tiny", "--concurrency", "4", "--rounds", "2", "--requests", "4", "--prompt", "8",
             "--output", "4", "--cool-down", "0"]


def _record(**cell) -> dict:
    return {"started": "2026-12-02T09:00:00+00:00", "command": "kvbench head-to-head", "commit": "abc",
            "threads_mode": "matched", "threads": {}, "requests": 4,
            "engines": {"inproc": "reference", "ref-server": "server:preset=reference", "vllm": "server:preset=vllm"},
            "cells": [{"model": "tiny", "concurrency": 64, **cell}]}


CELL = {"tok_s": {"inproc": [400.0, 300.0], "ref-server": [200.0, 300.0], "vllm": [100.0, 300.0]},
        "ttft_p50": {"inproc": [0.1, 0.1], "ref-server": [0.5, 0.3], "vllm": [1.0, 0.3]},
        "finished": {"inproc": [4, 4], "ref-server": [4, 4], "vllm": [4, 4]}}


def test_ratios_are_taken_round_by_round_against_the_baseline(tmp_path: Path) -> None:
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(_record(**CELL)))
    out = io.StringIO()
    assert main(["head-to-head", "--report", str(saved), "--baseline", "vllm"], out=out) == 0
    table = out.getvalue()
    # per round 2.00x and 1.00x: the median of two rounds is their mean
    assert "| tiny | 64 | ref-server | 250 [200-300] | 0.40 [0.30-0.50] | 4/4 | 1.50x [1.00x-2.00x] | " \
           "0.75x [0.50x-1.00x] |" in table
    assert "| tiny | 64 | vllm | 200 [100-300] | 0.65 [0.30-1.00] | 4/4 |  |  |" in table
    assert "ref-server = server:preset=reference" in table
    out = io.StringIO()
    assert main(["head-to-head", "--report", str(saved), "--baseline", "inproc"], out=out) == 0
    assert "| ref-server | 250 [200-300] | 0.40 [0.30-0.50] | 4/4 | 0.75x [0.50x-1.00x] |" in out.getvalue()


def test_a_job_that_did_not_finish_every_request_is_named_and_fails(tmp_path: Path) -> None:
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(_record(**{**CELL, "finished": {**CELL["finished"], "vllm": [4, 3]}})))
    out = io.StringIO()
    assert main(["head-to-head", "--report", str(saved)], out=out) == 1
    assert "NOT ALL FINISHED: vllm at tiny, c=64: 3 of 4 requests finished in its worst round" in out.getvalue()


@pytest.mark.parametrize(("argv", "says"), [
    ([], "--engine: name the engines to compare"),
    (["--engine", "reference", "--engine", "reference"], "two engines named 'reference'; label one"),
    (["--engine", "reference", "--engine", "nosuchkind"], "nosuchkind"),
    (["--engine", "a=reference", "--engine", "b=reference", "--knob", "c:max_num_batched_tokens=512"],
     "--knob 'c:max_num_batched_tokens=512': no engine named 'c' in this run (engines: a, b)"),
    (["--engine", "a=reference", "--engine", "b=reference", "--knob", "a:budget=512"], "unknown knob 'budget'"),
    (["--engine", "a=reference", "--engine", "b=reference", "--knob", "a=512"], "expected ENGINE:KEY=VALUE"),
    (["--engine", "a=reference", "--engine", "b=reference", "--baseline", "c"], "--baseline 'c': not an engine"),
    (["--engine", "a=reference", "--engine", "b=reference", "--rounds", "0"], "rounds must be >= 1, got 0"),
    (["--engine", "a=reference", "--engine", "b=reference", "--model", "nosuch"], "--model 'nosuch': neither"),
    (["--engine", "a=reference:dtype=float32", "--engine", "b=reference", "--dtype", "bfloat16"],
     "--dtype bfloat16: engine 'a' names its own dtype in its spec"),
    (["--engine", "a=reference", "--engine", "b=openai:url=http://127.0.0.1:9", "--dtype", "bfloat16"],
     "engine 'b' (openai) takes no dtype option"),
])
def test_bad_settings_are_refused_before_anything_runs(argv: list[str], says: str, capsys) -> None:
    out = io.StringIO()
    assert main(["head-to-head", *argv], out=out) == 2
    assert says in capsys.readouterr().err
    assert out.getvalue() == ""


def test_labels_and_bare_specs_name_the_engines() -> None:
    labelled = interleaved_rounds.parse_contender("ref512=server:preset=reference,args=--dtype float32")
    assert (labelled.name, labelled.spec.kind) == ("ref512", "server")
    assert labelled.spec.options == {"preset": "reference", "args": "--dtype float32"}
    bare = interleaved_rounds.parse_contender("reference:preemption_mode=swap")
    assert (bare.name, bare.spec.options) == ("reference:preemption_mode=swap", {"preemption_mode": "swap"})
    # a knob of an unlabelled engine: the setting is what follows its last ":"
    assert interleaved_rounds.parse_knob_overrides(["reference:preemption_mode=swap:max_num_seqs=8"],
                                                   [bare.name]) == {bare.name: {"max_num_seqs": 8}}


def test_dtype_goes_where_each_kind_takes_it() -> None:
    server = interleaved_rounds.parse_contender("s=server:preset=reference,args=--attention-backend torch")
    assert interleaved_rounds.with_dtype(server, "bfloat16")["args"] == "--attention-backend torch --dtype bfloat16"
    assert interleaved_rounds.with_dtype(interleaved_rounds.parse_contender("reference"), "bfloat16") == {
        "dtype": "bfloat16"}
    assert interleaved_rounds.with_dtype(server, None) == dict(server.spec.options)


def test_two_engines_in_process_on_the_same_work(tmp_path: Path, monkeypatch) -> None:
    served = []
    real_serve = interleaved_rounds.serve
    monkeypatch.setattr(interleaved_rounds, "serve", lambda adapter, job, label, **kw: served.append(
        (adapter.name, job.knobs, label, [r.prompt_token_ids for r in job.workload.requests])) or real_serve(
        adapter, job, label, **kw))
    out = io.StringIO()
    record_path = tmp_path / "run.json"
    assert main(["head-to-head", "--engine", "plain=reference", "--engine", "swap=reference:preemption_mode=swap",
                 *SMALL_RUN, "--knob", "swap:max_num_batched_tokens=64", "--json", str(record_path)], out=out) == 0
    timed = [s for s in served if s[2] == "head_to_head"]
    # two rounds, each engine once per round, the order rotated, the same requests every time
    assert [name for name, *_ in timed] == ["plain", "swap", "swap", "plain"]
    assert all(prompts == timed[0][3] for *_, prompts in timed)
    # the knob set apart reaches that engine's jobs, warm-up included, and only its own
    assert {k.max_num_batched_tokens for name, k, *_ in served if name == "swap"} == {64}
    assert {k.max_num_batched_tokens for name, k, *_ in served if name == "plain"} == {2048}
    record = json.loads(record_path.read_text())
    [cell] = record["cells"]
    assert cell["finished"] == {"plain": [4, 4], "swap": [4, 4]}
    assert all(v > 0 for values in cell["tok_s"].values() for v in values)
    assert record["engines"] == {"plain": "reference", "swap": "reference:preemption_mode=swap"}
    assert "| tiny | 4 | swap |" in out.getvalue() and "tok/s ÷ plain" in out.getvalue()


@pytest.mark.server
def test_in_process_against_its_server_with_thread_settings(tmp_path: Path) -> None:
    import torch

    threads_before = torch.get_num_threads()
    out_path = tmp_path / "run.json"
    assert main(["head-to-head", "--engine", "inproc=reference", "--engine", "ref-server=server:preset=reference",
                 *SMALL_RUN, "--rounds", "1", "--threads", "matched", "--log-dir", str(tmp_path / "logs"),
                 "--json", str(out_path)], out=io.StringIO()) == 0
    assert torch.get_num_threads() == threads_before, "the run gives this process its torch threads back"
    record = json.loads(out_path.read_text())
    [cell] = record["cells"]
    assert cell["finished"] == {"inproc": [4], "ref-server": [4]}
    [seen] = record["threads"].values()
    assert any("engine process steps on" in line for line in seen["log"])  # the server says its thread count
    matched = str(interleaved_rounds.matched_threads())
    assert seen["processes"] and all(p["omp"].get("OMP_NUM_THREADS") == matched for p in seen["processes"])
    assert record["client_torch_threads"] == int(matched)
