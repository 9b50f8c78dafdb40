"""One server per distinct launch where every launch is a fresh start (a peer such as vLLM): the plan-ordered
test order (:mod:`kvbench.plugin.launch_order`) and the server adapter's sharing rules
(:class:`kvbench.engines.http.server.ServerAdapter`), against the stub server launched as a preset's command
(``cmd=``: never reconfigured in place, as a peer)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.engines.base import GenRequest, Knobs
from kvbench.engines.http.openai import KnobsNotSettable
from kvbench.engines.http.server import ServerAdapter
from kvbench.launch import background, placement
from kvbench.launch.process import ServerProcess, group_alive, group_members
from kvbench.models.builtin import builtin_checkpoint
from kvbench.plugin.launch_order import Planned, ordered

STUB = "{python} -m kvbench.testing.stub_server --port {port}"
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(builtin_checkpoint("tiny"))


# ------------------------------------------------------------------------------ the order from a plan


def test_a_plan_groups_each_launchs_tests_and_keeps_the_rest_in_order():
    a, b, c = ("a",), ("b",), ("c",)
    plan = {"t1": Planned([a]), "t2": Planned([b]), "t3": Planned([a]), "t4": Planned([c]), "t5": Planned([b]),
            "t6": Planned([])}
    assert ordered(["t1", "t2", "t3", "t4", "t5", "t6", "t7"], plan) == ["t6", "t7", "t1", "t3", "t2", "t5", "t4"], \
        "tests that launched nothing or are unknown first, in order; then each launch's tests together"


def test_a_test_moving_between_launches_brings_up_the_launch_the_next_tests_share():
    a, b = ("a",), ("b",)
    # t2 runs on a, then on b: it goes where a is up, and b's tests follow it
    plan = {"t1": Planned([b]), "t2": Planned([a, b]), "t3": Planned([a]), "t4": Planned([b])}
    assert ordered(["t1", "t2", "t3", "t4"], plan) == ["t2", "t1", "t4", "t3"]
    # a failed test stops its server: it comes last among those sharing it
    plan = {"t1": Planned([a], failed=True), "t2": Planned([a]), "t3": Planned([a])}
    assert ordered(["t1", "t2", "t3"], plan) == ["t2", "t3", "t1"]
    # one that shares its launch with no other (a refused launch, an expected failure) keeps its place: its
    # start then overlaps the tests after it instead of running alone at the end
    plan = {"t1": Planned([b], failed=True), "t2": Planned([a]), "t3": Planned([a])}
    assert ordered(["t1", "t2", "t3"], plan) == ["t1", "t2", "t3"]


# ------------------------------------------------------------------------------ N checks, K launches

CHECKS = """
import contextlib
import os
import pytest
from kvbench.engines.base import GenRequest, Knobs

R = [GenRequest("r", [3, 4], 2)]
SHIFT = int(os.environ.get("POOL_SHIFT", "0"))  # another sizing of every check's pool: a plan gone stale

@pytest.mark.parametrize("blocks", [24, 48, 24, 96, 48, 24], ids=["c1", "c2", "c3", "c4", "c5", "c6"])
def test_check(engine, blocks):
    blocks += SHIFT
    result = engine.generate(R, Knobs(block_size=16, num_gpu_blocks=blocks))
    assert result.counters.get("num_gpu_blocks", blocks) == blocks, "the check ran on a server of its own pool"
