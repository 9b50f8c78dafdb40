"""Past one process and one machine: pytest-xdist workers, ``--kvbench-shard``, ``kvbench merge``, and the
checkpoint lock.

The parallel runs are real (``-n 2`` in a subprocess) and small: the real conformance suite on its
invalid-configuration checks, and a synthetic conformance file whose tests record evidence, a near-tie
and a benchmark result, so that what must survive the hand-over from workers is there to lose.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbench import cli
from kvbench.bench.merge import MergeError, merge_results
from kvbench.bench.results import Results
from kvbench.bench.shards import Shard, ShardError, in_shard, parse_shard

pytest_plugins = ["pytester"]
pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[2]

#: conformance tests that record what workers must hand over: evidence, a near-tie, a skip, a failure, and
#: (every test, so every worker has some) a benchmark result tagged with the worker that produced it; and
#: timed tests (marked benchmark) that --dist loadgroup must keep on one worker
SYNTHETIC = """
import os
import pytest
from kvbench.conformance.verdict import record_proof
from kvbench.core.evidence import record_evidence

def _record(results, name, engine="reference"):
    results.add_scenario_result(name, engine, {"output_throughput": 1.0}, parameters={"scale": "quick"},
                                notes=[os.environ.get("PYTEST_XDIST_WORKER", "serial")])

@pytest.mark.conformance
@pytest.mark.parametrize("n", range(4))
def test_proves(engine_spec, n, kvbench_session, kvbench_results):
    record_proof("preemptions_recompute", 10 + n)
    if n == 1:
        kvbench_session.near_ties.append(f"near-tie in case {n}")
    _record(kvbench_results, f"scenario_{n}", engine_spec.name)

@pytest.mark.conformance
def test_skips(engine_spec, kvbench_results):
    _record(kvbench_results, "skips")
    pytest.skip("no such counter")

@pytest.mark.conformance
def test_fails(engine_spec, kvbench_results):
    _record(kvbench_results, "fails")
    record_evidence("swap_ins", 0)
    assert False, "swap never happened"

@pytest.mark.benchmark
@pytest.mark.parametrize("n", range(4))
def test_timed(n, kvbench_results):
    _record(kvbench_results, f"timed_{n}")
