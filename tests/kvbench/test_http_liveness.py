"""A request stuck over HTTP is caught and named within the stall limit
(docs/checks.md#the-checks-suitesconformance, liveness).

The stub server's fault ``--drop-if-prompt-has ID`` counts a request finished but never ends its
response: without the watchdog the client waits for its 600 s request timeout. Each test bounds its
own time, so a watchdog that stops firing fails here instead of hanging the suite.
"""

from __future__ import annotations

import sys
import time

import pytest

from kvbench.core.liveness import Liveness, LivenessError
from kvbench.core.requests import GenRequest, WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.drivers.http_watchdog import IDLE_SCRAPES, HttpWatchdog, machine_load
from kvbench.drivers.server_metrics import MetricsSnapshot
from kvbench.engines.http.openai import OpenAIAdapter
from kvbench.engines.http.server import ServerAdapter
from kvbench.launch.process import ServerProcess, free_port
from kvbench.models.builtin import builtin_checkpoint
from kvbench.testing.stub_server import DROPPED_AFTER

DROP = 999  # the token id that makes the stub drop a request


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(builtin_checkpoint("tiny"))


@pytest.fixture(scope="module")
def dropping_stub(tmp_path_factory: pytest.TempPathFactory):
    """A stub that drops every request whose prompt holds token 999 (5 ms between streamed tokens)."""
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "kvbench.testing.stub_server", "--port", str(port),
                            "--token-delay", "0.005", "--drop-if-prompt-has", str(DROP)],
                           tmp_path_factory.mktemp("stub") / "stub.log")
    server.start()
    url = f"http://127.0.0.1:{port}"
    server.wait_healthy(url, timeout=60)
    yield url
    server.stop()


def _adapter(url: str, model_dir: str, stall: float, idle_grace: float) -> OpenAIAdapter:
    adapter = OpenAIAdapter(model_dir, {"url": url, "timeout": "600"})
    adapter.liveness = Liveness(stall_seconds=stall)
    adapter.idle_grace_seconds = idle_grace
    return adapter


@pytest.mark.server
def test_generate_names_the_request_the_server_dropped_once_it_holds_nothing(dropping_stub, model_dir):
    adapter = _adapter(dropping_stub, model_dir, stall=60, idle_grace=1.0)
    requests = [GenRequest("kept-a", [3, 4, 5], 8), GenRequest("dropped", [3, DROP, 5], 8),
                GenRequest("kept-b", [6, 7], 8)]
    start = time.monotonic()
    with pytest.raises(LivenessError, match="nothing running or waiting") as info:
        adapter.generate(requests)
    assert time.monotonic() - start < 30, "caught in seconds, not at the 600 s request timeout"
    assert set(info.value.stuck) == {"dropped"}, "the open request is named, the answered ones are not"
    assert "nothing received" in info.value.stuck["dropped"]


@pytest.mark.server
def test_generate_fails_on_a_stall_when_the_server_still_claims_to_hold_requests(dropping_stub, model_dir):
    adapter = _adapter(dropping_stub, model_dir, stall=2.0, idle_grace=600)  # the idle rule kept out
    start = time.monotonic()
    with pytest.raises(LivenessError, match=r"no token on any stream.*limit 2 s") as info:
        adapter.generate([GenRequest("dropped", [DROP], 4), GenRequest("kept", [3], 4)])
    assert time.monotonic() - start < 30
    assert list(info.value.stuck) == ["dropped"]


@pytest.mark.server
def test_serve_names_the_dropped_stream_and_what_it_received(dropping_stub, model_dir):
    adapter = _adapter(dropping_stub, model_dir, stall=60, idle_grace=1.0)
    workload = [WorkloadRequest(f"w{i}", [3, DROP if i == 2 else 4, i + 3], 20, arrival_time=0.01 * i)
                for i in range(5)]
    recorder = TraceRecorder("stub", "serve")
    start = time.monotonic()
    with pytest.raises(LivenessError) as info:
        adapter.serve(workload, recorder)
    assert time.monotonic() - start < 30
    assert list(info.value.stuck) == ["w2"]
    assert f"{DROPPED_AFTER} token(s) received" in info.value.stuck["w2"]


@pytest.mark.server
def test_a_launched_server_runs_under_the_sessions_limits(model_dir, tmp_path):
    cmd = "{python} -m kvbench.testing.stub_server --port {port} --drop-if-prompt-has " + str(DROP)
    adapter = ServerAdapter(model_dir, {"cmd": cmd, "log_dir": str(tmp_path)})
    adapter.liveness = Liveness(stall_seconds=2.0)  # as the plugin sets it
    try:
        with pytest.raises(LivenessError, match=r"limit 2 s") as info:
            adapter.generate([GenRequest("dropped", [DROP], 4)])
    finally:
        adapter.close()
    assert list(info.value.stuck) == ["dropped"]