"""


def _launches(log_dir: Path) -> list[str]:
    """The pool each server in ``log_dir`` was started with, in start order (kvbench writes the command first)."""
    pools = []
    for log in sorted(log_dir.glob("*.log")):
        argv = log.read_text().splitlines()[0].split()
        pools.append(argv[argv.index("--num-gpu-blocks-override") + 1])
    return pools


@pytest.mark.server
def test_n_checks_with_k_distinct_launches_start_k_servers_in_order(pytester: pytest.Pytester, model_dir: str,
                                                                     tmp_path: Path, monkeypatch):
    """Six checks, three distinct launches, one server at a time: the first run (no plan yet) starts a server at
    each change of launch (six: no two neighbours share one); the next one, ordered by the plan the first left,
    starts exactly three, each launch's checks one after another; every verdict is the same."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    pytester.makepyfile(test_checks=CHECKS)
    runs = []
    logs = tmp_path / "logs"  # the same engine spec both times (a log_dir of its own would be another engine)
    engine = f"server:preset=reference,cmd={STUB},keep_servers=1,log_dir={logs}"
    for _ in (1, 2):
        shutil.rmtree(logs, ignore_errors=True)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "--engine", engine,
                                               "--kvbench-model", model_dir, "--report-dir", str(tmp_path / "r"))
        result.assert_outcomes(passed=6)
        order = [line.split("[")[1].split("]")[0].split("-")[-1] for line in result.outlines
                 if "::test_check[" in line and "PASSED" in line]
        runs.append((order, _launches(logs)))
    (first_order, first_pools), (second_order, second_pools) = runs
    assert first_order == ["c1", "c2", "c3", "c4", "c5", "c6"] and first_pools == ["24", "48", "24", "96", "48", "24"]
    assert second_pools == ["24", "48", "96"], "one server per distinct launch, in the order the plan groups them"
    assert second_order == ["c1", "c3", "c6", "c2", "c5", "c4"]
    assert list(Path(tmp_path / "cache" / "launch-plans").glob("*.json")), "the plan is kept in $KVBENCH_CACHE"


