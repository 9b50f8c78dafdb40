"""The capacity-planning simulator: cost model, profiles, calibration fit, the sim engine's counts
against the real engine's on the step clock, and a large run that completes."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.bench.workloads import AllAtOnce, Poisson, Uniform, WorkloadSpec
from kvbench.core.knobs import Knobs
from kvbench.core.trace import TraceRecorder
from kvbench.engines.registry import EngineSpec, make_adapter, parse_engine_spec
from kvbench.models.builtin import builtin_checkpoint
from reference_engine.costs import (
    PROFILES,
    Coefficients,
    CostModel,
    HardwareProfile,
    StepShape,
    load_model_shape,
    load_profile,
)
from reference_engine.sim.calibrate import Design, IntervalSample, fit_error, nnls


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(builtin_checkpoint("tiny"))


def llama8b_h200() -> CostModel:
    return CostModel(load_model_shape("llama-3-8b"), load_profile("h200"))


# ------------------------------------------------------------------------------ cost model
def test_llama3_8b_sizes_match_the_published_model():
    m = load_model_shape("llama-3-8b")
    assert 8.0e9 < m.num_params() < 8.1e9  # "8B": 8.03e9
    assert m.kv_bytes_per_token(2) == 128 * 1024  # 32 layers x 2 x 8 kv heads x 128 x 2 bytes


def test_step_time_grows_with_every_dimension_of_the_shape():
    cost = llama8b_h200()
    base = StepShape.decode_batch(8, 512)
    assert cost.step_seconds(StepShape()) == 0.0
    assert cost.step_seconds(StepShape.decode_batch(64, 512)) > cost.step_seconds(base)
    assert cost.step_seconds(StepShape.decode_batch(8, 4096)) > cost.step_seconds(base)
    assert cost.step_seconds(base + StepShape.prefill(2048)) > cost.step_seconds(base + StepShape.prefill(256))
    assert cost.step_seconds(StepShape.prefill(4096)) > cost.step_seconds(StepShape.prefill(512))


def test_units_a_decode_step_cannot_beat_reading_the_weights():
    cost = llama8b_h200()
    weights_read = cost.step_weight_bytes / load_profile("h200").memory_bandwidth  # ~3.3 ms at 4.8 TB/s
    assert 2e-3 < weights_read < 5e-3
    assert cost.step_seconds(StepShape.decode_batch(1, 128)) >= weights_read
    # a long prefill is compute-bound: 2 x 7B FLOPs per token at ~1 PFLOP/s is ~14 us per token
    assert 10e-6 < cost.step_seconds(StepShape.prefill(8192)) / 8192 < 100e-6


def test_swap_cost_is_link_time_plus_per_copy_overhead():
    cost = llama8b_h200()
    c, link = cost.profile.coefficients, cost.profile.link_bandwidth
    assert cost.swap_seconds(0) == 0
    assert cost.swap_seconds(64 << 20) == pytest.approx(c.per_copy_s + c.link * (64 << 20) / link)
    assert cost.swap_seconds(2 * (64 << 20)) > 1.9 * cost.swap_seconds(64 << 20)
    assert cost.recompute_seconds(1024) > cost.recompute_seconds(512) > 0


def test_crossover_names_the_cheaper_mode_per_length():
    cost = llama8b_h200()
    x = cost.crossover(16, 8192)
    assert x.shorter in ("swap", "recompute")
    # a slow link makes recompute win somewhere: the crossover moves
    slow = HardwareProfile(**{**cost.profile.__dict__, "link_bandwidth": 1e8})
    assert CostModel(cost.model, slow).crossover(16, 8192).shorter == "recompute"


# ------------------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_builtin_profiles_load_and_round_trip_through_a_file(name, tmp_path):
    p = load_profile(name)
    path = p.save(tmp_path / f"{name}.json")
    assert load_profile(str(path)) == p


def test_a_profile_file_with_a_typo_is_refused_naming_the_key(tmp_path):
    data = load_profile("h100").to_dict()
    data["coefficients"]["fixd_s"] = 1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="fixd_s"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="memory_bandwidth"):
        HardwareProfile("x", compute_flops=1, memory_bandwidth=-1, link_bandwidth=1, memory_bytes=1)
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile("b200")


def test_models_load_from_a_config_json(tiny):
    m = load_model_shape(tiny)
    assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.head_dim) == (2, 64, 2, 16)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_shape("gpt-5")


# ------------------------------------------------------------------------------ calibration
def _synthetic_intervals(cost: CostModel, n: int, seed: int, per_request_s: float = 0.0) -> list[IntervalSample]:
    """Served-step intervals priced exactly by ``cost`` (plus ``per_request_s`` per arrival)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        chunks = [(int(rng.integers(0, 900)), 1, True) for _ in range(int(rng.integers(1, 32)))]
        chunks.append((int(rng.integers(0, 200)), int(rng.integers(1, 400)), True))
        s, arrivals = StepShape.of_chunks(chunks), int(rng.integers(0, 4))
        out.append(IntervalSample(s, arrivals, cost.step_seconds(s) + arrivals * per_request_s))
    return out