@pytest.mark.server
def test_a_healthy_server_is_never_called_stuck(dropping_stub, model_dir):
    adapter = _adapter(dropping_stub, model_dir, stall=5.0, idle_grace=0.5)
    result = adapter.generate([GenRequest(f"r{i}", [3, i + 4], 30) for i in range(4)])
    assert all(o.finish_reason == "length" and len(o.token_ids) == 30 for o in result.outputs)
    recorder = TraceRecorder("stub", "ok")
    adapter.serve([WorkloadRequest(f"w{i}", [3, i + 4], 30, arrival_time=0.05 * i) for i in range(4)], recorder)
    assert all(r.finish_reason == "length" for r in recorder.finish().requests.values())


# ------------------------------------------------------------------ the watchdog's rules, on a fake clock

def _snap(running: int, waiting: int = 0, generated: int = 0) -> MetricsSnapshot:
    return MetricsSnapshot({"vllm:num_requests_running": [({}, running)],
                            "vllm:num_requests_waiting": [({}, waiting)],
                            "vllm:generation_tokens_total": [({}, generated)]})


def test_idle_rule_needs_the_grace_and_enough_scrapes_and_a_token_resets_it():
    now = [0.0]
    dog = HttpWatchdog(Liveness(stall_seconds=100), idle_grace=5.0, clock=lambda: now[0], load=lambda: 1.0)
    dog.sent("a")
    for _ in range(IDLE_SCRAPES):
        now[0] += 1.0
        dog.saw_metrics(_snap(0))
        dog.check()  # within the grace
    dog.tokens("a", 1)  # the stream moved: the server had not let go (its gauge was late)
    now[0] += 10.0
    dog.saw_metrics(_snap(0))
    dog.check()
    for _ in range(IDLE_SCRAPES):
        now[0] += 2.0
        dog.saw_metrics(_snap(0))
    with pytest.raises(LivenessError, match="nothing running or waiting") as info:
        dog.check()
    assert "1 token(s) received" in info.value.stuck["a"]


def test_idle_rule_waits_longer_on_an_overloaded_machine():
    """At a load of 3 runnable processes per core a server's engine steps a third as often: the grace is three
    times as long, and the error says it was stretched."""
    now = [0.0]
    dog = HttpWatchdog(Liveness(stall_seconds=100), idle_grace=5.0, clock=lambda: now[0], load=lambda: 3.0)
    dog.sent("a")
    for _ in range(14):  # 14 s idle: past the grace, within three times it
        now[0] += 1.0
        dog.saw_metrics(_snap(0))
        dog.check()
    now[0] += 2.0
    dog.saw_metrics(_snap(0))
    with pytest.raises(LivenessError, match=r"stretched 3\.0x by the machine's load"):
        dog.check()


def test_machine_load_is_per_core_and_at_least_one(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (12.0, 10.0, 7.0))
    assert machine_load() == 6.0
    monkeypatch.setattr("os.getloadavg", lambda: (0.4, 1.0, 1.0))
    assert machine_load() == 1.0
    monkeypatch.setattr("os.getloadavg", lambda: (96.0, 1.0, 1.0))
    assert machine_load() == 6.0  # capped: a host's load seen from a container stretches no grace to minutes


def test_a_busy_server_or_no_open_request_is_not_idle():
    now = [0.0]
    dog = HttpWatchdog(Liveness(stall_seconds=100), idle_grace=1.0, clock=lambda: now[0], load=lambda: 1.0)
    dog.sent("a")
    for _ in range(10):
        now[0] += 1.0
        dog.saw_metrics(_snap(0, waiting=1))
        dog.check()
    dog.ended("a")
    for _ in range(10):
        now[0] += 1.0
        dog.saw_metrics(_snap(0))
        dog.check()


def test_stall_rule_counts_tokens_responses_and_the_generated_counter_as_progress():
    now = [0.0]
    dog = HttpWatchdog(Liveness(stall_seconds=10), clock=lambda: now[0])
    dog.sent("a")
    dog.sent("b")
    now[0] = 8.0
    dog.saw_metrics(_snap(2, generated=5))
    now[0] = 16.0
    dog.saw_metrics(_snap(2, generated=9))  # a non-streamed request's tokens, counted by the server
    dog.check()
    now[0] = 24.0
    dog.ended("b")
    now[0] = 33.0
    dog.check()
    now[0] = 35.0
    with pytest.raises(LivenessError, match=r"for 11\.0 s \(limit 10 s\)") as info:
        dog.check()
    assert list(info.value.stuck) == ["a"]


def test_deadline_fires_with_the_open_requests_named():
    now = [0.0]
    dog = HttpWatchdog(Liveness(stall_seconds=None, deadline=30), clock=lambda: now[0])
    dog.sent("a")
    now[0] = 31.0
    with pytest.raises(LivenessError, match="deadline of 30 s"):
        dog.check()