"""
ALL_SCENARIOS = sorted([*(f"scenario_{n}" for n in range(4)), *(f"timed_{n}" for n in range(4)), "skips", "fails"])


def _results_file(report_dir: Path) -> Path:
    runs = sorted(report_dir.glob("*/results.json"))
    assert len(runs) == 1, f"one results.json expected (only the controller writes), found {runs}"
    return runs[0]


def _verdicts(results_file: Path) -> dict[str, tuple]:
    data = json.loads(results_file.read_text())
    return {r["nodeid"]: (r["outcome"], r["evidence"], r["near_ties"], r["reason"]) for r in data["conformance"]}


def _run_suite(args: list[str], report_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------------------------
# xdist


def test_real_suite_in_parallel_gives_the_serial_verdicts(tmp_path: Path):
    subset = ["suites/conformance/test_bad_input.py", "-k", "invalid_configuration"]
    serial = _run_suite(subset, tmp_path / "serial")
    parallel = _run_suite([*subset, "-n", "2"], tmp_path / "parallel")
    assert serial.returncode == 0, serial.stdout[-3000:]
    assert parallel.returncode == 0, parallel.stdout[-3000:]
    expected = _verdicts(_results_file(tmp_path / "serial"))
    assert len(expected) == 4
    assert _verdicts(_results_file(tmp_path / "parallel")) == expected
    assert "reference: 4 passed" in parallel.stdout


def test_workers_hand_evidence_near_ties_and_results_to_one_results_file(pytester: pytest.Pytester):
    """Also: the timed tests all run on one worker under --dist loadgroup."""
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    serial = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark", "--report-dir", "serial")
    parallel = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark", "--report-dir", "parallel",
                                             "-n", "2", "--dist", "loadgroup")
    for result in (serial, parallel):
        result.assert_outcomes(passed=8, skipped=1, failed=1)
        result.stdout.fnmatch_lines(["*kvbench near-ties*", "near-tie in case 1", "*reference: 1 failed, 4 passed, "
                                     "1 skipped (1 near-ties)*"])
    serial_file, parallel_file = (_results_file(pytester.path / d) for d in ("serial", "parallel"))
    verdicts = _verdicts(parallel_file)
    assert verdicts == _verdicts(serial_file)
    assert verdicts["test_synthetic.py::test_proves[reference-1]"] == ("passed", {"preemptions_recompute": 11}, 1,
                                                                       None)
    assert verdicts["test_synthetic.py::test_fails[reference]"][:2] == ("failed", {"swap_ins": 0})
    data = json.loads(parallel_file.read_text())
    assert sorted(sc["name"] for sc in data["scenarios"]) == ALL_SCENARIOS
    worker_of = {sc["name"]: sc["results"][0]["notes"][0] for sc in data["scenarios"]}
    assert set(worker_of.values()) == {"gw0", "gw1"}, "both workers' results must reach the controller"
    assert len({worker_of[f"timed_{n}"] for n in range(4)}) == 1, f"timed tests spread over workers: {worker_of}"
    assert len(list((pytester.path / "parallel").glob("*/report.html"))) == 1


def test_benchmarks_under_another_dist_mode_are_refused(pytester: pytest.Pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark with pytest-xdist (-n/--tx) needs --dist loadgroup, got --dist load*"])


# --------------------------------------------------------------------------------------------
# shards


def test_shards_split_sorted_ids_round_robin_into_disjoint_covering_parts():
    ids = [f"t.py::test_{c}" for c in "gfedcba"]
    parts = [in_shard(ids, Shard(i, 3)) for i in (1, 2, 3)]
    assert set().union(*parts) == set(ids)
    assert sum(map(len, parts)) == len(ids) and sorted(map(len, parts)) == [2, 2, 3]
    assert parts[0] == {"t.py::test_a", "t.py::test_d", "t.py::test_g"}
    assert in_shard(reversed(ids), Shard(1, 3)) == parts[0]  # collection order does not matter
    assert parse_shard("2/3") == Shard(2, 3)
    for bad in ("0/2", "3/2", "1", "a/b", "1/0", ""):
        with pytest.raises(ShardError, match="I/N with 1 <= I <= N"):
            parse_shard(bad)


def test_a_bad_shard_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kvbench-shard", "3/2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvbench-shard '3/2' is invalid: expected I/N with 1 <= I <= N*"])


def test_shard_then_merge_round_trip_equals_one_run(pytester: pytest.Pytester, capsys: pytest.CaptureFixture):
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    files = []
    for i in (1, 2):
        shard = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--report-dir", f"s{i}", "--kvbench-shard",
                                              f"{i}/2")
        shard.stdout.fnmatch_lines(["*5 deselected*"])  # 10 tests: 5 in each shard
        path = _results_file(pytester.path / f"s{i}")
        assert f"shard{i}of2" in str(path)
        data = json.loads(path.read_text())
        assert data["shard"] == {"index": i, "count": 2}
        data["machine"]["hostname"] = f"box{i}"  # as if each shard ran on its own machine
        path.write_text(json.dumps(data))
        files.append(str(path))
    merged_path, report_dir = pytester.path / "merged.json", pytester.path / "merged-report"
    assert cli.main(["merge", *files, "-o", str(merged_path), "--report", str(report_dir)]) == 0
    out = capsys.readouterr().out
    assert "from 2 machine(s)" in out and "6 conformance results" in out
    merged = Results.load(merged_path)
    outcomes = {nodeid.split("::")[1]: v[0] for nodeid, v in _verdicts(merged_path).items()}
    assert outcomes == {**{f"test_proves[reference-{n}]": "passed" for n in range(4)},
                        "test_skips[reference]": "skipped", "test_fails[reference]": "failed"}, \
        "every conformance test of the two shards, once, with the outcome a single run gives"
    assert sorted(merged.scenario_names()) == sorted([*(f"scenario_{n}" for n in range(4)), "skips", "fails"])
    assert {res["machine"] for _, res in merged.iter_results()} == {"box1", "box2"}
    assert set(merged.data["machines"]) == {"box1", "box2"} and merged.machine["hostname"] == "box1, box2"
    html = (report_dir / "report.html").read_text()
    assert '<th class="l">machine</th>' in html and "box1" in html and "box2" in html
    # one shard alone: merged with a note that the other is missing
    assert cli.main(["merge", files[0], "-o", str(pytester.path / "half.json")]) == 0
    assert "shard(s) 2/2 missing" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# merge refusals


def _results(scale: str = "quick", engine: str = "reference", scenario: str = "storm", **top) -> Results:
    r = Results()
    r.add_scenario_result(scenario, engine, {"output_throughput": 1.0}, parameters={"scale": scale, "model": "tiny"})
    r.data.update(top)
    return r


def test_merge_refuses_different_scales_naming_the_files():
    with pytest.raises(MergeError, match=r"different scenario sizes.*a\.json is quick on tiny.*b\.json is full on "
                                         r"tiny"):
        merge_results([("a.json", _results("quick")), ("b.json", _results("full", engine="hf"))])


def test_merge_refuses_the_same_result_twice_and_the_same_shard_twice():
    with pytest.raises(MergeError, match=r"storm / reference is in both a\.json and b\.json"):
        merge_results([("a.json", _results()), ("b.json", _results())])
    with pytest.raises(MergeError, match=r"shard 1/2 appears twice: a\.json and b\.json"):
        merge_results([("a.json", _results(shard={"index": 1, "count": 2})),
                       ("b.json", _results(engine="hf", shard={"index": 1, "count": 2}))])
    with pytest.raises(MergeError, match="different splits"):
        merge_results([("a.json", _results(shard={"index": 1, "count": 2})),
                       ("b.json", _results(engine="hf", shard={"index": 2, "count": 3}))])


def test_merge_refuses_one_engine_name_with_different_options():
    a, b = _results(), _results(scenario="other")
    b.engines[0]["options"] = {"preemption_mode": "swap"}
    with pytest.raises(MergeError, match=r"engine 'reference' has options \{\} in a\.json and .*swap.* in b\.json"):
        merge_results([("a.json", a), ("b.json", b)])


def test_merge_cli_refuses_another_schema_version_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture):
    good, old = tmp_path / "good.json", tmp_path / "old.json"
    _results().save(good)
    data = json.loads(good.read_text())
    data["schema_version"] = 0
    old.write_text(json.dumps(data))
    assert cli.main(["merge", str(good), str(old), "-o", str(tmp_path / "m.json")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "old.json" in err and "schema_version 0 is not supported" in err
    assert not (tmp_path / "m.json").exists()
    # and in memory, where no loader stands in between
    other = _results(engine="hf")
    other.data["schema_version"] = 2
    with pytest.raises(MergeError, match=r"different schema versions: a\.json has schema_version 1, b\.json has "
                                         r"schema_version 2"):
        merge_results([("a.json", _results()), ("b.json", other)])


def test_merge_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture):
    src, out = tmp_path / "a.json", tmp_path / "out.json"
    _results().save(src)
    out.write_text("{}")
    assert cli.main(["merge", str(src), "-o", str(out)]) == cli.EXIT_USAGE
    assert "pass --force" in capsys.readouterr().err
    assert cli.main(["merge", str(src), "-o", str(out), "--force"]) == cli.EXIT_OK


# --------------------------------------------------------------------------------------------
# the checkpoint lock


def test_builtin_checkpoint_is_written_once_by_concurrent_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from kvbench.models import builtin as checkpoints
    from kvbench.models import random_llama as checkpoint

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    writes: list[Path] = []
    # The first writer waits until every caller has reached the lock (an event, not a sleep that a
    # loaded machine could outlast), so the other three are contending for it while it writes.
    at_lock = threading.Condition()
    callers = {"n": 0}
    real_lock = checkpoints.FileLock

    def counted_lock(*args, **kwargs):
        with at_lock:
            callers["n"] += 1
            at_lock.notify_all()
        return real_lock(*args, **kwargs)

    def slow_write(out_dir, preset, seed):
        writes.append(Path(out_dir))
        with at_lock:
            assert at_lock.wait_for(lambda: callers["n"] == 4, timeout=30), "not every caller reached the lock"
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(checkpoints, "FileLock", counted_lock)
    monkeypatch.setattr(checkpoint, "write_checkpoint", slow_write)
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(checkpoints.builtin_checkpoint("tiny"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(writes) == 1, f"written {len(writes)} times"
    assert len(got) == 4 and len(set(got)) == 1 and (got[0] / "config.json").is_file()
    assert not [p for p in got[0].parent.iterdir() if p.name.startswith(".tiny-")], "staging left behind"


def test_without_the_lock_concurrent_callers_write_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The negative control of the test above: with the lock made a no-op, the race is real."""
    import contextlib

    from kvbench.models import builtin as checkpoints
    from kvbench.models import random_llama as checkpoint

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoints, "FileLock", lambda *a, **k: contextlib.nullcontext())
    writes: list[Path] = []
    # every caller is inside the write before any finishes: the overlap the lock exists for, made
    # certain by a barrier rather than hoped for with a sleep
    all_writing = threading.Barrier(3, timeout=30)

    def slow_write(out_dir, preset, seed):
        writes.append(Path(out_dir))
        all_writing.wait()
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(checkpoint, "write_checkpoint", slow_write)
    threads = [threading.Thread(target=checkpoints.builtin_checkpoint, args=("tiny",)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(writes) > 1


def test_xdist_is_a_declared_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"pytest-xdist>=' in text and '"filelock>=' in text


# --------------------------------------------------------------------------------------------
# the CI example


def test_the_ci_example_uses_real_options_and_uploads_the_report():
    """The workflow is not run here; at least every kvbench option it passes must exist, and the artifact
    the benchmark job uploads on main must be the one later runs download as their baseline."""
    yaml = pytest.importorskip("yaml")
    import re

    from kvbench.cli import build_parser

    text = (ROOT / ".github" / "workflows" / "kvbench.yml").read_text()
    workflow = yaml.safe_load(text)
    assert set(workflow["jobs"]) == {"conformance", "benchmarks", "vllm"}
    vllm_steps = " ".join(str(step.get("run", "")) for step in workflow["jobs"]["vllm"]["steps"])
    assert "server:preset=vllm" in vllm_steps and "--kvbench-expectations vllm" in vllm_steps
    assert len(workflow["jobs"]["conformance"]["strategy"]["matrix"]["engine"]) >= 2
    help_text = subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120).stdout
    for option in set(re.findall(r"(--(?:engine|benchmark|report-dir|baseline|kvbench-[a-z-]+|junit-xml|dist)\b)",
                                 text)):
        assert option in help_text, f"the workflow passes {option}, which pytest does not know"
    assert "-n auto" in text and "--baseline" in text and "actions/upload-artifact" in text
    assert "--name kvbench-benchmarks-main" in text and "kvbench-benchmarks-${{ github.ref == 'refs/heads/main'" \
        " && 'main'" in text
    assert build_parser()  # the CLI the merge instructions of docs/benchmarks.md use is importable


def test_a_storm_benchmarks_engines_stay_in_one_shard() -> None:
    """Engines of one scenario are served side by side: splitting them would unpair their repeats."""
    def scenario_unit(nodeid: str) -> str:
        return nodeid.split("[", 1)[0]

    ids = [f"suites/benchmarks/test_storms.py::test_{s}[{e}]" for s in ("a", "b", "c", "d") for e in ("ref", "swap")]
    parts = [in_shard(ids, Shard(i, 2), unit_of=scenario_unit) for i in (1, 2)]
    assert parts[0] | parts[1] == set(ids) and not parts[0] & parts[1]
    for part in parts:
        assert part and all(n.replace("[ref]", "[swap]") in part for n in part if n.endswith("[ref]"))