@pytest.mark.server
def test_a_stale_plan_never_stops_a_server_it_does_not_know_and_starts_nothing_ahead(
        pytester: pytest.Pytester, model_dir: str, tmp_path: Path, monkeypatch):
    """After the checks change how they size their pools, the plan names launches no test makes any more: the
    run is still ordered by it (each old launch's checks together), and the servers of the new launches, which
    the plan does not know, are kept between the checks that share them, not stopped after each; nothing is
    started ahead from a plan the run does not confirm. The run after that, on its fresh plan, starts each launch
    once again."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    pytester.makepyfile(test_checks=CHECKS)
    logs = tmp_path / "logs"
    engine = f"server:preset=reference,cmd={STUB},keep_servers=1,log_dir={logs}"
    pools = []
    for shift in ("0", "0", "8", "8"):
        monkeypatch.setenv("POOL_SHIFT", shift)
        shutil.rmtree(logs, ignore_errors=True)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--engine", engine,
                                               "--kvbench-model", model_dir, "--report-dir", str(tmp_path / "r"))
        result.assert_outcomes(passed=6)
        pools.append(_launches(logs))
    assert pools[1] == ["24", "48", "96"]
    assert pools[2] == ["32", "56", "104"], "the stale plan's groups hold: no server of an unknown launch stopped"
    assert pools[3] == ["32", "56", "104"]


@pytest.mark.server
def test_without_a_plan_nothing_moves_and_other_engines_keep_their_places(pytester: pytest.Pytester,
                                                                          model_dir: str, tmp_path: Path,
                                                                          monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    pytester.makepyfile(test_checks=CHECKS)
    engine = f"server:preset=reference,cmd={STUB},keep_servers=1,log_dir={tmp_path / 'logs'}"
    args = ["-p", "no:cacheprovider", "--collect-only", "-q", "--engine", "reference", "--engine", engine,
            "--kvbench-model", model_dir]
    before = [line for line in pytester.runpytest_subprocess(*args).outlines if "::" in line]
    assert len(before) == 12
    # a plan for the server engine reorders its tests only, in the slots they held
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--engine", "reference", "--engine", engine,
                                           "--kvbench-model", model_dir, "--report-dir", str(tmp_path / "r"))
    result.assert_outcomes(passed=12)
    after = [line for line in pytester.runpytest_subprocess(*args).outlines if "::" in line]
    assert [n for n in after if "[reference-" in n] == [n for n in before if "[reference-" in n]
    assert sorted(after) == sorted(before) and after != before
    slots = [i for i, n in enumerate(before) if "[server:" in n]
    assert [i for i, n in enumerate(after) if "[server:" in n] == slots


# ------------------------------------------------------------------------------ what may share a server

REQUESTS = [GenRequest(f"r{i}", [3 + i] * 40, 8) for i in range(6)]  # 48 tokens each: 3 blocks of 16


def _adapter(model_dir: str, tmp_path: Path) -> ServerAdapter:
    return ServerAdapter(model_dir, {"preset": "reference", "cmd": STUB, "log_dir": str(tmp_path), "keep_servers": "1"})


@pytest.mark.server
def test_an_unpressured_run_rides_on_the_running_server_of_its_launch_group_in_waves(model_dir, tmp_path):
    adapter = _adapter(model_dir, tmp_path)
    pressured = Knobs(block_size=16, num_gpu_blocks=8)  # two requests at a time
    roomy = Knobs(block_size=16, num_gpu_blocks=400)
    try:
        adapter.mark_run(REQUESTS, unpressured=False)
        adapter.generate(REQUESTS, pressured)
        server = adapter.process
        adapter.mark_run(REQUESTS, unpressured=True)
        calm = adapter.generate(REQUESTS, roomy)
        assert adapter.process is server and len(adapter.logs) == 1, "the same launch group: no new start"
        assert any("in 3 waves of 2, 2, 2 requests" in e for e in calm.evidence), calm.evidence
        assert calm.counters["num_gpu_blocks"] == 8
        adapter.mark_run(REQUESTS, unpressured=False)
        stormy = adapter.generate(REQUESTS, pressured)
        assert not any("waves" in e for e in stormy.evidence), "the same requests under pressure go all at once"
        # a pressured run gets exactly its pool: a larger one is another launch
        adapter.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=12))
        assert adapter.process is not server and not group_alive(server.pgid), "one server at a time"
    finally:
        adapter.close()


@pytest.mark.server
def test_a_check_whose_behaviour_knobs_differ_never_runs_on_anothers_server(model_dir, tmp_path):
    adapter = _adapter(model_dir, tmp_path)
    try:
        adapter.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=8))
        plain = adapter.process
        for other in (Knobs(enable_prefix_caching=True), Knobs(scheduling_policy="priority"),
                      Knobs(max_num_seqs=2), Knobs(block_size=32, num_gpu_blocks=200)):
            adapter.mark_run(REQUESTS, unpressured=True)
            knobs = Knobs(block_size=16, num_gpu_blocks=400).merged(other)
            result = adapter.generate(REQUESTS, knobs)
            assert adapter.process is not plain, f"{other}: another behaviour, another server"
            assert any("served by a server launched with" in e for e in result.evidence), result.evidence
            # its own launch: the pool a pressured run of these requests gets (the largest twice: 6 blocks of 16,
            # 3 of 32), rounded to the power of two of blocks pressured checks share, in waves
            argv = Path(adapter.logs[-1]).read_text().splitlines()[0].split()
            assert argv[argv.index("--num-gpu-blocks-override") + 1] == ("8" if "block_size" not in
                                                                         other.as_dict() else "4")
            plain = adapter.process
        # a launch the server is to refuse (a check of its refusal) keeps the pool it asked for
        adapter.mark_run(REQUESTS, unpressured=True)
        adapter.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=400, max_num_seqs=0))
        argv = Path(adapter.logs[-1]).read_text().splitlines()[0].split()
        assert argv[argv.index("--num-gpu-blocks-override") + 1] == "400"
        # defaults are stated on every launch: asking for one explicitly is the same launch as leaving it unset
        assert adapter.launch_key(Knobs(enable_prefix_caching=False)) == adapter.launch_key(Knobs())
        assert "--no-enable-prefix-caching" in adapter.launch_key(Knobs())
    finally:
        adapter.close()


@pytest.mark.server
def test_an_unpressured_run_the_running_pool_cannot_hold_gets_its_own_launch(model_dir, tmp_path):
    adapter = _adapter(model_dir, tmp_path)
    try:
        adapter.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=3))  # one request at a time
        small = adapter.process
        big = [GenRequest("big", [5] * 100, 8)]  # 7 blocks: the running pool cannot take it
        adapter.mark_run(big, unpressured=True)
        adapter.generate(big, Knobs(block_size=16, num_gpu_blocks=400))
        assert adapter.process is not small
    finally:
        adapter.close()


def test_vllm_keeps_one_server_at_a_time_by_default(model_dir):
    if sys.platform != "linux":
        pytest.skip("vLLM's preset is located on Linux only")
    from kvbench.engines.http.server import ONE_AT_A_TIME

    assert "vllm" in ONE_AT_A_TIME
    assert ServerAdapter.starts_fresh({"preset": "vllm"}) and not ServerAdapter.starts_fresh({"preset": "reference"})
    assert ServerAdapter.starts_fresh({"preset": "reference", "cmd": STUB})


@pytest.mark.server
def test_knob_sets_that_differ_only_in_what_the_preset_fixes_share_a_launch(model_dir, tmp_path):
    """vLLM always preempts by recompute (no flag): a run asking for it and one saying nothing launch the same
    command, so whichever started the server, the other finds recompute declared on it instead of skipping."""
    adapter = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path), "keep_servers": "1"})
    # prefix caching off: the stub takes no cache_salt, so a caching stub would never be reused (it carries state)
    pool = Knobs(block_size=16, num_gpu_blocks=8, max_model_len=48, enable_prefix_caching=False)
    try:
        adapter.generate(REQUESTS, pool)
        first = adapter.process
        try:
            adapter.generate(REQUESTS, pool.merged(Knobs(preemption_mode="recompute")))
        except KnobsNotSettable as e:  # a skip would hide it: on vLLM two checks went skipped so
            pytest.fail(f"the shared launch does not declare what the preset fixes: {e}")
        assert adapter.process is first and len(adapter.logs) == 1
    finally:
        adapter.close()
    adapter = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path), "keep_servers": "1"})
    try:
        # the unpressured run after a pressured one that asked for recompute and started the server (the stop
        # checks' order): one launch group, so it rides on that server in waves instead of starting a roomy one
        # (vLLM's EOS check started a second server for it)
        adapter.mark_run(REQUESTS, unpressured=False)
        adapter.generate(REQUESTS, pool.merged(Knobs(preemption_mode="recompute")))
        first = adapter.process
        adapter.mark_run(REQUESTS, unpressured=True)
        calm = adapter.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=400, enable_prefix_caching=False))
        assert adapter.process is first and len(adapter.logs) == 1, "a fixed knob asked for or not: one group"
        assert any("waves" in e for e in calm.evidence), calm.evidence
    finally:
        adapter.close()


@pytest.mark.server
@pytest.mark.skipif(not background.available(), reason="no privilege to bring a thread back from the idle class")
def test_a_server_started_ahead_starts_in_the_idle_class_and_serves_in_the_normal_one(model_dir, tmp_path):
    """A start ahead takes only CPU time nothing else wants (``SCHED_IDLE``, inherited by the threads and processes
    it makes); the run that claims it gets it back in the normal class, every thread of its group.
    ``background_starts=off``: in the normal class, as before."""
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": f"{STUB} --start-delay 1",
                                        "log_dir": str(tmp_path), "keep_servers": "2"})
    first, coming = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12))
    try:
        adapter.generate(REQUESTS, first)
        assert adapter.process.pgid is not None and background.idle_threads(adapter.process.pgid) == 0, \
            "a start the run waits for is in the normal class"
        assert adapter.prestart(coming)
        ahead = adapter._starting[adapter.launch_key(coming)]
        assert ahead.idle and background.idle_threads(ahead.server.pgid) >= 1
        grouped = background.autogroup_nice(ahead.server.pgid) is not None  # a kernel that groups by session
        if grouped:
            assert background.autogroup_nice(ahead.server.pgid) == background.IDLE_AUTOGROUP_NICE
        result = adapter.generate(REQUESTS, coming)
        assert result.counters["num_gpu_blocks"] == 12 and len(adapter.logs) == 2
        assert background.idle_threads(ahead.server.pgid) == 0, "claimed: every thread back in the normal class"
        if grouped:
            assert background.autogroup_nice(ahead.server.pgid) == 0, "claimed: its session's autogroup too"
    finally:
        adapter.close()
    plain = ServerAdapter(model_dir, {"preset": "reference", "cmd": STUB, "log_dir": str(tmp_path),
                                      "background_starts": "off"})
    try:
        assert plain.start_ahead == 2, "in the normal class, two side by side keep two cores busy"
        assert plain.prestart(first) and not plain._starting[plain.launch_key(first)].idle
    finally:
        plain.close()


def _states(pgid: int) -> set[str]:
    """The process states (``ps`` letters: T stopped) of group ``pgid``'s live members."""
    return {state for _, state in group_members(pgid) or () if state != "Z"}