def test_fit_error_is_zero_on_exact_intervals_and_grows_with_a_wrong_profile(tiny):
    shape = load_model_shape(tiny)
    base = HardwareProfile("synthetic", 1e11, 5e9, 5e9, 1e10, combine="sum", dtype="float32")
    truth = base.with_coefficients(Coefficients(fixed_s=1.2e-3, per_seq_s=40e-6, dense=1.7, attention=6.0, memory=2.5))
    samples = _synthetic_intervals(CostModel(shape, truth), 60, seed=0)
    exact = fit_error(CostModel(shape, truth), samples)
    assert exact["intervals"] == 60
    assert exact["median_rel_error"] == pytest.approx(0, abs=1e-12) and exact["r2"] == pytest.approx(1.0)
    assert exact["total_rel_error"] == pytest.approx(0, abs=1e-12)
    # every interval predicted 1.5x too long: 50% off each, and their sum 50% off
    slow = base.with_coefficients(Coefficients(fixed_s=1.8e-3, per_seq_s=60e-6, dense=2.55, attention=9.0,
                                               memory=3.75))
    wrong = fit_error(CostModel(shape, slow), samples)
    assert wrong["median_rel_error"] == pytest.approx(0.5) and wrong["p90_rel_error"] == pytest.approx(0.5)
    assert wrong["total_rel_error"] == pytest.approx(0.5) and wrong["r2"] < exact["r2"]
    assert fit_error(CostModel(shape, truth), [])["median_rel_error"] is None


def test_calibration_design_names_the_bad_field_and_plans_each_cell():
    with pytest.raises(ValueError, match=r"Design\.contexts"):
        Design(contexts=(0, 32))
    with pytest.raises(ValueError, match=r"Design\.heldout_contexts"):
        Design(contexts=(32, 64), heldout_contexts=(48,))
    with pytest.raises(ValueError, match=r"Design\.heldout_contexts.*nothing to fit"):
        Design(contexts=(32,), heldout_contexts=(32,))
    with pytest.raises(ValueError, match=r"Design\.contexts.*max_model_len"):
        Design(contexts=(1010,), heldout_contexts=()).check_fits(max_model_len=1024, num_blocks=1024, block_size=16)
    with pytest.raises(ValueError, match=r"Design\.decode_batches.*KV blocks"):
        Design(decode_batches=(200,)).check_fits(max_model_len=1024, num_blocks=1024, block_size=16)
    d = Design(prefills=(16, 96), repeats=2, decode_steps=3)
    plan = d.cell_plan(context=512, batch=4, token_budget=1024)
    decodes, joins = plan[:4], plan[4:]
    # 4 x 512 prompt tokens take 2 steps at 1024 a step, then 3 decode steps, then a join every other step
    assert [step for step, _, _ in joins] == [5, 7, 9, 11] and [p for _, p, _ in joins] == [16, 16, 96, 96]
    assert all(step == 0 and prompt == 512 for step, prompt, _ in decodes)
    last_join_step = 11
    assert decodes[0][2] > last_join_step - 2  # decodes (first token at step 2) still running at the last join


