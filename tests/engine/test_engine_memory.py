"""Nothing grows without bound: a long run leaves the engine's memory flat.

The bulk run (10,000 requests) drives the real scheduler and block manager with a fake model, as
tests/engine/test_scheduler.py does: the model adds no per-request state, and the tiny checkpoint on a
shared CPU is too slow for 10,000 requests. A shorter run through the whole engine checks the
engine's own structures (events, pending outputs) and the event sink.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from reference_engine import ConfigError, EngineConfig, LLMEngine, SamplingParams
from reference_engine.block_manager import BlockManager
from reference_engine.events import EngineEvent, EventLog
from reference_engine.request import Request
from reference_engine.scheduler import Scheduler

BLOCK_SIZE = 2
NUM_REQUESTS = 10_000
MAX_EVENTS = 256
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    """6 tokens; the first block is one of 4 shared prefixes, so the prefix cache hits and evicts."""
    return [3 + i % 4, 11, *(20 + (i * 7 + k) % 400 for k in range(4))]


def _drive(sched: Scheduler, num_requests: int, in_flight: int, at_finished: dict[int, object]) -> None:
    """Feed ``num_requests`` requests, ``in_flight`` at a time, through a fake model that samples 7;
    ``at_finished[n]()`` runs when the n-th request finishes. Keeps no reference to any request."""
    added = finished = 0
    while finished < num_requests:
        while added < num_requests and added - finished < in_flight:
            sched.add(Request(f"r{added}", _prompt(added), PARAMS, float(added)))
            added += 1
        out = sched.schedule()
        sampled = {c.request.request_id: 7 for c in out.chunks if c.completes}
        for req in sched.update(out, sampled):
            if req.status.finished:
                finished += 1
                if finished in at_finished:
                    at_finished[finished]()


def _traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_ten_thousand_requests_leave_memory_flat(mode: str) -> None:
    # Small pools and many requests in flight: preemptions (and swaps) all along the run.
    bm = BlockManager(30, 16 if mode == "swap" else 0, BLOCK_SIZE, enable_caching=True)
    seen = []
    events = EventLog(MAX_EVENTS)
    events.add_sink(lambda e: seen.append(e.kind) if e.kind == "preempted" else None)
    sched = Scheduler(bm, max_num_seqs=12, max_num_batched_tokens=40, max_model_len=16, preemption_mode=mode,
                      enable_chunked_prefill=True, events=events, clock=lambda: 0.0)
    traced: dict[int, int] = {}
    tracemalloc.start()
    try:
        _drive(sched, NUM_REQUESTS, in_flight=16,
               at_finished={n: lambda n=n: traced.__setitem__(n, _traced_bytes()) for n in (2_500, NUM_REQUESTS)})
    finally:
        tracemalloc.stop()
    growth = traced[NUM_REQUESTS] - traced[2_500]
    # 7,500 requests passed in between: even 50 bytes kept per request would be 375 KB.
    assert growth < 64 * 1024, f"traced memory grew by {growth} bytes between the 2,500th and 10,000th request"
    assert len(sched.events) == MAX_EVENTS and events.num_recorded > 2 * NUM_REQUESTS
    assert sched.counters.prefix_cache_hits > 0 and sched.counters.evicted_blocks > 0
    assert len(seen) == sched.counters.preemptions > 0, "the sink saw every preemption, the log only the latest"
    assert not sched.requests and not sched.has_unfinished()
    assert bm.tracked_request_ids() == set(), "per-request state outlived its request"
    assert bm.is_whole()
    assert len(bm.pool.cached) <= bm.num_gpu_blocks


def test_a_long_engine_run_keeps_only_max_events(tiny_ckpt: str) -> None:
    received: list[EngineEvent] = []
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, block_size=BLOCK_SIZE, num_gpu_blocks_override=10,
                                    max_num_seqs=8, max_model_len=16, enable_prefix_caching=True,
                                    enable_chunked_prefill=True, max_num_batched_tokens=32, max_events=40),
                       event_sink=received.append)
    finished = 0
    for i in range(120):
        engine.add_request(f"r{i}", _prompt(i), PARAMS)
        if i % 3 == 2:  # arrivals outpace the steps: the waiting queue builds up, then drains
            finished += sum(o.finished for o in engine.step().outputs)
    engine.abort_request("r119")
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step().outputs)
    assert finished == 120
    assert len(engine.events) == 40 and engine.events.num_dropped == len(received) - 40
    assert list(engine.events) == received[-40:], "the log keeps the latest events, in order"
    kinds = [e.kind for e in received]
    assert kinds.count("finished") == 119 and kinds.count("aborted") == 1
    assert engine.counters().preemptions == kinds.count("preempted") > 0
    assert not engine.scheduler.requests and not engine._pending
    assert engine.block_manager.tracked_request_ids() == set()
    assert engine.block_manager.is_whole()


# ---------------------------------------------------------------------- the log and its sinks
def _event(i: int) -> EngineEvent:
    return EngineEvent("admitted", f"r{i}", i, 0.0)


def test_event_log_reads_like_a_list_of_the_latest_events() -> None:
    log = EventLog(3)
    assert len(log) == 0 and not log and log[:] == []
    for i in range(5):
        log.append(_event(i))
    ids = [e.request_id for e in log]
    assert ids == ["r2", "r3", "r4"] and len(log) == 3 and log
    assert log[0].request_id == "r2" and log[-1].request_id == "r4"
    assert [e.request_id for e in log[1:]] == ["r3", "r4"]
    assert (log.num_recorded, log.num_dropped) == (5, 2)


def test_event_log_since_follows_new_events_by_position() -> None:
    log = EventLog(3)
    new, position = log.since(0)
    assert (new, position) == ([], 0)
    log.append(_event(0))
    log.append(_event(1))
    new, position = log.since(position)
    assert [e.request_id for e in new] == ["r0", "r1"] and position == 2
    for i in range(2, 7):
        log.append(_event(i))
    new, position = log.since(position)
    assert [e.request_id for e in new] == ["r4", "r5", "r6"], "r2 and r3 were dropped before this read"
    assert position == 7 and log.since(position) == ([], 7)


def test_sinks_see_every_event_even_with_nothing_retained() -> None:
    log = EventLog(0)
    first, second = [], []
    log.add_sink(first.append)
    log.add_sink(second.append)
    for i in range(4):
        log.append(_event(i))
    log.remove_sink(second.append)
    log.append(_event(4))
    assert len(log) == 0 and len(first) == 5 and len(second) == 4
    with pytest.raises(TypeError, match="not callable"):
        log.add_sink("print")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_max_events_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match=r"EngineConfig\.max_events=.*expected an integer >= 0") as info:
        EngineConfig(model="m", max_events=value)  # type: ignore[arg-type]
    assert info.value.field == "max_events"