def _soon(condition, within: float = 3.0) -> bool:
    """Whether ``condition()`` holds within ``within`` seconds: SIGSTOP and SIGCONT are delivered asynchronously, so
    a process read right after the signal may not show it yet."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _stopped_soon(pgid: int) -> bool:
    """Whether every live member of group ``pgid`` shows stopped (``T``) soon (:func:`_soon`)."""
    return _soon(lambda: _states(pgid) <= {"T"})


def _running_soon(pgid: int) -> bool:
    """Whether no live member of group ``pgid`` shows stopped soon (:func:`_soon`)."""
    return _soon(lambda: "T" not in _states(pgid))


@pytest.mark.server
def test_a_paused_server_group_is_resumed_and_can_still_be_stopped(tmp_path):
    # The child says it is asleep (a file) before the group is paused: a child still being forked when SIGSTOP
    # goes to the group is not stopped by it (one full-suite run saw that, the wait for two members timing out).
    ready = tmp_path / "child-asleep"
    child = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    server = ServerProcess([sys.executable, "-c", code], tmp_path / "paused.log")
    server.start()
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and len(group_members(server.pgid) or ()) >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the server's child did not start within 30 s"
        assert server.pause() and _stopped_soon(server.pgid) and _states(server.pgid), "every process stopped"
        server.resume()
        assert _running_soon(server.pgid)
        assert server.pause()
        started = time.monotonic()
        server.stop(term_timeout=5.0)  # SIGTERM reaches a paused group: it is resumed to act on it
        assert not group_alive(server.pgid) and time.monotonic() - started < 4.0, "stopped by SIGTERM, not SIGKILL"
    finally:
        server.stop()


def test_the_idle_class_is_inherited_and_undone_for_a_whole_group():
    if not background.available():
        pytest.skip("no privilege to bring a thread back from the idle class")
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        assert background.to_idle(proc.pid)
        deadline = time.monotonic() + 10
        while len(placement.thread_ids(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert background.idle_threads(proc.pid) == 2, "the thread made after inherits the class"
        if Path(f"/proc/{proc.pid}/autogroup").exists():  # a kernel that groups by session: the session reniced too
            assert background.autogroup_nice(proc.pid) == background.IDLE_AUTOGROUP_NICE
        assert background.to_normal(proc.pid) == 2 and background.idle_threads(proc.pid) == 0
        assert background.autogroup_nice(proc.pid) in (0, None)
    finally:
        proc.kill()
        proc.wait(10)


def test_a_process_in_the_callers_session_leaves_the_callers_autogroup_alone():
    """Only a session of the server's own is reniced: the caller's autogroup (pytest's, the user's shell's) is not."""
    if not background.available():
        pytest.skip("no privilege to bring a thread back from the idle class")
    own = Path(f"/proc/{os.getpid()}/autogroup")
    before = own.read_text() if own.exists() else None
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # same session as the caller
    try:
        assert background.to_idle(proc.pid)
        assert background.autogroup_nice(proc.pid) is None, "no session of its own: no autogroup of its own"
        assert (own.read_text() if own.exists() else None) == before
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.server
def test_a_server_a_later_test_needs_is_kept_beside_the_one_serving(model_dir, tmp_path):
    """keep_servers=1 keeps one server, and besides it those the plan says later tests need (within ready_ahead):
    two tests alternating between two launches (caching off, then on, each) start each launch once."""
    adapter = _adapter(model_dir, tmp_path)
    off, on, other = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12, 16))
    key = adapter.launch_key
    try:
        adapter.plan_ahead([off, on])  # what the plan says the coming tests need: the two, twice
        adapter.generate(REQUESTS, off)
        adapter.generate(REQUESTS, on)
        assert {key(off), key(on)} <= adapter.live_launches(), "the server a later test needs was stopped"
        adapter.generate(REQUESTS, off)
        assert len(adapter.logs) == 2, "a launch a later test needed was started again"
        adapter.plan_ahead([])  # no later test needs either: one server at a time again
        adapter.generate(REQUESTS, other)
        assert adapter.live_launches() == {key(other)} and len(adapter.logs) == 3
    finally:
        adapter.close()