def test_calibrate_cli_writes_a_loadable_profile_with_its_fit_error(tmp_path, tiny):
    """A small design, served for real: the profile loads as a sim engine's hardware and carries the
    fit error the CLI printed (figures not asserted: they are this machine's)."""
    import io

    from kvbench.cli import main
    from kvbench.engines.registry import make_adapter, parse_engine_spec

    out, path = io.StringIO(), tmp_path / "p.json"
    code = main(["calibrate", "-o", str(path), "--model", tiny, "--contexts", "16,48", "--batches", "1,4",
                 "--prefills", "8,32", "--heldout", "48", "--repeats", "1", "--rounds", "2", "--name", "ci",
                 "--force"], out=out)  # a design this small fits poorly: saved only with --force
    text = out.getvalue()
    assert code == 0, text
    assert "cell 8/8 (round 2/2): context 48, decode batch 4" in text and "(held out)" in text
    assert "median relative error" in text and "R²" in text and str(path) in text
    profile = load_profile(str(path))
    # the fit explains something (which term takes the per-step cost depends on this machine's load)
    coefficients = dataclasses.astuple(profile.coefficients)
    assert profile.name == "ci" and profile.combine == "sum" and min(coefficients) >= 0 < max(coefficients)
    fit = profile.fit or {}
    assert fit["fit_contexts"] == [16] and fit["heldout_contexts"] == [48]
    # waking up after idle, timed apart: in the report and the profile, with the medians behind it
    assert "waking up after idle" in text and set(fit["wake"]["extra_s"]) == {"0.005", "0.01", "0.02", "0.05",
                                                                               "0.1", "0.2"}
    for part in ("train", "heldout"):
        assert fit[part]["intervals"] > 0
        assert f"{fit[part]['median_rel_error']:.1%}" in text
    engine = make_adapter(parse_engine_spec(f"sim:hardware={path},clock=step"), tiny).build_engine()
    assert engine.profile.coefficients == profile.coefficients


@pytest.mark.parametrize(("flag", "value"), [("--contexts", "16,x"), ("--batches", "0"), ("--heldout", "99"),
                                             ("--repeats", "0"), ("--rounds", "0"),
                                             ("--contexts", "192,2000")])
def test_calibrate_cli_names_the_bad_argument(tmp_path, capsys, flag, value):
    from kvbench.cli import main

    path = tmp_path / "p.json"
    code = main(["calibrate", "-o", str(path), flag, value])
    err = capsys.readouterr().err
    assert code != 0 and not path.exists()
    assert f"error: {flag}" in err, err


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = nnls(a, np.array([1.0, -1.0, 0.0]))  # unconstrained: x2 < 0
    assert (x >= 0).all()
    assert x[1] == 0
    np.testing.assert_allclose(x, [*np.linalg.lstsq(a[:, :1], np.array([1.0, -1.0, 0.0]), rcond=None)[0], 0])


# ------------------------------------------------------------------------------ the sim engine
def _workload(n: int = 12):
    spec = WorkloadSpec("burst", n, Uniform(40, 200), Uniform(16, 48), AllAtOnce(), seed=3)
    return spec.build(512, max_prompt_len=1000)


def _serve(adapter, knobs, step_seconds=0.01):
    recorder = TraceRecorder(adapter.name, "t")
    adapter.serve(_workload(), recorder, knobs, step_seconds=step_seconds)
    return recorder.finish()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sim_counts_equal_the_real_engines_on_the_step_clock(tiny, mode):
    knobs = Knobs(block_size=16, num_gpu_blocks=40, num_cpu_blocks=200, preemption_mode=mode)
    real = _serve(make_adapter(EngineSpec("reference"), tiny), knobs)
    # the reference engine's dtype, so KV bytes per block (swap bytes) are the same too
    sim = _serve(make_adapter(parse_engine_spec("sim:clock=step,hardware=h200,dtype=float32"), tiny), knobs)
    assert real.counters[f"preemptions_{mode}"] > 0  # the mechanism fired
    for name in ("preemptions_recompute", "preemptions_swap", "recomputed_tokens", "swap_ins", "swapped_out_bytes",
                 "computed_tokens", "generated_tokens", "prefill_chunks"):
        assert sim.counters[name] == real.counters[name], name
    per_request = {rid: [m for _, m in r.preemptions] for rid, r in real.requests.items()}
    assert {rid: [m for _, m in r.preemptions] for rid, r in sim.requests.items()} == per_request


