"""hf-cb's serve loop releases and aborts by the one rule of :mod:`kvbench.drivers.release`, and ends
every request when the engine's loop stops or refuses one: checked against a scripted stand-in for
transformers' ``ContinuousBatchingManager`` (no model, no threads), so each path is reached on purpose.
The real engine's open and closed loops and aborts are in tests/kvbench/test_hf_adapters.py."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest

from kvbench.bench.workloads import WorkloadRequest
from kvbench.core.trace import TraceRecorder
from kvbench.drivers.release import ReleaseSchedule
from kvbench.engines.hf.continuous_batching import HFContinuousBatchingAdapter, _Server


class _Output:
    """A final streamed output: every token at once."""

    def __init__(self, request_id: str, tokens: int):
        self.request_id, self.generated_tokens, self.timestamps, self.error = request_id, [0] * tokens, None, None

    def is_finished(self) -> bool:
        return True


class _Manager:
    """Finishes each accepted request at once with ``max_new_tokens`` tokens; refuses the ids in ``refuse``
    (``add_request`` -> None, as a stopping manager does); its loop stops once ``stop_after`` requests
    were accepted."""

    def __init__(self, refuse: set[str] = frozenset(), stop_after: int | None = None, finish: bool = True):
        self.refuse, self.stop_after, self.finish = refuse, stop_after, finish
        self.added: list[str] = []
        self.cancelled: list[str] = []
        self.results: queue.Queue[_Output] = queue.Queue()
        self.background_thread_status = SimpleNamespace(fatal_error=RuntimeError("pool too small"))

    def add_request(self, prompt: list[int], request_id: str, max_new_tokens: int, **_: Any) -> str | None:
        if request_id in self.refuse:
            return None
        self.added.append(request_id)
        if self.finish:
            self.results.put(_Output(request_id, max_new_tokens))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def is_running(self) -> bool:
        return self.stop_after is None or len(self.added) < self.stop_after

    def get_result(self, timeout: float = 0.0) -> _Output | None:
        try:
            return self.results.get_nowait()
        except queue.Empty:
            return None


def _serve(manager: _Manager, requests: list[WorkloadRequest], concurrency: int | None = None):
    session = SimpleNamespace(manager=manager, probe=SimpleNamespace(events=queue.Queue()))
    recorder = TraceRecorder("hf-cb", "scripted")
    order = sorted(requests, key=lambda r: r.arrival_time)
    _Server(session, recorder, order, ReleaseSchedule(order, concurrency), timeout_s=10.0).run()
    return recorder.finish()


def _requests(n: int, **kwargs: Any) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", [1, 2, 3], 4, 0.0, **kwargs) for i in range(n)]


def test_a_refused_request_ends_in_error_and_frees_its_slot():
    manager = _Manager(refuse={"r0"})
    trace = _serve(manager, _requests(3), concurrency=1)
    assert trace.requests["r0"].finish_reason == "error"
    # with one slot, r1 and r2 were released only because the refusal freed it
    assert manager.added == ["r1", "r2"]
    assert [trace.requests[r].finish_reason for r in ("r1", "r2")] == ["length", "length"]


def test_a_stopped_loop_ends_requests_in_flight_and_unreleased_in_error():
    manager = _Manager(stop_after=2, finish=False)
    trace = _serve(manager, _requests(5), concurrency=2)
    assert manager.added == ["r0", "r1"]
    assert set(trace.requests) == {f"r{i}" for i in range(5)}
    assert all(r.finish_reason == "error" for r in trace.requests.values())
    assert "completion" in trace.not_exposed and "pool too small" in trace.not_exposed["completion"]


def test_open_loop_releases_at_arrival_and_aborts_after_release():
    manager = _Manager(finish=False)
    requests = [WorkloadRequest("late", [1, 2], 4, 0.04, abort_at=0.02),
                WorkloadRequest("early", [1, 2], 4, 0.0, abort_at=0.01)]
    trace = _serve(manager, requests)
    assert manager.added == ["early", "late"]  # arrival order, not workload order
    assert manager.cancelled == ["early", "late"]
    for rid, arrival, abort_at in (("early", 0.0, 0.01), ("late", 0.04, 0.02)):
        r = trace.requests[rid]
        assert r.arrival == pytest.approx(arrival)  # open loop: the arrival is the workload's time
        assert r.finish_reason == "abort" and r.finished >= arrival + abort_at


@pytest.mark.parametrize("concurrency", [0, 1.5])
def test_a_bad_concurrency_is_refused_in_the_adapters_name_before_the_model_loads(tmp_path, concurrency):
    adapter = HFContinuousBatchingAdapter(str(tmp_path / "no-model-here"))
    workload = SimpleNamespace(requests=_requests(2), concurrency=concurrency)
    with pytest.raises(ValueError, match=r"^hf-cb: workload concurrency must be None \(open loop\) or an int >= 1 "
                                         rf"\(closed loop\), got {concurrency}$"):
        adapter.serve(workload, TraceRecorder("hf-cb", "scripted"))
