"""The server's engine in its own process (``reference_engine.serve.engine_process``).

The HTTP behaviour over it is tested in ``test_serve.py`` (the CLI runs the engine in its own process
by default); here: the pipe protocol itself (outputs equal to the engine run alone, under preemption;
refusals, aborts, a failing step, a flood of large commands) and what the server does when the engine
process dies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.engine import RequestRejected
from reference_engine.serve.command_line import READY_PREFIX
from reference_engine.serve.engine_loop import EngineFailure
from reference_engine.serve.engine_process import (
    EngineInfo,
    EngineProcess,
    EngineStartError,
    _EngineCore,
    default_engine_threads,
    split_cpus,
)
from tests.engine.engine_steps import core_batches

START_TIMEOUT_S = 60
GREEDY_LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # 3-token prompts: 1,003 of 1,024


async def _final(outputs: asyncio.Queue, timeout: float = 120.0):
    """The finished output of a request (or the EngineFailure it got instead)."""
    async def until_finished():
        while True:
            item = await outputs.get()
            if isinstance(item, EngineFailure) or item.finished:
                return item

    return await asyncio.wait_for(until_finished(), timeout)


def _run(engine: EngineProcess, scenario) -> object:
    """Run ``scenario(engine)`` on a fresh event loop with ``engine`` started on it (not stopped)."""
    async def main():
        engine.start(asyncio.get_running_loop())
        return await scenario(engine)

    return asyncio.run(main())


@pytest.fixture
def roomy(tiny_ckpt: str) -> Iterator[EngineProcess]:
    engine = EngineProcess.spawn(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=2048))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.mark.parametrize("output_poll_s", [0.0, 0.0002], ids=["woken", "polled"])
def test_outputs_through_the_pipe_equal_the_engine_alone_under_preemption(tiny_ckpt: str,
                                                                          output_poll_s: float) -> None:
    # 12 blocks of 8 tokens; a request of 5 + 60 tokens needs 9: any two that overlap preempt.
    config = EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=12, block_size=8, max_num_seqs=8)
    prompts = [[3 + i, 17, 29 + 7 * i, 41, 5] for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = [LLMEngine(config).generate([p], params)[0] for p in prompts]

    async def scenario(engine: EngineProcess):
        queues = await asyncio.gather(*[engine.add(f"r{i}", p, params) for i, p in enumerate(prompts)])
        finals = [await _final(q) for q in queues]
        return finals, engine.stats()

    engine = EngineProcess.spawn(config, output_poll_s=output_poll_s)
    try:
        finals, stats = _run(engine, scenario)
    finally:
        engine.stop()
    assert stats.counters.preemptions_recompute > 0, "the pool never ran dry: nothing was preempted"
    for got, want in zip(finals, alone, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "length"
        assert [lp.token_id for lp in got.logprobs] == got.token_ids  # one entry per token, in order
        assert [[t for t, _ in lp.top] for lp in got.logprobs] == [[t for t, _ in lp.top] for lp in want.logprobs]
    assert sum(f.num_preemptions for f in finals) == stats.counters.preemptions_recompute
    assert stats.counters.generated_tokens == 6 * 60 and stats.counters.aborts == 0
    assert stats.gauges.num_free_gpu_blocks == stats.gauges.num_gpu_blocks == 12


def test_a_refused_request_raises_and_the_others_are_served(roomy: EngineProcess) -> None:
    too_long = [1 + i % 500 for i in range(roomy.info.config.max_model_len + 5)]

    async def scenario(engine: EngineProcess):
        ok = await engine.add("ok", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        with pytest.raises(RequestRejected, match="max_model_len"):
            await engine.add("too-long", too_long, SamplingParams(max_tokens=4))
        return await _final(ok)

    final = _run(roomy, scenario)
    assert final.finish_reason == "length" and len(final.token_ids) == 8


def test_an_abort_ends_the_request_and_frees_its_blocks(roomy: EngineProcess) -> None:
    async def scenario(engine: EngineProcess):
        outputs = await engine.add("long", [9, 8, 7], GREEDY_LONG)
        first = await asyncio.wait_for(outputs.get(), 60)
        engine.abort("long")
        final = await _final(outputs)
        for _ in range(100):  # the stats of the step that aborted arrive with it, or one batch later
            if engine.stats().gauges.num_running == 0:
                break
            await asyncio.sleep(0.05)
        return first, final, engine.stats()

    first, final, stats = _run(roomy, scenario)
    assert not first.finished
    assert final.finished and final.finish_reason == "abort" and len(final.token_ids) < GREEDY_LONG.max_tokens
    assert stats.gauges.num_running == 0 and stats.gauges.num_free_gpu_blocks == stats.gauges.num_gpu_blocks
    assert stats.counters.aborts == 1, "the engine counted the abort of a request in flight"


def test_a_flood_of_large_commands_does_not_deadlock_the_pipe(roomy: EngineProcess) -> None:
    # ~250 KB of prompts written while outputs stream back: with blocking writes on both ends of one
    # pipe, a loop that wrote commands itself could block on a full pipe while the engine blocks
    # writing outputs to it.
    n, length = 64, 900
    prompts = [[1 + (i * 31 + j) % 500 for j in range(length)] for i in range(n)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def scenario(engine: EngineProcess):
        queues = await asyncio.gather(*[engine.add(f"flood-{i}", p, params) for i, p in enumerate(prompts)])
        return await asyncio.gather(*[_final(q) for q in queues])

    finals = _run(roomy, scenario)
    assert [len(f.token_ids) for f in finals] == [3] * n


class _StepFailsOnce:
    """An engine whose second step raises, as a broken kernel would."""

    def __init__(self, engine: LLMEngine):
        self._engine, self.calls = engine, 0

    def step(self):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected step failure")
        return self._engine.step()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _front_on_a_thread(engine) -> tuple[EngineProcess, threading.Thread]:
    """An ``EngineProcess`` front end speaking to an engine core on a thread of this process (the same
    pipe protocol, no spawn), so a test can hand it a patched engine."""
    server_end, core_end = multiprocessing.Pipe(duplex=True)

    def core() -> None:
        try:
            _EngineCore(engine, core_end).run()
        finally:
            core_end.close()

    thread = threading.Thread(target=core, daemon=True)
    thread.start()
    return EngineProcess(server_end, EngineInfo.of(engine)), thread


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_serves_on(tiny_ckpt: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))
    front, thread = _front_on_a_thread(_StepFailsOnce(engine))

    async def scenario(front: EngineProcess):
        failed = await _final(await front.add("a", [5, 6], SamplingParams(max_tokens=8, temperature=0.0)))
        served = await _final(await front.add("b", [5, 6], SamplingParams(max_tokens=3, temperature=0.0,
                                                                           ignore_eos=True)))
        return failed, served

    try:
        failed, served = _run(front, scenario)
    finally:
        front.stop()
        thread.join(10)
    assert isinstance(failed, EngineFailure) and "injected step failure" in str(failed)
    assert served.finish_reason == "length" and len(served.token_ids) == 3
    assert not thread.is_alive(), "the engine core did not stop when told to"
    assert engine.block_manager.is_whole() and not engine.has_unfinished_requests()


def test_callers_cancelled_while_adding_leave_nothing_behind(tiny_ckpt: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))
    front, thread = _front_on_a_thread(engine)
    too_long = [5] * (engine.config.max_model_len + 1)

    async def scenario(front: EngineProcess):
        accepted = asyncio.ensure_future(front.add("accepted", [5, 6], GREEDY_LONG))
        refused = asyncio.ensure_future(front.add("refused", too_long, SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)  # both commands are on their way: the callers now hang up
        accepted.cancel()
        refused.cancel()
        front.abort("accepted")  # the contract: a caller cancelled while adding still aborts
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if front.num_waiting_on() == 0 and front.stats().gauges.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return front.num_waiting_on()

    try:
        waiting_on = _run(front, scenario)
    finally:
        front.stop()
        thread.join(10)
    assert waiting_on == 0, "a request whose caller was cancelled is still waited on"
    assert engine.block_manager.is_whole() and not engine.has_unfinished_requests()


class _Unrecoverable(_StepFailsOnce):
    """Every step raises, and so does every abort: the engine cannot even be cleaned up."""

    def step(self):
        raise RuntimeError("injected step failure")

    def abort_request(self, request_id: str) -> bool:
        raise RuntimeError("injected abort failure")


def test_an_engine_that_cannot_clean_up_is_declared_broken_on_the_server_side(tiny_ckpt: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))
    front, thread = _front_on_a_thread(_Unrecoverable(engine))

    async def scenario(front: EngineProcess):
        failed = await _final(await front.add("a", [5, 6], SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 60
        while front.broken is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineFailure, match="not serving"):
            await front.add("b", [5, 6], SamplingParams(max_tokens=4))
        return failed

    try:
        failed = _run(front, scenario)
    finally:
        front.stop()
        thread.join(10)
    assert isinstance(failed, EngineFailure) and "injected step failure" in str(failed)
    assert front.broken is not None and "injected abort failure" in front.broken


def test_a_request_id_already_in_flight_is_refused_and_the_first_keeps_its_outputs(roomy: EngineProcess) -> None:
    # long enough to be still in flight when the second add arrives, even on a loaded machine (with 6 tokens
    # the first finished before it once in a clean-clone CI run, and the id was free again)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)

    async def scenario(engine: EngineProcess):
        first = await engine.add("same", [5, 6, 7], params)
        with pytest.raises(RequestRejected, match="already in use"):
            await engine.add("same", [8, 9], params)
        return await _final(first)

    final = _run(roomy, scenario)
    assert final.finish_reason == "length" and len(final.token_ids) == 256 and final.prompt_token_ids == [5, 6, 7]


def test_a_bad_config_is_reported_with_the_engines_message(tiny_ckpt: str) -> None:
    with pytest.raises(EngineStartError, match="max_model_len") as info:
        EngineProcess.spawn(EngineConfig(model=tiny_ckpt, max_model_len=1 << 20))
    assert info.value.kind == "config"
    with pytest.raises(EngineStartError) as info:
        EngineProcess.spawn(EngineConfig(model=str(Path(tiny_ckpt) / "missing")))
    assert info.value.kind == "load"


# ---------------------------------------------------------------------- the server when its engine dies
def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (not multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(child)
    raise AssertionError(f"server {server_pid} has no engine process")


@pytest.fixture
def server(tiny_ckpt: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    flags = getattr(request, "param", [])
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "reference_engine.serve", "--model", tiny_ckpt, "--port", "0",
                             *flags], stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), f"no ready line: {line!r}\n{(tmp_path / 'server.log').read_text()}"
        yield line[len(READY_PREFIX):].strip(), proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
        proc.stdout.close()
        log.close()


@pytest.mark.server
def test_when_the_engine_process_dies_requests_fail_and_health_says_so(server: tuple[str, int]) -> None:
    url, pid = server
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:  # running: now its engine dies
                    os.kill(_engine_pid(pid), signal.SIGKILL)
        last = json.loads(events[-1]) if events[-1] != "[DONE]" else json.loads(events[-2])
        assert "error" in last and "engine process exited" in last["error"]["message"], events[-3:]
        health = c.get("/health")
        assert health.status_code == 503 and "engine process exited" in health.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and "not serving" in r.json()["error"]["message"]
        assert c.get("/metrics").status_code == 200  # the server itself still answers


@pytest.mark.server
@pytest.mark.parametrize("server", [["--no-engine-process"]], indirect=True)
def test_no_engine_process_steps_the_engine_on_a_thread_of_the_server(server: tuple[str, int]) -> None:
    url, pid = server
    tasks = Path(f"/proc/{pid}/task")
    assert not any((t / "children").read_text().split() for t in tasks.iterdir())  # no engine process
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4


@pytest.mark.server
def test_stopping_the_server_stops_its_engine_process(server: tuple[str, int]) -> None:
    _url, pid = server
    engine_pid = _engine_pid(pid)
    os.kill(pid, signal.SIGINT)  # the server alone, as Ctrl-C in a shell would (the engine ignores SIGINT)

    def running() -> bool:
        try:
            return Path(f"/proc/{engine_pid}/stat").read_text().split()[2] != "Z"  # Z: exited, not yet reaped
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(), "the engine process outlived its server"


@pytest.mark.server
@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_the_cli_exits_2_naming_a_field_the_model_refuses_or_the_model_it_cannot_load(tiny_ckpt: str, mode: str,
                                                                                      tmp_path: Path) -> None:
    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reference_engine.serve", "--port", "0", mode, *flags],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})

    too_long = serve("--model", tiny_ckpt, "--max-model-len", "99999")  # valid alone, too long for this model
    assert too_long.returncode == 2, too_long.stderr[-2000:]
    assert "max_model_len=99999 is invalid" in too_long.stderr and "Traceback" not in too_long.stderr
    missing = serve("--model", str(tmp_path / "nowhere"))
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "could not be loaded" in missing.stderr and "Traceback" not in missing.stderr


def test_engine_threads_leave_a_core_to_the_http_process_unless_pinned() -> None:
    assert default_engine_threads({}, cores=2) == 1
    assert default_engine_threads({}, cores=16) == 15
    assert default_engine_threads({}, cores=1) == 1
    assert default_engine_threads({"OMP_NUM_THREADS": "3"}, cores=2) == 3  # a launcher's pin wins
    assert default_engine_threads({"OMP_NUM_THREADS": ""}, cores=8) == 7  # empty or junk: not a pin


def test_the_engine_process_steps_on_the_threads_asked(tiny_ckpt: str) -> None:
    engine = EngineProcess.spawn(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64), threads=1)
    try:
        assert engine.info.torch_threads == 1
    finally:
        engine.stop()


def test_engine_threads_below_one_is_refused_naming_the_flag(tiny_ckpt: str, capsys) -> None:
    from reference_engine.serve.command_line import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", tiny_ckpt, "--engine-threads", "0"])
    assert exit_.value.code == 2
    assert "--engine-threads=0 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--output-poll-us", "-1"], "--output-poll-us=-1 is invalid"),
    (["--output-poll-us", "100", "--no-engine-process"], "--output-poll-us needs the engine in its own process"),
])
def test_a_bad_output_poll_is_refused_naming_the_flag(tiny_ckpt: str, capsys, flags: list[str],
                                                      message: str) -> None:
    from reference_engine.serve.command_line import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", tiny_ckpt, *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_reconfigure_whose_caller_is_gone_still_leaves_the_front_end_on_the_new_engine(tiny_ckpt: str) -> None:
    """The engine process swaps once the command is sent, whatever happens to its caller: the front end's
    info and stats must follow it, or /metrics would describe an engine that no longer runs."""
    engine = EngineProcess.spawn(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=64))

    async def scenario(e: EngineProcess):
        task = asyncio.ensure_future(e.reconfigure(EngineConfig(model=tiny_ckpt, block_size=32,
                                                                num_gpu_blocks_override=8)))
        await asyncio.sleep(0)  # the command is in the outbox
        task.cancel()
        deadline = time.monotonic() + 30
        while e.info.config.block_size != 32:
            assert time.monotonic() < deadline, "the front end never heard of the new engine"
            await asyncio.sleep(0.01)
        outputs = await e.add("after", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        return e.info, e.stats(), await _final(outputs)

    try:
        info, stats, final = _run(engine, scenario)
    finally:
        engine.stop()
    assert info.num_gpu_blocks == 8 and stats.gauges.num_gpu_blocks == 8
    assert len(final.token_ids) == 4


def test_split_cpus_gives_the_engine_its_threads_cores_and_the_http_process_the_rest() -> None:
    assert split_cpus(1, [0, 1]) == ([0], [1])
    assert split_cpus(3, [2, 4, 6, 8]) == ([2, 4, 6], [8])
    assert split_cpus(2, [0, 1]) is None  # no core left over: nothing is bound
    assert split_cpus(4, [0, 1]) is None


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.server
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs a core to spare")
def test_the_server_binds_its_engine_and_http_processes_to_their_own_cores(server: tuple[str, int]) -> None:
    """One engine thread (OMP_NUM_THREADS=1, the fixture's): the engine process alone on the first core, the
    HTTP process on the others, as vLLM binds its worker away from its front end."""
    _url, pid = server
    cores = sorted(os.sched_getaffinity(0))
    assert _affinity(_engine_pid(pid)) == {cores[0]}
    assert _affinity(pid) == set(cores[1:])


@pytest.mark.server
@pytest.mark.parametrize("server", [["--no-bind-cpus"]], indirect=True)
def test_no_bind_cpus_leaves_both_processes_where_the_os_puts_them(server: tuple[str, int]) -> None:
    _url, pid = server
    everywhere = os.sched_getaffinity(0)
    assert _affinity(_engine_pid(pid)) == everywhere and _affinity(pid) == everywhere


def test_stats_go_out_at_most_every_interval_while_streaming_and_exactly_when_a_request_finishes(
        tiny_ckpt: str) -> None:
    # The engine core's raw batches, read off the pipe: a stats snapshot per batch would cost every step
    # its reading and pickling; none at a request's end would leave /metrics short of that request.
    from reference_engine.serve import engine_process

    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=2048))
    server_end, core_end = multiprocessing.Pipe(duplex=True)
    thread = threading.Thread(target=lambda: _EngineCore(engine, core_end).run(), daemon=True)
    thread.start()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    server_end.send(("add", "a", [5, 6, 7], params, 0))
    server_end.send(("add", "b", [8, 9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), 0))
    batches = core_batches(server_end, lambda finished: finished == {"a", "b"})
    server_end.send(("stop",))
    thread.join(30)

    with_stats = [(now, stats) for _, _, now, stats, _, _, _ in batches if stats is not None]
    assert batches[0][3] is not None, "the first batch (the add replies) carries no stats"
    streaming = [b for b in batches if b[4] and not b[0] and not any(d[2] for d in b[4])]
    assert len(streaming) > 100 and sum(b[3] is not None for b in streaming) < len(streaming) / 2
    gaps = [b[2] - a[2] for a, b in itertools.pairwise(streaming) if a[3] is not None and b[3] is not None]
    assert all(gap >= engine_process.STATS_INTERVAL_S * 0.99 for gap in gaps)
    for batch in batches:  # every batch that finishes a request has the counters of that moment
        if any(d[2] for d in batch[4]):
            assert batch[3] is not None
    produced = sum(len(d[1]) for b in batches for d in b[4])
    assert produced == 340 and with_stats[-1][1].counters.generated_tokens == produced


class _RecvWatch:
    """A connection that records, for each ``recv``, whether a message was already waiting (if not, the
    reader slept on the pipe and the engine's write had to wake it)."""

    def __init__(self, conn, in_flight):
        self._conn, self._in_flight, self.blocking_reads = conn, in_flight, 0

    def recv(self):
        import select

        if self._in_flight() and not select.select([self._conn.fileno()], [], [], 0)[0]:
            self.blocking_reads += 1
        return self._conn.recv()

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


@pytest.mark.parametrize("output_poll_s", [0.0002, 0.0], ids=["polled", "woken"])
def test_while_requests_stream_the_reader_looks_at_the_pipe_instead_of_sleeping_on_it(
        tiny_ckpt: str, output_poll_s: float) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=2048))
    server_end, core_end = multiprocessing.Pipe(duplex=True)
    thread = threading.Thread(target=lambda: _EngineCore(engine, core_end).run(), daemon=True)
    thread.start()
    front: EngineProcess | None = None
    watch = _RecvWatch(server_end, lambda: bool(front and front.num_waiting_on()))
    front = EngineProcess(watch, EngineInfo.of(engine), output_poll_s=output_poll_s)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def scenario(engine_process: EngineProcess):
        queues = await asyncio.gather(*[engine_process.add(f"s{i}", [3 + i, 4], params) for i in range(2)])
        return [await _final(q) for q in queues]

    try:
        finals = _run(front, scenario)
    finally:
        front.stop()
    assert [len(f.token_ids) for f in finals] == [200, 200]
    if output_poll_s:  # (a read begun just as the first request went in may count: at most one a request)
        assert watch.blocking_reads <= 2
    else:  # the check can fail: a reader that sleeps on the pipe is caught sleeping
        assert watch.blocking_reads > 50