@pytest.mark.server
def test_a_server_started_ahead_serves_the_run_that_needs_it_and_is_stopped_when_none_does(model_dir, tmp_path):
    """``prestart`` starts the launch a coming run needs while another serves; that run waits for it instead of
    starting its own; a server started ahead that no later test needs is stopped with its process group."""
    # each stub takes a second to listen, so the two started ahead are still starting when the third is asked for
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": f"{STUB} --start-delay 1",
                                        "log_dir": str(tmp_path), "keep_servers": "1", "start_ahead": "2"})
    first, coming = Knobs(block_size=16, num_gpu_blocks=8), Knobs(block_size=16, num_gpu_blocks=12)
    try:
        adapter.generate(REQUESTS, first)
        running = adapter.process
        assert adapter.prestart(coming) and adapter.launch_key(coming) in adapter.live_launches()
        assert not adapter.prestart(coming), "a launch starting ahead is not started twice"
        later = Knobs(block_size=16, num_gpu_blocks=16)
        assert adapter.prestart(later), "two servers start ahead side by side (start_ahead=2)"
        assert not adapter.prestart(Knobs(block_size=16, num_gpu_blocks=20)), "no more than start_ahead at once"
        assert adapter.launch_key(first) in adapter.live_launches()
        assert len(adapter.logs) == 3 and running.running(), "started beside the running one"
        result = adapter.generate(REQUESTS, coming)
        assert len(adapter.logs) == 3, "the run waited for the server started ahead instead of starting another"
        assert result.counters["num_gpu_blocks"] == 12
        assert not group_alive(running.pgid), "one server kept (keep_servers=1) once the new one serves"
        assert adapter.prestart(first)
        ahead = [s.server for s in adapter._starting.values()]
        adapter.stop_servers_except([adapter.launch_key(coming)])
        assert not any(group_alive(s.pgid) for s in ahead) and adapter.live_launches() == {adapter.launch_key(coming)}
    finally:
        adapter.close()
    assert not adapter.live_launches()


