"""The simulated serving front end (kvbench.sim.front_end): its queue, its effect on what a client of the
simulator sees, and its calibration from client observations. No server needed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvbench.bench.workloads import AllAtOnce, ClosedLoop, Uniform, WorkloadSpec
from kvbench.core.knobs import Knobs
from kvbench.core.trace import TraceRecorder
from kvbench.engines.registry import make_adapter, parse_engine_spec
from kvbench.sim.front_end import (
    Chunk,
    DeliveryCell,
    FrontEnd,
    Submitted,
    cell_figures,
    fit_front_end,
    simulate_cell,
    tokens_per_chunk,
)
from reference_engine.costs import FrontEndCosts, HardwareProfile, load_profile

KNOBS = Knobs(block_size=16, num_gpu_blocks=60, max_num_batched_tokens=256, enable_chunked_prefill=True)


# ------------------------------------------------------------------------------ the queue
def test_a_free_front_end_delivers_every_step_on_its_own():
    assert simulate_cell(FrontEndCosts(), batch=4, tokens=20, step_s=0.01) == 1.0


def test_a_busy_front_end_merges_a_requests_outputs_into_chunks():
    # 4 chunks of 4 ms per 10 ms step: it falls behind, and what piles up leaves together
    merged = simulate_cell(FrontEndCosts(per_chunk_s=4e-3), batch=4, tokens=40, step_s=0.01)
    assert merged > 1.5
    # slower still: fewer, larger chunks
    assert simulate_cell(FrontEndCosts(per_chunk_s=8e-3), batch=4, tokens=40, step_s=0.01) > merged
    # the same front end keeps up with a slower engine
    assert simulate_cell(FrontEndCosts(per_chunk_s=4e-3), batch=4, tokens=40, step_s=0.02) == 1.0


def test_a_front_end_slower_than_the_engine_falls_ever_further_behind():
    slow = FrontEndCosts(per_step_s=0.015)  # absorbing a step takes 1.5 steps
    short, long = cell_figures(slow, 4, 40, 0.01), cell_figures(slow, 4, 80, 0.01)
    assert 1 < short[0] < long[0]  # cycles grow, so do chunks
    assert long[1] > 1.5 * short[1]  # and the backlog when the engine stops
    keeps_up = FrontEndCosts(per_step_s=0.005)
    assert cell_figures(keeps_up, 4, 40, 0.01) == pytest.approx(cell_figures(keeps_up, 4, 80, 0.01)) == (1.0, 0.005)


def test_a_cycle_takes_in_absorbs_and_delivers_what_arrived_by_its_start():
    front = FrontEnd(FrontEndCosts(per_request_s=1.0, per_step_s=0.5, per_output_s=0.25, per_chunk_s=2.0))
    front.take_in(0.0, "req")
    front.engine_output(0.0, {"a": 1, "b": 1}, {})
    # intake 0 -> 1, absorb 1 -> 2 (0.5 + 2 x 0.25), a's chunk 2 -> 4, b's 4 -> 6
    assert front.run_until(0.0) == [Submitted(1.0, "req"), Chunk(4.0, "a", 1), Chunk(6.0, "b", 1)]
    front.engine_output(1.0, {"a": 1}, {})
    front.engine_output(5.0, {"a": 1}, {"a": "length"})
    # both arrived during the first cycle: the next (at 6) absorbs both, and a's tokens leave together
    assert front.next_start() == 6.0
    assert front.run_until(10.0) == [Chunk(6.0 + 2 * 0.75 + 2.0, "a", 2, True, "length")]
    assert front.idle()


def test_costs_refuse_a_negative_value_naming_it():
    with pytest.raises(ValueError, match=r"front_end\.per_chunk_s"):
        FrontEndCosts(per_chunk_s=-1.0)


def test_a_profile_carries_its_front_end_through_a_file(tmp_path):
    p = dataclasses.replace(load_profile("h200"), front_end=FrontEndCosts(per_request_s=1e-3, per_chunk_s=2e-4))
    assert HardwareProfile.load(p.save(tmp_path / "p.json")) == p
    assert "front_end" not in load_profile("h200").to_dict()  # the default: none
    data = p.to_dict()
    data["front_end"]["per_chunck_s"] = 1.0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="front_end"):
        HardwareProfile.load(tmp_path / "bad.json")


# ------------------------------------------------------------------------------ in the simulator
def _profile(tmp_path, costs: FrontEndCosts | None) -> str:
    p = dataclasses.replace(load_profile("h200"), name="fe", front_end=costs)
    return str(p.save(tmp_path / f"fe-{id(costs)}.json"))


def _serve(tiny, hardware: str, workload, extra: str = ""):
    adapter = make_adapter(parse_engine_spec(f"sim:hardware={hardware},model=llama-3-8b,fast=false{extra}"), tiny)
    recorder = TraceRecorder(adapter.name, "t")
    adapter.serve(workload, recorder, KNOBS)
    return recorder.finish()


def _closed(n: int = 24, c: int = 6):
    spec = WorkloadSpec("closed", n, Uniform(40, 200), Uniform(16, 48), ClosedLoop(c), seed=3)
    return spec.build(512, max_prompt_len=1000)


def _burst(n: int = 12):
    return WorkloadSpec("burst", n, Uniform(40, 200), Uniform(16, 48), AllAtOnce(), seed=3).build(512,
                                                                                                 max_prompt_len=1000)


@pytest.mark.parametrize("workload", [_closed, _burst])
def test_a_free_front_end_is_no_front_end(tiny_ckpt, tmp_path, workload):
    plain = _serve(tiny_ckpt, "h200", workload())
    free = _serve(tiny_ckpt, _profile(tmp_path, FrontEndCosts()), workload())
    for rid, r in plain.requests.items():
        f = free.requests[rid]
        assert (f.arrival, f.token_times, f.finished, f.finish_reason) == pytest.approx(
            (r.arrival, r.token_times, r.finished, r.finish_reason)), rid
    assert free.counters == plain.counters


def test_a_costly_front_end_delays_the_client_and_the_closed_loop(tiny_ckpt, tmp_path):
    plain = _serve(tiny_ckpt, "h200", _closed())
    step = plain.duration / len(plain.steps)
    costly = _serve(tiny_ckpt, _profile(tmp_path, FrontEndCosts(per_request_s=step, per_chunk_s=step)), _closed())
    per_chunk = tokens_per_chunk([r.token_times for r in costly.requests.values()])
    assert per_chunk is not None and per_chunk > 1.5  # 6 streams of one chunk-cost per engine step: merged
    assert tokens_per_chunk([r.token_times for r in plain.requests.values()]) == 1.0
    ttft = [r.token_times[0] - r.arrival for r in costly.requests.values()]
    ttft0 = [r.token_times[0] - r.arrival for r in plain.requests.values()]
    assert sum(ttft) > sum(ttft0) + len(ttft) * step  # each waits for its intake and a delivery at least
    assert costly.duration > plain.duration  # successors went out later
    assert all(r.finished is not None for r in costly.requests.values())
    # front_end=off: the profile's front end ignored
    off = _serve(tiny_ckpt, _profile(tmp_path, FrontEndCosts(per_chunk_s=step)), _closed(), ",front_end=off")
    assert off.duration == pytest.approx(plain.duration)


def test_clock_step_with_a_front_end_is_refused(tiny_ckpt, tmp_path):
    adapter = make_adapter(parse_engine_spec(f"sim:hardware={_profile(tmp_path, FrontEndCosts())},clock=step"),
                           tiny_ckpt)
    with pytest.raises(ValueError, match="front_end=off"):
        adapter.serve(_burst(), TraceRecorder("sim", "t"), KNOBS, step_seconds=0.01)


# ------------------------------------------------------------------------------ calibration
def test_fit_front_end_reproduces_the_chunks_a_known_front_end_made():
    truth = FrontEndCosts(per_output_s=5e-4, per_chunk_s=2e-3)
    shapes = [(1, 0.004), (4, 0.006), (8, 0.008), (12, 0.01)]
    cells = [DeliveryCell(b, 48, s, simulate_cell(truth, b, 48, s)) for b, s in shapes]
    assert max(c.tokens_per_chunk for c in cells) > 2  # the cells do show merging
    costs, error = fit_front_end(cells, lone_overhead_s=0.01)
    assert error < 0.1
    for c in cells:
        assert simulate_cell(costs, c.batch, c.tokens, c.step_s) == pytest.approx(c.tokens_per_chunk, rel=0.15)
    # the lone request's overhead less one absorb and one delivery is the intake
    assert costs.per_request_s == pytest.approx(0.01 - costs.per_step_s - costs.per_output_s - costs.per_chunk_s)


def test_fit_front_end_without_merging_assumes_the_cheapest_front_end():
    cells = [DeliveryCell(b, 48, 0.01, 1.0) for b in (1, 4, 8)]
    costs, error = fit_front_end(cells, lone_overhead_s=0.005)
    assert (costs.per_step_s, costs.per_output_s, costs.per_chunk_s, error) == (0.0, 0.0, 0.0, 0.0)
    assert costs.per_request_s == pytest.approx(0.005)
    with pytest.raises(ValueError, match="no delivery cell"):
        fit_front_end([], 0.0)


@pytest.mark.parametrize("truth", [FrontEndCosts(per_chunk_s=1e-3), FrontEndCosts(per_output_s=1.5e-3)],
                         ids=["keeps-up", "falls-behind"])
def test_fit_front_end_reproduces_chunks_and_lag(truth):
    shapes = [(2, 0.0015), (4, 0.002), (8, 0.002)]
    cells = [DeliveryCell(b, 48, s, *cell_figures(truth, b, 48, s)) for b, s in shapes]
    assert max(c.tokens_per_chunk for c in cells) > 2  # merged
    costs, _ = fit_front_end(cells, lone_overhead_s=None)
    for c in cells:
        per_chunk, lag = cell_figures(costs, c.batch, c.tokens, c.step_s)
        assert per_chunk == pytest.approx(c.tokens_per_chunk, rel=0.2)
        assert 0.5 < lag / c.lag_s < 2


def test_delivery_lag_is_the_clients_time_less_the_engines():
    from kvbench.core.trace import RequestTrace, Trace
    from kvbench.sim.client_calibration import ENGINE_TIME_METRICS, delivery_lag

    trace = Trace("e", "s", {f"r{i}": RequestTrace(f"r{i}", 0.0, 8, 4, finished=1.0 + i) for i in range(2)})
    before = dict.fromkeys(ENGINE_TIME_METRICS, 10.0)
    after = {ENGINE_TIME_METRICS[0]: 10.2, ENGINE_TIME_METRICS[1]: 12.0}  # 0.1 s queued, 1 s inference each
    assert delivery_lag(trace, before, after, 2) == pytest.approx(1.5 - 1.1)
    assert delivery_lag(trace, {}, after, 2) is None  # no /metrics: unknown
    assert delivery_lag(trace, before, after, 3) is None  # a request missing


def test_an_abort_due_during_the_intake_reaches_the_engine_when_it_has_the_request(tiny_ckpt, tmp_path):
    spec = WorkloadSpec("burst", 4, Uniform(40, 80), Uniform(200, 300), AllAtOnce(), seed=3)
    workload = spec.build(512, max_prompt_len=1000)
    workload = dataclasses.replace(workload, requests=[dataclasses.replace(r, abort_at=1e-4) if i == 3 else r
                                                       for i, r in enumerate(workload.requests)])
    # the 4th request's intake ends at 4 ms: its abort (due at 0.1 ms) waits for the engine to have it
    trace = _serve(tiny_ckpt, _profile(tmp_path, FrontEndCosts(per_request_s=1e-3)), workload)
    aborted = trace.requests[workload.requests[3].request_id]
    assert aborted.finished is not None and aborted.finish_reason != "length"
    assert len(aborted.token_times) < workload.requests[3].max_tokens
    assert all(trace.requests[r.request_id].finish_reason == "length" for r in workload.requests[:3])