def test_sim_times_are_the_cost_models_seconds(tiny):
    adapter = make_adapter(parse_engine_spec("sim:hardware=a100-80gb,model=llama-3-8b"), tiny)
    engine = adapter.build_engine(Knobs(num_gpu_blocks=400))
    recorder = TraceRecorder(adapter.name, "t")
    from kvbench.drivers.step_loop import drive
    from kvbench.sim.adapter import _SimSteppable

    drive(_SimSteppable(engine), _workload().requests, recorder, virtual_clock=engine.clock)
    trace = recorder.finish()
    # every time is virtual: the run lasts as long as the sum of its priced steps, not the wall clock
    assert trace.duration == pytest.approx(engine.clock.now())
    assert trace.duration > 50 * 3e-3  # at least ~50 steps that each read 16 GB of weights
    assert all(r.finished is not None for r in trace.requests.values())
    # and a faster machine finishes the same work sooner
    fast = make_adapter(parse_engine_spec("sim:hardware=h200,model=llama-3-8b"), tiny)
    e2 = fast.build_engine(Knobs(num_gpu_blocks=400))
    drive(_SimSteppable(e2), _workload().requests, TraceRecorder(fast.name, "t"), virtual_clock=e2.clock)
    assert e2.clock.now() < engine.clock.now()


def test_sim_pool_is_memory_left_after_the_weights(tiny):
    adapter = make_adapter(parse_engine_spec("sim:hardware=h200,model=llama-3-8b"), tiny)
    engine = adapter.build_engine()
    expected = int((141e9 * 0.9 - 8_030_261_248 * 2) // (16 * 128 * 1024))
    assert engine.block_manager.num_gpu_blocks == expected
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_adapter(parse_engine_spec("sim:hardware=a100-80gb,model=llama-3-70b"), tiny).build_engine()


def test_sim_is_marked_simulated_and_conformance_skips_it(tiny):
    from kvbench.plugin.session import is_simulator as _simulated

    adapter = make_adapter(parse_engine_spec("sim"), tiny)
    assert adapter.describe()["simulated"] is True
    assert _simulated(EngineSpec("sim")) and not _simulated(EngineSpec("reference"))
    with pytest.raises(ValueError, match="clock"):
        parse_engine_spec("sim:clock=wall")


def test_a_large_surge_completes(tiny):
    """10,000 requests with KVBENCH_SIM_SCALE=1 (minutes on a busy 2-core machine), else 300. The time is
    printed (-s), never asserted."""
    from kvbench.sim.simulate import evening_surge_at_scale, simulate

    n = 10_000 if os.environ.get("KVBENCH_SIM_SCALE") == "1" else 300
    adapter = make_adapter(parse_engine_spec("sim:hardware=h200,model=llama-3-8b"), tiny)
    workload = evening_surge_at_scale(n, vocab_size=128256)
    t0 = time.perf_counter()
    run = simulate(adapter, workload)
    print(f"\n{n} requests simulated in {time.perf_counter() - t0:.1f} s "
          f"(engine loop {run.simulate_seconds:.1f} s): {run.figures}")
    assert run.figures["output_throughput"] and run.figures["output_throughput"] > 0


# ------------------------------------------------------------------------------ the fast path
def _pressured(seed: int = 5):
    spec = WorkloadSpec("pressured", 60, Uniform(40, 300), Uniform(16, 120), Poisson(30.0), seed=seed)
    return spec.build(512, max_prompt_len=1000)


def _drive_sim(tiny, knobs, fast: bool, workload, step_seconds=None):
    from kvbench.drivers.step_loop import drive
    from kvbench.engines.inprocess.reference import counters_of
    from kvbench.sim.adapter import _SimSteppable, fast_path_liveness

    adapter = make_adapter(parse_engine_spec("sim:hardware=h200,model=llama-3-8b"), tiny)
    engine = adapter.build_engine(knobs)
    recorder = TraceRecorder(adapter.name, "t")
    drive(_SimSteppable(engine, recorder if fast else None), workload.requests, recorder,
          step_seconds=step_seconds, virtual_clock=engine.clock,
          liveness=fast_path_liveness(adapter.liveness, engine) if fast else adapter.liveness)
    recorder.set_counters(counters_of(engine))
    return engine, recorder.finish()


def _steps(trace):
    return [(s.t, s.duration, s.num_running, s.num_waiting, s.num_swapped, s.kv_usage, s.cpu_kv_usage,
             s.num_prefill_tokens, s.num_decode_tokens, s.num_preempted) for s in trace.steps]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [False, True])