@pytest.mark.server
def test_a_cap_on_requests_at_once_that_a_run_cannot_reach_shares_the_default_launch(model_dir, tmp_path):
    """vLLM's max_num_seqs only caps the running requests (default 128): a run of 6 asking for a cap of 6 or 16
    runs every request at once either way, so it is served by the launch that leaves the cap at its default; a cap
    of 2 binds and gets its own launch; and where args= sets a cap of its own, the asked one is kept."""
    pool = Knobs(block_size=16, num_gpu_blocks=40, max_model_len=48, enable_prefix_caching=False)
    adapter = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path / "a"),
                                        "keep_servers": "2"})
    try:
        for cap in (len(REQUESTS), 16, None):
            result = adapter.generate(REQUESTS, pool.merged(Knobs(max_num_seqs=cap)))
            assert [o.finish_reason for o in result.outputs] == ["length"] * len(REQUESTS)
        assert len(adapter.logs) == 1 and "--max-num-seqs" not in Path(adapter.logs[0]).read_text().splitlines()[0]
        assert any("cannot bind a run of 6 requests" in line for line in adapter.generate(
            REQUESTS, pool.merged(Knobs(max_num_seqs=16))).evidence)
        adapter.generate(REQUESTS, pool.merged(Knobs(max_num_seqs=2)))
        assert len(adapter.logs) == 2 and "--max-num-seqs 2" in Path(adapter.logs[1]).read_text().splitlines()[0]
    finally:
        adapter.close()
    own = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path / "b"),
                                    "args": "--max-num-seqs 4"})
    try:
        # the cap asked for is kept, so the server's own 4 is seen to differ (a skip naming it), not run as if 6
        with pytest.raises(pytest.skip.Exception, match="runs max_num_seqs=4"):
            own.generate(REQUESTS, pool.merged(Knobs(max_num_seqs=6)))
        assert "--max-num-seqs 6" in Path(own.logs[0]).read_text().splitlines()[0]
    finally:
        own.close()


def _wait_up(adapter: ServerAdapter, knobs: Knobs, timeout: float = 60.0) -> None:
    import time

    starting = adapter._starting[adapter.launch_key(adapter.launch_knobs(knobs))]
    deadline = time.monotonic() + timeout
    while starting.still_starting():
        assert time.monotonic() < deadline, "the stub server did not come up"
        time.sleep(0.1)


