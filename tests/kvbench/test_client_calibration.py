"""Client-side calibration (kvbench.sim.client_calibration, reference_engine.sim.calibrate spans)
and the predicted-vs-measured table's maths (kvbench.sim.accuracy). No server needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.core.trace import RequestTrace, Trace
from kvbench.sim import accuracy as pr
from kvbench.sim.client_calibration import ClientDesign, calibrate_client, decode_span, ttft_spans
from reference_engine.costs import Coefficients, CostModel, HardwareProfile, StepShape
from reference_engine.costs.model_shapes import ModelShape
from reference_engine.sim.calibrate import SpanSample, fit_spans, prefill_steps, span_seconds

SHAPE = ModelShape("t", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=8,
                   head_dim=32, vocab_size=512, max_position_embeddings=1024)
BASE = HardwareProfile("b", compute_flops=50e9, memory_bandwidth=10e9, link_bandwidth=10e9, memory_bytes=8 << 30,
                       combine="sum", dtype="float32")
TRUE = Coefficients(fixed_s=2e-3, per_seq_s=40e-6, dense=3.0, attention=6.0, memory=1.5, per_request_s=4e-3)


def test_prefill_steps_chunks_a_prompt_by_the_budget():
    steps = prefill_steps(900, 512)
    assert [s.prefill_tokens for s in steps] == [512, 388]
    assert [s.sampled for s in steps] == [0, 1]
    assert steps[1].context_tokens == 900  # the second chunk reads the first's KV
    assert prefill_steps(100, 512) == (StepShape.prefill(100),)
    with pytest.raises(ValueError, match="budget"):
        prefill_steps(10, 0)


def test_fit_spans_recovers_known_coefficients():
    truth = CostModel(SHAPE, BASE.with_coefficients(TRUE))
    spans = []
    for context, batch in [(32, 1), (32, 4), (32, 16), (160, 1), (160, 8), (416, 1), (416, 4)]:
        shapes = tuple(StepShape.decode_batch(batch, context + j) for j in range(20))
        spans.append(SpanSample(shapes, 0, 0.0))
    spans += [SpanSample(prefill_steps(p, 512), 1, 0.0) for p in (32, 128, 320, 512, 800)]
    spans = [SpanSample(s.shapes, s.arrivals, span_seconds(truth, s)) for s in spans]
    got = fit_spans(CostModel(SHAPE, BASE), spans)
    fitted = CostModel(SHAPE, BASE.with_coefficients(got))
    for s in spans:  # every span predicted as the truth prices it
        assert span_seconds(fitted, s) == pytest.approx(s.seconds, rel=1e-6)
    assert got.per_request_s == pytest.approx(TRUE.per_request_s, rel=1e-3)
    assert got.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-3)


def test_fit_spans_refuses_a_max_profile_and_too_few_spans():
    with pytest.raises(ValueError, match="combine"):
        fit_spans(CostModel(SHAPE, BASE.with_coefficients(TRUE, combine="max")), [])
    with pytest.raises(ValueError, match="too few"):
        fit_spans(CostModel(SHAPE, BASE), [SpanSample((StepShape.prefill(8),), 1, 0.01)])


def test_decode_span_takes_the_window_where_the_batch_is_whole():
    # two requests: the second's first token comes at t=0.3 (its prefill ran later); the first ends at 1.0
    a = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    b = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2]
    span = decode_span([a, b], context=32)
    assert span is not None
    assert span.seconds == pytest.approx(0.7)  # token 2 (t=0.3) .. token 9 (t=1.0) of request a
    assert len(span.shapes) == 7 and all(s.num_seqs == 2 for s in span.shapes)
    assert span.shapes[0] == StepShape.decode_batch(2, 32 + 3 - 1)
    assert decode_span([[0.1], [0.2]], 32) is None


def test_ttft_spans_and_design_bounds():
    t = Trace("e", "s")
    t.requests["r0"] = RequestTrace("r0", arrival=1.0, prompt_len=800, max_tokens=1, token_times=[1.25])
    (s,) = ttft_spans(t, 512)
    assert s.seconds == pytest.approx(0.25) and s.arrivals == 1 and len(s.shapes) == 2
    ClientDesign().check_fits(63, 32, 1024)
    with pytest.raises(ValueError, match="decode_cells"):
        ClientDesign(decode_cells=((416, 8),)).check_fits(63, 32, 1024)


def test_calibrate_client_end_to_end_on_a_fake_server():
    """A fake server that prices steps with known coefficients: the fit gets them back."""
    truth = CostModel(SHAPE, BASE.with_coefficients(TRUE))
    budget = 512

    def serve(workload):
        trace = Trace("fake", "cal")
        reqs = workload.requests
        if workload.concurrency == 1:  # prefills one at a time
            t = 0.0
            for r in reqs:
                ttft = span_seconds(truth, SpanSample(prefill_steps(len(r.prompt_token_ids), budget), 1, 0))
                trace.requests[r.request_id] = RequestTrace(r.request_id, t, len(r.prompt_token_ids), 1,
                                                            token_times=[t + ttft])
                t += ttft + 0.01
            return trace
        batch, context = len(reqs), len(reqs[0].prompt_token_ids)
        t = span_seconds(truth, SpanSample(prefill_steps(batch * context, budget), batch, 0))  # all prefilled
        times = [[t] for _ in reqs]
        for j in range(1, r_tokens(reqs)):
            t += truth.step_seconds(StepShape.decode_batch(batch, context + j - 1))
            for tt in times:
                tt.append(t)
        for r, tt in zip(reqs, times, strict=True):
            trace.requests[r.request_id] = RequestTrace(r.request_id, 0.0, context, r.max_tokens, token_times=tt)
        return trace

    def r_tokens(reqs):
        return reqs[0].max_tokens

    cal = calibrate_client(serve, None, SHAPE, BASE, budget, ClientDesign(rounds=1), say=lambda _: None)
    fitted = CostModel(SHAPE, cal.profile)
    for s in cal.spans:
        assert span_seconds(fitted, s) == pytest.approx(s.seconds, rel=1e-4)
    assert "span errors" in cal.summary()


def test_prediction_rows_error_spread_and_verdicts():
    r = pr.Row("vllm", "surge", "ttft_p99", "time", 1.08, (1.0, 0.9, 1.2, 1.0, 1.05))
    assert r.measured == 1.0
    assert r.error == pytest.approx(0.08)
    assert r.rounds_range == pytest.approx(0.3)
    assert r.within is True and r.noise_dominated is True
    c = pr.Row("vllm", "storm c=16", "preemptions", "count", 30, (20, 22, 24, 21, 25))
    assert c.error == pytest.approx(30 / 22 - 1) and c.within is False and c.noise_dominated is False
    assert pr.relative_error(0, 0) == 0.0 and pr.relative_error(3, 0) is None
    assert pr.Row("vllm", "surge", "ttft_p99", "time", 1.0, (5.0, None)).rounds_range is None  # one round: no spread
    text = pr.table([r, c])
    assert "MISS" in text and "within" in text and "| 30 | 22 [20-25] |" in text
    e, s = pr.median_error([r, c], "time")
    assert e == pytest.approx(0.08) and s == pytest.approx(0.3)
    assert pr.knee_row("x", 8.0, [8.0, 12.0], 8.0)[-1] == "same"
    assert np.isfinite(e)


def test_full_prompt_admission_waits_until_the_whole_sequence_fits():
    """vLLM V1's scheduler_reserve_full_isl, as the reference scheduler's admission policy full_prompt."""
    from types import SimpleNamespace

    from reference_engine.policies.admission import FullPrompt, make_admission

    bm = SimpleNamespace(num_free_gpu_blocks=10, blocks_needed=lambda n: -(-n // 32))
    policy = make_admission("full_prompt", max_num_seqs=8, horizon=1, headroom=0.0, budget=1.0, max_model_len=1024)
    assert isinstance(policy, FullPrompt)
    running = [SimpleNamespace()]
    assert policy.admits(SimpleNamespace(num_tokens=320), running, bm)  # 10 blocks: fits
    assert not policy.admits(SimpleNamespace(num_tokens=321), running, bm)  # 11: waits
    assert policy.admits(SimpleNamespace(num_tokens=5000), [], bm)  # an empty batch always admits


def test_engine_decode_span_reads_the_engines_own_decode_time():
    from kvbench.sim.client_calibration import DECODE_METRICS, engine_decode_span

    s, n = DECODE_METRICS
    span = engine_decode_span({s: 1.0, n: 10}, {s: 1.8, n: 14}, batch=4, context=32, tokens=5)
    assert span is not None and span.seconds == pytest.approx(0.2)
    assert span.shapes == tuple(StepShape.decode_batch(4, 32 + j - 1) for j in range(1, 5))
    assert engine_decode_span({s: 1.0, n: 10}, {s: 1.8, n: 13}, 4, 32, 5) is None  # a request missing
    assert engine_decode_span({}, {}, 4, 32, 5) is None  # no /metrics


def test_knee_range_is_what_the_rounds_allow():
    xs = [2, 4, 8, 16]
    # every round gains >= 5% from 2 to 4; from 4 to 8 one does and one does not; 8 to 16 none does
    rounds = [[100, 200, 212, 210], [100, 190, 196, 200]]
    assert pr.knee_range(xs, rounds) == (4, 8)
    assert pr.knee_consistent(4, (4, 8)) and pr.knee_consistent(8, (4, 8))
    assert not pr.knee_consistent(2, (4, 8))  # every round still rose there
    assert not pr.knee_consistent(None, (4, 8))  # every round flattened before the top
    # rounds that all keep rising: no knee within the sweep is the only consistent answer
    rising = [[100, 200, 400, 800], [90, 180, 300, 700]]
    assert pr.knee_range(xs, rising) == (None, None)
    assert pr.knee_consistent(None, (None, None)) and not pr.knee_consistent(8, (None, None))
    # undecided at the top only: a knee there or none are both allowed
    assert pr.knee_range(xs, [[1, 2, 4, 4.1], [1, 2, 4, 6]]) == (8, None)
    assert pr.knee_consistent(None, (8, None)) and pr.knee_consistent(8, (8, None))
    row = pr.knee_row("e", 8, [4, 8], 4, pr.knee_range(xs, rounds))
    assert row[-2:] == ["4 to 8", "consistent"] and row[4] == "DIFFERENT"