def test_fast_path_makes_the_plain_steps_decisions(tiny, mode, chunked):
    """Lazy decodes change no decision: every preemption (request, time, mode), every token time, every
    step record and every counter equal the plain path's, on a workload that preempts often."""
    knobs = Knobs(block_size=16, num_gpu_blocks=60, num_cpu_blocks=100, preemption_mode=mode, max_num_seqs=16,
                  enable_chunked_prefill=chunked)
    plain_engine, plain = _drive_sim(tiny, knobs, False, _pressured())
    fast_engine, fast = _drive_sim(tiny, knobs, True, _pressured())
    assert plain.counters[f"preemptions_{mode}"] >= 10  # pressure: the fallback to plain steps fired
    assert fast_engine.fast_steps > 5 * fast_engine.plain_steps > 0  # and the fast path did most steps
    assert plain_engine.fast_steps == 0
    assert fast.counters.to_dict() == plain.counters.to_dict()
    assert _steps(fast) == _steps(plain)
    for rid, p in plain.requests.items():
        f = fast.requests[rid]
        assert (f.admitted, f.preemptions, f.resumes, f.finished, f.finish_reason) == \
               (p.admitted, p.preemptions, p.resumes, p.finished, p.finish_reason), rid
        np.testing.assert_allclose(f.token_times, p.token_times, rtol=0, atol=1e-12)
    assert not fast_engine.lazy.requests and fast_engine.block_manager.is_whole()


def test_fast_path_aborts_and_lone_long_decodes(tiny):
    """An abort of a lazy decoder syncs it first (its tokens so far reach the trace), and a request
    decoding alone for longer than the watchdog's stall limit is not taken for a stall."""
    spec = WorkloadSpec("long", 3, Uniform(30, 40), Uniform(600, 700), AllAtOnce(), seed=1)
    requests = spec.build(512, max_prompt_len=1000).requests
    requests[1] = dataclasses.replace(requests[1], abort_at=0.5)  # seconds of simulated time: mid-decode
    workload = SimpleNamespace(requests=requests)
    knobs = Knobs(block_size=16, num_gpu_blocks=200)
    _, plain = _drive_sim(tiny, knobs, False, workload)
    engine, fast = _drive_sim(tiny, knobs, True, workload)
    aborted = fast.requests[workload.requests[1].request_id]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_times) < 600
    for rid, p in plain.requests.items():
        assert fast.requests[rid].token_times == p.token_times
        assert fast.requests[rid].finish_reason == p.finish_reason
    assert engine.fast_steps > 600  # one long lazy stretch: far past the watchdog's 200 steps