@pytest.mark.server
def test_only_servers_still_starting_count_against_start_ahead_and_ready_ahead_bounds_the_rest(model_dir, tmp_path):
    """One start at a time (start_ahead=1): a second waits while the first starts, and begins once the first is
    up and waiting; no more than ready_ahead (2) wait or start ahead in all."""
    # each stub takes a second to listen, as a server importing a framework does: "still starting" is then certain
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": f"{STUB} --start-delay 1",
                                        "log_dir": str(tmp_path), "keep_servers": "1", "start_ahead": "1",
                                        "ready_ahead": "2"})
    a, b, c = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12, 16))
    try:
        assert adapter.reconfigurable is False
        assert adapter.prestart(a)
        assert not adapter.prestart(b), "a second start beside one still starting (start_ahead=1)"
        _wait_up(adapter, a)
        assert adapter.prestart(b), "the first is up and waiting: the next one starts"
        _wait_up(adapter, b)
        assert not adapter.prestart(c), "two started ahead already (ready_ahead=2)"
        adapter.generate(REQUESTS, a)
        assert len(adapter.logs) == 2, "the run took the server started ahead for it"
        assert adapter.prestart(c), "a claimed server leaves room for another"
    finally:
        adapter.close()


@pytest.mark.server
def test_the_plans_coming_launches_start_as_room_allows_and_a_served_one_is_not_restarted(model_dir, tmp_path):
    """``plan_ahead`` starts the coming launches in order as far as the limits allow, and goes on with the rest
    whenever a run asks for a server; a launch served and stopped (keep_servers=1) is not started again."""
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": STUB, "log_dir": str(tmp_path),
                                        "keep_servers": "1", "start_ahead": "2", "ready_ahead": "2"})
    first, second, third = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12, 16))
    key = adapter.launch_key
    try:
        adapter.plan_ahead([first, second, third])
        assert set(adapter._starting) == {key(first), key(second)}, "two start side by side, in the plan's order"
        adapter.generate(REQUESTS, first)
        assert key(third) in adapter.live_launches(), "a run asking for its server let the next one start"
        adapter.generate(REQUESTS, second)
        assert key(first) not in adapter.live_launches(), "served, stopped, and not started again"
        assert len(adapter.logs) == 3
    finally:
        adapter.close()


@pytest.mark.server
def test_a_quiet_run_pauses_starts_in_flight_that_would_not_give_way(model_dir, tmp_path):
    """``quiet`` with starts in the normal class (``background_starts=off``): on entry the servers still starting
    ahead are paused (SIGSTOP to their groups: no CPU time, and no wait for them either), and inside it a run asking
    for its server starts nothing of the plan's; a run that claims a paused one resumes it; after the block the
    paused ones go on and starting ahead resumes."""
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": f"{STUB} --start-delay 1",
                                        "log_dir": str(tmp_path), "keep_servers": "2", "start_ahead": "2",
                                        "ready_ahead": "3", "background_starts": "off"})
    first, second, third = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12, 16))
    key = adapter.launch_key
    try:
        adapter.plan_ahead([first, second, third])
        assert set(adapter._starting) == {key(first), key(second)}
        assert not any(s.yields for s in adapter._starting.values())
        starting = [s.server for s in adapter._starting.values()]
        entered = time.monotonic()
        with adapter.quiet():
            assert time.monotonic() - entered < 0.9, "the block waited for the starts in flight"
            assert all(_stopped_soon(s.pgid) for s in starting), "a start in flight was not paused"
            adapter.generate(REQUESTS, first)  # claims the paused one: resumed, waited for, served
            assert key(third) not in adapter.live_launches(), "a server started ahead during a quiet run"
            assert _states(starting[1].pgid) <= {"T"}, "the other start went on in the block"
        assert _running_soon(starting[1].pgid), "a paused start was left paused after the block"
        adapter.generate(REQUESTS, first)
        assert key(second) in adapter.live_launches(), "starting ahead did not resume after the quiet run"
    finally:
        adapter.close()


@pytest.mark.server
@pytest.mark.skipif(not background.available(), reason="no privilege to bring a thread back from the idle class")
def test_a_quiet_run_lets_starts_that_give_way_go_on(model_dir, tmp_path):
    """``quiet`` with starts that truly give way (the idle class, and their session's autogroup reniced where the
    kernel groups by session): they are not paused, and a run in the block that frees room starts the next one
    ahead, also giving way."""
    adapter = ServerAdapter(model_dir, {"preset": "reference", "cmd": f"{STUB} --start-delay 1",
                                        "log_dir": str(tmp_path), "keep_servers": "2", "start_ahead": "2",
                                        "ready_ahead": "3"})
    first, second, third = (Knobs(block_size=16, num_gpu_blocks=n) for n in (8, 12, 16))
    key = adapter.launch_key
    try:
        adapter.plan_ahead([first, second, third])
        assert all(s.yields for s in adapter._starting.values()), "a start ahead does not give way"
        starting = [s.server for s in adapter._starting.values()]
        with adapter.quiet():
            assert not any("T" in _states(s.pgid) for s in starting), "a start that gives way was paused"
            adapter.generate(REQUESTS, first)
            assert key(third) in adapter._starting, "the claim made room, and the next start ahead did not begin"
            later = adapter._starting[key(third)]
            assert later.yields and "T" not in _states(later.server.pgid)
    finally:
        adapter.close()