def test_served_interval_fit_recovers_per_step_and_per_request_costs(tiny):
    """fit_intervals on synthetic served steps (a step's cost plus per_request_s per arrival before
    it) recovers both; the simulated engine charges per_request_s when a request is added."""
    from reference_engine import EngineConfig, SamplingParams
    from reference_engine.sim import SimEngine
    from reference_engine.sim.calibrate import IntervalSample, fit_intervals

    shape = load_model_shape(tiny)
    base = HardwareProfile("synthetic", 1e11, 5e9, 5e9, 1e10, combine="sum", dtype="float32")
    truth = Coefficients(fixed_s=2e-3, per_seq_s=50e-6, dense=3.0, attention=8.0, memory=1.5, per_request_s=300e-6)
    true_cost = CostModel(shape, base.with_coefficients(truth))
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(120):
        chunks = [(int(rng.integers(0, 900)), 1, True) for _ in range(int(rng.integers(1, 32)))]
        chunks.append((int(rng.integers(0, 200)), int(rng.integers(1, 400)), True))
        s, arrivals = StepShape.of_chunks(chunks), int(rng.integers(0, 4))
        samples.append(IntervalSample(s, arrivals, true_cost.step_seconds(s) + arrivals * truth.per_request_s))
    fitted = fit_intervals(CostModel(shape, base), samples)
    np.testing.assert_allclose([fitted.fixed_s, fitted.per_seq_s, fitted.dense, fitted.attention, fitted.memory,
                                fitted.per_request_s], [2e-3, 50e-6, 3.0, 8.0, 1.5, 300e-6], rtol=1e-6)
    engine = SimEngine(EngineConfig(model=tiny, dtype="float32"), shape, base.with_coefficients(truth))
    engine.add_request("r", [5] * 10, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.clock.now() == pytest.approx(300e-6)


def test_simulate_cli_mixed_victims_prints_auto_claims(capsys):
    """``kvbench simulate --workload mixed_victims`` with the three modes swept judges the scenario's
    claims on auto (figures not asserted here: docs/journal/measurements.md has them at scale)."""
    import io

    from kvbench.bench.scenarios import auto_vs_fixed_claims
    from kvbench.cli import main

    out = io.StringIO()
    code = main(["simulate", "--workload", "mixed_victims", "--requests", "48", "--engine",
                 "sim:hardware=h200,model=llama-3-8b,num_gpu_blocks_override=600,swap_space=1",
                 "--sweep", "preemption_mode=recompute,swap,auto"], out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "48 requests of mixed_victims" in text and "enable_prefix_caching=True" in text
    for claim in auto_vs_fixed_claims(1.0, 1.0, 1.0):
        assert f": {claim}" in text, text


def test_simulate_cli_names_the_model_a_workload_does_not_fit(tiny, capsys):
    """The evening surge at scale has 3,072-token prompts: on a model with 1,024 positions the command
    exits 2 with a message naming the workload and the model's limit, not a traceback."""
    from kvbench.cli import main

    code = main(["simulate", "--requests", "20", "--engine", f"sim:model={tiny}/config.json"])
    err = capsys.readouterr().err
    assert code == 2 and "--workload evening_surge does not fit" in err and "1024" in err, err


def test_simulate_cli_checks_every_sweep_point_before_simulating(capsys):
    """A swept value the engine refuses exits 2 naming the field before any run; the watermark's headroom
    swept without the watermark warns that every run admits the same."""
    from kvbench.cli import main

    engine = "sim:hardware=h200,model=llama-3-8b"
    code = main(["simulate", "--requests", "20", "--engine", engine, "--sweep", "admission_headroom=0.2,1.5"])
    captured = capsys.readouterr()
    assert code == 2 and "admission_headroom=1.5" in captured.err and "ran " not in captured.out, captured
    code = main(["simulate", "--requests", "20", "--engine", engine, "--sweep", "admission_headroom=0.1,0.2"])
    captured = capsys.readouterr()
    assert code == 0 and "no point uses admission_policy=watermark" in captured.err, captured.err
    code = main(["simulate", "--requests", "20", "--engine", f"{engine},admission_policy=watermark", "--sweep",
                 "admission_headroom=0.1,0.2"])
    assert code == 0 and "warning" not in capsys.readouterr().err