@pytest.mark.server
def test_an_adapter_made_beside_the_sessions_keeps_its_starts_ahead_going(model_dir, tmp_path):
    """The EOS check serves from an adapter on its own checkpoint: while it does, the session adapter's starts
    ahead go on (nothing else asks that one for a server meanwhile, so its next starts waited for the check)."""
    from kvbench.conformance.on_checkpoint import engine_on

    adapter = _adapter(model_dir, tmp_path)
    calls = []
    adapter.start_coming = lambda: calls.append(1)  # type: ignore[method-assign]
    with engine_on(adapter, model_dir) as other:
        assert other is not None and other.beside is adapter
        other.generate(REQUESTS, Knobs(block_size=16, num_gpu_blocks=8))
    assert calls, "serving beside the session adapter did not let its starts ahead go on"


@pytest.mark.server
def test_a_first_run_keeps_a_few_servers_until_a_plan_says_which_are_needed(model_dir, tmp_path):
    """vLLM's default keeps one server, next to those a launch plan says later tests need. A first run has no
    plan and goes in collection order, where tests alternate between launches: it keeps
    ``UNPLANNED_KEEP_SERVERS`` (least recently used stopped first), so going back to a launch reuses it; once a
    plan is given, one again. ``keep_servers`` set by the user holds throughout."""
    from kvbench.engines.http.server import UNPLANNED_KEEP_SERVERS

    adapter = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path)})
    pools = [Knobs(block_size=16, num_gpu_blocks=n, max_model_len=48, enable_prefix_caching=False)
             for n in (8, 10, 12)]
    try:
        assert adapter.keep_servers == 1 and adapter.kept == UNPLANNED_KEEP_SERVERS > len(pools)
        for knobs in [*pools, pools[0]]:
            adapter.generate(REQUESTS, knobs)
        assert len(adapter.logs) == len(pools), "going back to the first launch started it again"
        adapter.plan_ahead([])  # a plan that needs none of them: one kept, as before, from the next start on
        adapter.generate(REQUESTS, pools[1].merged(Knobs(num_gpu_blocks=14)))
        assert adapter.kept == 1 and len(adapter.running_servers()) == 1
    finally:
        adapter.close()
    mine = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path), "keep_servers": "1"})
    assert mine.kept == 1, "keep_servers given: no more are kept on a first run"
    mine.close()


@pytest.mark.server
def test_a_run_the_server_is_to_refuse_is_never_served_by_another_pool(model_dir, tmp_path):
    """An unpressured run rides on a running server of its launch group whose pool holds it, except where its
    knobs are ones the server is to refuse (a pool of -1 blocks): the check of that refusal needs the server to see
    them. Seen on a first vLLM run (no plan, collection order): ``num_gpu_blocks=-1`` was served by the running
    16-block server, and the check saw no error."""
    adapter = ServerAdapter(model_dir, {"preset": "vllm", "cmd": STUB, "log_dir": str(tmp_path)})
    pool = Knobs(block_size=16, num_gpu_blocks=16, max_model_len=48, enable_prefix_caching=False)
    try:
        adapter.mark_run(REQUESTS, unpressured=True)
        adapter.generate(REQUESTS, pool)
        adapter.mark_run(REQUESTS, unpressured=True)
        with contextlib.suppress(Exception):  # whatever the stub makes of it: not the running server's answer
            adapter.generate(REQUESTS, pool.merged(Knobs(num_gpu_blocks=-1)))
        assert len(adapter.logs) == 2, "the run of a pool of -1 blocks was served by the running 16-block server"
        assert "-1" in Path(adapter.logs[-1]).read_text().splitlines()[0], "launched as asked"
    finally:
        adapter.close()
