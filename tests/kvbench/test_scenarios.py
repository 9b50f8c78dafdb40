"""Unit tests of kvbench.bench.scenarios: the plans build and fit, and every claim checker rejects a run
in which nothing happened (a benchmark that passes because the storm never came is a defect)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvbench.bench import metrics
from kvbench.bench import scenarios as sc
from kvbench.bench.results import Results, validate
from kvbench.bench.scenarios.common import STEP_SECONDS
from kvbench.engines.base import EngineAdapter, GenResult, Knobs
from tests.kvbench.trace_factory import make_trace, req, step

_KNOBS = Knobs()
TINY = sc.Model("tiny-ckpt", "tiny", vocab_size=512, max_model_len=1024)
SMALL = sc.Model("small-ckpt", "small", vocab_size=4096, max_model_len=4096)
MODELS = {"quick": TINY, "full": SMALL}


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / sc.BLOCK_SIZE)


# --------------------------------------------------------------------------------------------
# the plans


@pytest.mark.parametrize("scale", sc.SCALES)
@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_plan_builds_and_every_request_fits_its_pool_alone(name, scale):
    scenario = sc.SCENARIOS[name]
    model = MODELS[scale]
    jobs = scenario.plan(scale, model)
    assert jobs
    for job in jobs:
        # the head-to-head declares its own (one every engine takes: vLLM's CPU build, multiples of 32)
        assert job.knobs.block_size == getattr(scenario, "block_size", sc.BLOCK_SIZE) and job.knobs.num_gpu_blocks
        for r in job.workload.requests:
            assert len(r.prompt_token_ids) + r.max_tokens <= model.max_model_len
            # the engine rejects a request that could never run, even alone
            assert _blocks(len(r.prompt_token_ids) + r.max_tokens - 1) <= job.knobs.num_gpu_blocks, (name, r)
            assert all(3 <= t < model.vocab_size for t in r.prompt_token_ids)


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_parameters_name_the_pool_the_model_and_the_scale(name):
    params = sc.SCENARIOS[name].parameters("quick", TINY)
    assert {"num_gpu_blocks", "block_size", "model", "scale"} <= set(params)
    assert params["model"] == "tiny" and params["scale"] == "quick"
    assert params["block_size"] == getattr(sc.SCENARIOS[name], "block_size", sc.BLOCK_SIZE)
    # the doc section a reader opens for the scenario (that it exists: test_no_unopenable_citations.py)
    assert sc.SCENARIOS[name].description
    assert params["doc"] == sc.SCENARIOS[name].doc and params["doc"].startswith("docs/")


def test_quick_scale_is_small_and_full_is_bigger():
    quick = {n: s.num_requests("quick", TINY) for n, s in sc.SCENARIOS.items()}
    full = {n: s.num_requests("full", SMALL) for n, s in sc.SCENARIOS.items()}
    # requests served per engine at quick scale, all scenarios (preemption_policies: 308 of them, its
    # modes side by side and the admission trade-off curve; head_to_head: 64, 32 at each concurrency)
    assert sum(quick.values()) <= 984, quick
    assert all(full[n] > quick[n] for n in quick), (quick, full)


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, sc.Model]:
    """Each scale's built-in model as a config.json alone: all the simulator reads."""
    from kvbench.models.random_llama import build_config

    models = {}
    for scale, preset in sc.MODEL_PRESETS.items():
        path = tmp_path_factory.mktemp(preset)
        (path / "config.json").write_text(json.dumps(build_config(preset)))
        models[scale] = sc.Model.from_dir(path, preset)
    return models


@pytest.mark.parametrize("scale", sc.SCALES)
@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_every_claim_holds_on_the_reference_engines_schedule(name, scale, preset_dirs):
    """Resizing a scale must not leave a claim unshown: served on the simulator on the step clock,
    whose counts are the reference engine's (tests/kvbench/test_sim.py), in both preemption modes where the
    engine's mode matters, every claim is decided and holds (preemptions where a storm claims them, a
    fallback where the host pool is too small...). Only the schedule is checked here, never a time."""
    from kvbench.engines.registry import make_adapter, parse_engine_spec

    scenario, model = sc.SCENARIOS[name], preset_dirs[scale]
    for mode in ("recompute", "swap") if scenario.engine_mode_matters else ("recompute",):
        adapter = make_adapter(parse_engine_spec(f"sim:clock=step,preemption_mode={mode}"), model.path)
        outcome = sc.run(scenario, adapter, model, scale, step_seconds=STEP_SECONDS[scale])
        # Claims about times on the cost clock are undecided on the step clock by design.
        assert {c: v for c, v in outcome.claims.items()
                if v is not True and not c.endswith(sc.COST_CLOCK_CLAIM)} == {}, (mode, outcome.explain())
        # and each such claim says why it was not decided, not the generic reason
        assert all("cost clock only" in outcome.undecided_reasons.get(c, "") for c, v in outcome.claims.items()
                   if v is None), outcome.undecided_reasons


def test_plans_are_seeded():
    a = sc.EVENING_SURGE.plan("quick", TINY)[0].workload
    b = sc.EVENING_SURGE.plan("quick", TINY)[0].workload
    assert a.requests == b.requests


def test_evening_surge_wave_comes_after_the_steady_traffic_and_is_longer():
    size = sc.EVENING_SURGE.size("quick")
    requests = sc.EVENING_SURGE.plan("quick", TINY)[0].workload.requests
    long_from = size.wave.input_len.bounds()[0]
    wave = [r for r in requests if len(r.prompt_token_ids) >= long_from]
    assert len(wave) == size.wave.num_requests
    assert min(r.arrival_time for r in wave) >= size.wave_start_s


def test_flash_crowd_workload_doubles_its_rate():
    size = sc.FLASH_CROWD.size("quick")
    w = sc.FLASH_CROWD.plan("quick", TINY)[0].workload
    trace = make_trace(*[req(r.request_id, r.arrival_time, [r.arrival_time + 0.1]) for r in w.requests])
    ratio = sc.arrival_rate_ratio(trace, size.surge_start_s, size.surge_end_s)
    assert ratio is not None and ratio >= sc.DOUBLED


def test_storm_sweeps_past_the_pool():
    size = sc.PREEMPTION_STORM.size("quick")
    jobs = sc.PREEMPTION_STORM.plan("quick", TINY)
    assert [j.x for j in jobs] == [float(c) for c in size.concurrencies]
    assert all(j.workload.requests == jobs[0].workload.requests for j in jobs)  # the same requests at every point
    peak = max(len(r.prompt_token_ids) + r.max_tokens for r in jobs[0].workload.requests)
    # the lowest concurrency fits the pool at peak; the highest cannot
    assert size.concurrencies[0] * _blocks(peak) <= size.num_gpu_blocks
    assert size.concurrencies[-1] * _blocks(peak) > size.num_gpu_blocks


def test_crossover_pool_has_no_spare_block_and_modes_interleave():
    jobs = sc.SWAP_VS_RECOMPUTE.plan("quick", TINY)
    size = sc.SWAP_VS_RECOMPUTE.size("quick")
    assert len(jobs) == len(size.lengths) * size.repeats * 2
    assert [j.mode for j in jobs[:4]] == ["recompute", "swap", "recompute", "swap"]
    for job in jobs:
        holder, victim = job.workload.requests
        assert len(holder.prompt_token_ids) == sc.BLOCK_SIZE
        assert len(victim.prompt_token_ids) == job.x - 1
        assert job.knobs.num_gpu_blocks == 1 + _blocks(len(victim.prompt_token_ids))
        assert job.knobs.enable_prefix_caching is False and job.knobs.enable_chunked_prefill is False
        assert job.knobs.preemption_mode == job.mode
    with pytest.raises(ValueError, match="does not fit"):
        sc.check_crossover_length(1020, size, TINY)


def test_chunked_budgets_are_scaled_at_quick_scale():
    quick, full = sc.CHUNKED_PREFILL.size("quick"), sc.CHUNKED_PREFILL.size("full")
    assert full.budgets == (512, 2048)
    assert quick.budgets == (128, 512)
    # quick budgets keep full's ratio to the long prompts, and split them
    assert quick.long_prompts.input_len.bounds()[0] > quick.budgets[1]
    assert full.long_prompts.input_len.bounds()[0] > full.budgets[1]
    knobs = {j.mode: j.knobs for j in sc.CHUNKED_PREFILL.plan("quick", TINY)}
    assert knobs["unchunked"].enable_chunked_prefill is False and knobs["unchunked"].max_num_batched_tokens is None
    assert knobs["chunked"].max_num_batched_tokens == 128 and knobs["chunked_large"].max_num_batched_tokens == 512


def test_priority_classes():
    w = sc.PRIORITY.plan("quick", TINY)[0].workload
    size = sc.PRIORITY.size("quick")
    high = [r for r in w.requests if r.priority == sc.HIGH]
    assert len(high) == size.online.num_requests
    assert all(r.arrival_time >= size.online_start_s for r in high)
    assert {j.knobs.scheduling_policy for j in sc.PRIORITY.plan("quick", TINY)} == {"priority", "fcfs"}


def test_scale_must_be_known():
    with pytest.raises(ValueError, match="scale"):
        sc.PREEMPTION_STORM.plan("huge", TINY)


# --------------------------------------------------------------------------------------------
# the checkers reject runs in which nothing happened


def _quiet_trace(n: int = 4, kv: float = 0.4) -> object:
    """Every request served in peace: no preemption, a half-empty pool."""
    return make_trace(*[req(f"r{i:04d}", 0.0, [0.1, 0.2, 0.3], prompt_len=600 if i % 2 else 40) for i in range(n)],
                      steps=[step(0.1, kv=kv, prefill=100, decode=0), step(0.2, kv=kv), step(0.3, kv=kv)],
                      counters={"preemptions_recompute": 0, "preemptions_swap": 0, "recomputed_tokens": 0,
                                "swap_outs": 0, "swap_fallbacks": 0, "prefill_chunks": 0,
                                "prefix_cache_hits": 0, "prefix_cache_queries": 100},
                      duration=0.3)


def _served(scenario: sc.Scenario, traces: list) -> list[sc.Served]:
    jobs = scenario.plan("quick", TINY)
    return [sc.Served(job, trace) for job, trace in zip(jobs, traces, strict=True)]


def test_a_storm_that_never_came_is_undecided_never_passed_nor_failed():
    """A sweep whose top never preempted did not reach the pressure it was built for on this engine: its storm
    claim is undecided ("did not fire": the counter is published and stayed at 0), the claims resting on it "not
    reached", and nothing of it reads as passed."""
    jobs = sc.PREEMPTION_STORM.plan("quick", TINY)
    outcome = sc.PREEMPTION_STORM.judge(_served(sc.PREEMPTION_STORM, [_quiet_trace() for _ in jobs]), "quick", TINY)
    assert outcome.failures() == []
    storm, grew, redone = ("the highest concurrency preempted (a storm)", "preemptions grew with concurrency",
                           "preempted work was recomputed or swapped")
    assert {c: outcome.claims[c] for c in (storm, grew, redone)} == dict.fromkeys((storm, grew, redone))
    assert outcome.undecided_kinds[storm] == "did not fire"
    assert "published and did not move" in outcome.undecided_reasons[storm]
    assert outcome.undecided_kinds[grew] == outcome.undecided_kinds[redone] == "not reached"
    assert outcome.claims["the lowest concurrency ran without preemption"] is True


def test_a_storm_that_preempted_without_redoing_anything_fails():
    """Past the pressure, the mechanism is the engine's: preemptions counted with 0 recomputed tokens and 0 swaps
    fail, saying the counters did not move."""
    calm = {"preemptions": 0.0, "recomputed_tokens": 0.0, "swap_outs": 0.0}
    broken = {"preemptions": 9.0, "recomputed_tokens": 0.0, "swap_outs": 0.0}
    decisions = sc.storm_decisions([calm, broken], [2, 16])
    assert decisions["preempted work was recomputed or swapped"].held is False
    assert decisions["preempted work was recomputed or swapped"].kind == "did not fire"
    assert decisions["the highest concurrency preempted (a storm)"].held is True
    # a sweep that does not start below capacity has not reached its pressure: undecided, not failed
    busy = sc.storm_decisions([broken, broken], [2, 16])
    assert busy["the lowest concurrency ran without preemption"].held is None
    assert busy["the lowest concurrency ran without preemption"].kind == "not reached"
    assert busy["preemptions grew with concurrency"].kind == "not reached"


def test_storm_checker_accepts_a_storm():
    calm = {"preemptions": 0.0, "recomputed_tokens": 0.0, "swap_outs": 0.0}
    storm = {"preemptions": 9.0, "recomputed_tokens": 1500.0, "swap_outs": 0.0}
    claims = sc.storm_claims([calm, storm], [_quiet_trace()])
    assert all(claims.values()), claims


def test_storm_checker_leaves_unexposed_counters_undecided():
    unknown = {"preemptions": None, "recomputed_tokens": None, "swap_outs": None}
    claims = sc.storm_claims([unknown, unknown], [_quiet_trace()])
    assert claims["the highest concurrency preempted (a storm)"] is None
    assert claims["preempted work was recomputed or swapped"] is None


def test_a_surge_that_never_filled_the_pool_is_undecided_not_failed():
    """The pool filling and the wave preempting are the workload's own pressure: an engine on which it was not
    reached is undecided, never failed, and never passed."""
    wave_at = sc.EVENING_SURGE.size("quick").wave_start_s
    quiet = _quiet_trace(kv=0.5)
    quiet.steps.append(step(wave_at + 0.5, kv=0.5))
    outcome = sc.EVENING_SURGE.judge(_served(sc.EVENING_SURGE, [quiet]), "quick", TINY)
    filled, preempted = "the wave filled the KV pool (peak usage > 90%)", "the wave preempted running requests"
    assert outcome.failures() == []
    assert outcome.claims[filled] is None and outcome.claims[preempted] is None
    assert outcome.undecided_kinds[filled] == "not reached" and "peak KV usage" in outcome.undecided_reasons[filled]
    assert outcome.undecided_kinds[preempted] == "did not fire"


def test_flash_crowd_checker_leaves_flat_traffic_and_no_preemption_undecided():
    outcome = sc.FLASH_CROWD.judge(_served(sc.FLASH_CROWD, [_quiet_trace()]), "quick", TINY)
    assert outcome.failures() == []
    doubled = next(c for c in outcome.claims if "traffic doubled" in c)
    assert outcome.claims[doubled] is None and outcome.undecided_kinds[doubled] == "not reached"
    over = "the surge pushed concurrency over capacity (preemptions after it began)"
    assert outcome.claims[over] is None and outcome.undecided_kinds[over] == "did not fire"


def test_surge_claims_count_only_preemptions_after_the_surge_began():
    """An engine that preempted only before the surge (a capacity gap, not the surge) fails the claim."""
    t_surge = sc.FLASH_CROWD.size("quick").surge_start_s
    early = make_trace(req("a", 0.0, [0.5, 1.0], preemptions=[(0.4, "recompute")], resumes=[0.45]),
                       req("b", t_surge + 0.5, [t_surge + 1.0]),
                       steps=[step(0.4, kv=0.95), step(t_surge + 1.0, kv=0.95)], duration=t_surge + 1.0)
    outcome = sc.FLASH_CROWD.judge(_served(sc.FLASH_CROWD, [early]), "quick", TINY)
    # the pressure came before the surge: the surge did not reach it, undecided with the split in words
    over = "the surge pushed concurrency over capacity (preemptions after it began)"
    assert outcome.claims[over] is None and outcome.undecided_kinds[over] == "not reached"
    assert "every preemption came before the surge began" in outcome.undecided_reasons[over]
    (entry,) = outcome.entries
    assert entry.extra["preemptions_before_surge"] == 1 and entry.extra["preemptions_after_surge"] == 0
    late = make_trace(req("a", 0.0, [0.5, t_surge + 1.0], preemptions=[(t_surge + 0.2, "recompute")],
                          resumes=[t_surge + 0.5]), steps=[step(t_surge + 1.0)], duration=t_surge + 1.0)
    claims = sc.FLASH_CROWD.judge(_served(sc.FLASH_CROWD, [late]), "quick", TINY).claims
    assert claims["the surge pushed concurrency over capacity (preemptions after it began)"] is True
    # an engine without per-request preemption records cannot tell before from after: undecided
    blind = make_trace(req("a", 0.0, [0.5]), not_exposed={"preemptions": "no events"})
    blind_out = sc.FLASH_CROWD.judge(_served(sc.FLASH_CROWD, [blind]), "quick", TINY)
    assert blind_out.claims[over] is None and blind_out.undecided_kinds[over] == "not exposed"
    wave_at = sc.EVENING_SURGE.size("quick").wave_start_s
    before_wave = make_trace(req("a", 0.0, [0.5], preemptions=[(0.2, "recompute")], resumes=[0.3]),
                             steps=[step(0.5, kv=0.99)])
    ev = sc.EVENING_SURGE.judge(_served(sc.EVENING_SURGE, [before_wave]), "quick", TINY)
    assert ev.claims["the wave preempted running requests"] is None and wave_at > 0.2
    assert ev.undecided_kinds["the wave preempted running requests"] == "not reached"


def test_storm_knee_is_none_within_the_sweep_when_throughput_still_rises():
    assert sc.knee_within([2, 4, 8, 16], [100, 200, 400, 800]) is None
    assert sc.knee_within([2, 4, 8, 16], [100, 200, 205, 150]) == 4


def test_a_benchmark_whose_every_claim_is_undecidable_says_why():
    outcome = sc.Outcome(sc.PREEMPTION_STORM, "quick", {}, claims={"the highest concurrency preempted (a storm)": None,
                                                                     "every request finished at every point": True})
    reason = outcome.undecided_reason()
    assert reason and "undecidable" in reason and "highest concurrency" in reason
    outcome.claims["preemptions grew with concurrency"] = False
    assert outcome.undecided_reason() is None


def test_crossover_checker_rejects_runs_without_the_forced_preemption():
    jobs = sc.SWAP_VS_RECOMPUTE.plan("quick", TINY)
    outcome = sc.SWAP_VS_RECOMPUTE.judge(_served(sc.SWAP_VS_RECOMPUTE, [_quiet_trace() for _ in jobs]), "quick",
                                         TINY)
    assert "every run preempted the victim once, in its mode, and resumed it" in outcome.failures()
    assert "both modes measured at every length" in outcome.failures()
    assert not outcome.points


def _crossover_trace(mode: str, resume_s: float) -> object:
    victim = req(sc.VICTIM, 0.0, [0.1, 0.5, 0.6], preemptions=[(0.2, mode)], resumes=[0.5])
    holder = req("r0000", 0.0, [0.1, 0.2, 0.3, 0.4])
    steps = [step(0.1, 0.1, prefill=200, decode=0), step(0.2, 0.012, decode=1, preempted=1),
             step(0.3, 0.01), step(0.4, 0.011), step(0.5, resume_s), step(0.6, 0.01)]
    return make_trace(holder, victim, steps=steps)


def test_resume_cost_reads_the_two_steps_against_the_fastest_decode():
    cost = sc.resume_cost(_crossover_trace("swap", 0.015), sc.VICTIM, "swap")
    assert cost is not None
    assert cost.decode_step_s == pytest.approx(0.01)
    assert cost.cost_s == pytest.approx(0.002 + 0.005)
    assert sc.resume_cost(_crossover_trace("swap", 0.015), sc.VICTIM, "recompute") is None  # wrong mode


def test_crossover_sweep_finds_where_the_costs_cross():
    served = []
    for job in sc.SWAP_VS_RECOMPUTE.plan("quick", TINY):
        # recompute grows with the length, swap has a fixed cost: they cross at 100 tokens
        extra = job.x * 1e-4 if job.mode == "recompute" else 0.01
        served.append(sc.Served(job, _crossover_trace(job.mode, 0.01 + extra - 0.002)))
    outcome = sc.SWAP_VS_RECOMPUTE.judge(served, "quick", TINY)
    assert not outcome.failures()
    assert {p.mode for p in outcome.points} == {"swap", "recompute"}
    assert outcome.parameters["crossover_seq_len"] == pytest.approx(100.0)


def test_prefix_checker_rejects_no_hits_and_no_savings():
    same = {"preemptions": 4.0, "recomputed_tokens": 500.0, "prefix_cache_hits": 0.0}
    claims = sc.prefix_claims(same, same)
    assert claims["with caching, the shared prompt hit the cache"] is False
    assert claims["caching recomputed fewer tokens"] is False
    # a recompute preemption that recomputed nothing: the mechanism is the engine's, so it fails
    lazy = {"preemptions": 4.0, "recomputed_tokens": 0.0, "prefix_cache_hits": 0.0}
    assert sc.prefix_claims(lazy, same)["without caching, preempted work was recomputed"] is False
    # never past capacity: the workload's pressure was not reached, undecided (not failed), and so are the
    # claims resting on it
    nothing = {"preemptions": 0.0, "recomputed_tokens": 0.0, "prefix_cache_hits": 0.0}
    decisions = sc.prefix_decisions(nothing, nothing)
    assert decisions["without caching, the closed loop went past capacity (preemptions)"].kind == "did not fire"
    assert decisions["without caching, preempted work was recomputed"].kind == "not reached"
    assert decisions["caching recomputed fewer tokens"].kind == "not reached"
    assert decisions["with caching, the shared prompt hit the cache"].held is False  # the mechanism: fails


def test_chunked_checker_rejects_no_stall_and_no_split():
    flat = make_trace(req("a", 0.0, [0.1, 0.2]), steps=[step(0.1, prefill=100, decode=0), step(0.2)],
                      counters={"prefill_chunks": 0})
    over = make_trace(req("a", 0.0, [0.1, 0.2]), steps=[step(0.1, prefill=300, decode=2), step(0.2)],
                      counters={"prefill_chunks": 3})
    claims = sc.chunked_claims(flat, {128: flat, 512: over}, long_from=700)
    assert claims["unchunked: a long prompt was prefilled in one step beside decodes"] is False
    assert claims["budget 128: long prompts were split into chunks"] is False
    assert claims["budget 128: prefill chunks rode along with decodes"] is False
    assert claims["budget 512: no step went over the budget"] is True
    claims = sc.chunked_claims(flat, {128: over}, long_from=700)
    assert claims["budget 128: no step went over the budget"] is False


def test_priority_checker():
    quiet = make_trace(req("on", 1.0, [1.1], admitted=1.05), req("off", 0.0, [0.1, 2.0]))
    quiet.requests["on"].priority, quiet.requests["off"].priority = sc.HIGH, sc.LOW
    quiet_decision = sc.priority_decisions(quiet)["online traffic preempted offline work"]
    assert quiet_decision.held is None and quiet_decision.kind == "did not fire"  # the pressure never came
    # an online request preempted while offline work kept running: the policy did not protect it
    wrong = make_trace(req("on", 1.0, [1.1, 1.9], admitted=1.05, preemptions=[(1.5, "recompute")], resumes=[1.8]),
                       req("off", 0.0, [0.1, 2.0], admitted=0.05, preemptions=[(1.2, "recompute")], resumes=[1.3]))
    wrong.requests["on"].priority, wrong.requests["off"].priority = sc.HIGH, sc.LOW
    claims = sc.priority_claims(wrong)
    assert claims["online traffic preempted offline work"] is True
    assert claims["no online request was preempted while offline work ran"] is False
    figures = sc.class_figures(wrong)
    assert figures["preemptions_high"] == 1 and figures["preemptions_low"] == 1
    assert figures["ttft_p50_high"] == pytest.approx(0.1) and figures["ttft_p50_low"] == pytest.approx(0.1)


def _prio_trace(online_first_token_step: int) -> object:
    """An offline request decoding from t=0 and an online one arriving at step 2 whose first token comes
    at step ``online_first_token_step`` (steps every 0.1 s)."""
    t_on = 0.1 * online_first_token_step
    trace = make_trace(req("off", 0.0, [0.1 * k for k in range(1, 11)]),
                       req("on", 0.2, [t_on, t_on + 0.1, t_on + 0.3], admitted=0.2),
                       steps=[step(0.1 * k) for k in range(1, 14)])
    trace.requests["on"].priority, trace.requests["off"].priority = sc.HIGH, sc.LOW
    return trace


def test_priority_claims_compare_with_the_fcfs_control_run():
    fast, slow = _prio_trace(3), _prio_trace(9)
    better = sc.priority_vs_fcfs_claims(fast, slow)
    assert list(better.values()) == [True, True]
    # a priority policy that does nothing for online traffic: no better than FCFS, the claims fail
    same = sc.priority_vs_fcfs_claims(slow, slow)
    assert list(same.values()) == [False, False]
    assert all("FCFS" in c for c in same)
    figures = sc.class_figures(fast)
    assert figures["ttft_steps_p50_high"] == 1 and sc.class_figures(slow)["ttft_steps_p50_high"] == 7
    assert figures["tbt_p50_high"] == pytest.approx(0.15) and figures["tbt_p99_low"] == pytest.approx(0.1)
    # no step records: undecidable, not passed
    bare = make_trace(req("on", 0.2, [0.3]))
    bare.requests["on"].priority = sc.HIGH
    assert set(sc.priority_vs_fcfs_claims(bare, bare).values()) == {None}
    # a server's /metrics samples are not engine steps: undecidable, never counted as steps
    sampled_fast, sampled_slow = _prio_trace(3), _prio_trace(9)
    for t in (sampled_fast, sampled_slow):
        t.steps = [dataclasses.replace(s, sampled=True) for s in t.steps]
    assert set(sc.priority_vs_fcfs_claims(sampled_fast, sampled_slow).values()) == {None}
    # an FCFS control in which online requests never waited: nothing to win back, undecidable
    assert set(sc.priority_vs_fcfs_claims(_prio_trace(2), _prio_trace(3)).values()) == {None}


def test_exhaustion_checker_rejects_a_small_pool_that_never_ran_out():
    ample = {"preemptions_swap": 8.0, "swap_fallbacks": 0.0}
    claims = sc.exhaustion_claims(ample, ample)
    assert claims["small host pool: swap fell back to recompute"] is False
    assert claims["ample host pool: never fell back to recompute"] is True


def test_first_fallback_is_the_first_recompute_preemption():
    trace = make_trace(req("a", 0.0, [0.1, 0.9], preemptions=[(0.2, "swap"), (0.6, "recompute")]),
                       req("b", 0.0, [0.1, 0.9], preemptions=[(0.3, "swap")]),
                       steps=[step(0.2, cpu_kv=0.4), step(0.5, cpu_kv=0.9), step(0.7, cpu_kv=0.2)])
    fb = sc.first_fallback(trace)
    assert fb == {"first_fallback_s": 0.6, "swaps_before_first_fallback": 2.0, "cpu_kv_usage_at_first_fallback": 0.9}


def test_all_finished_rejects_errors_and_unfinished():
    assert sc.all_finished(make_trace(req("a", 0.0, [0.1])))
    assert not sc.all_finished(make_trace(req("a", 0.0, [0.1], reason="error")))
    assert not sc.all_finished(make_trace(req("a", 0.0, [0.1], finished=None)))
    assert not sc.all_finished(make_trace())


def test_all_finished_counts_only_served_requests():
    """A rejection or an abort nobody asked for is not a request served; an abort the workload asked for is."""
    assert sc.all_finished(make_trace(req("a", 0.0, [0.1], reason="stop")))
    assert not sc.all_finished(make_trace(req("a", 0.0, [0.1]), req("b", 0.0, [], finished=0.1, reason="rejected")))
    assert not sc.all_finished(make_trace(req("a", 0.0, [0.1], reason="abort")))
    assert sc.all_finished(make_trace(req("a", 0.0, [0.1], reason="abort")), asked_to_abort={"a"})
    assert not sc.all_finished(make_trace(req("a", 0.0, [0.1], reason="rejected")), asked_to_abort={"a"})


# --------------------------------------------------------------------------------------------
# the runner end to end, on an engine that serves everything in peace


class CalmAdapter(EngineAdapter):
    """Serves every request at once, one token per 10 ms, never preempting: the storm never comes."""

    kind = "calm"
    capabilities = frozenset({"recompute"})

    def generate(self, requests, knobs=_KNOBS) -> GenResult:  # pragma: no cover - not used
        raise NotImplementedError

    def serve(self, workload, recorder, knobs=_KNOBS) -> None:
        recorder.restart_clock()
        for r in workload.requests:
            recorder.arrived(r.request_id, r.arrival_time, len(r.prompt_token_ids), r.max_tokens, r.priority)
            recorder.admitted(r.request_id, r.arrival_time)
            for i in range(r.max_tokens):
                recorder.tokens(r.request_id, r.arrival_time + 0.01 * (i + 1))
            recorder.finished(r.request_id, r.arrival_time + 0.01 * r.max_tokens, "length")
        recorder.set_counters({"preemptions_recompute": 0, "preemptions_swap": 0, "recomputed_tokens": 0,
                               "swap_outs": 0})


def test_run_and_record_a_calm_storm_leaves_its_pressure_undecided_and_is_recorded():
    progress: list[int] = []
    outcome = sc.run(sc.PREEMPTION_STORM, CalmAdapter("none"), TINY, "quick", progress.append)
    assert sum(progress) == sc.PREEMPTION_STORM.num_requests("quick", TINY)
    assert outcome.failures() == [] and outcome.claims["the highest concurrency preempted (a storm)"] is None
    results = Results()
    sc.record(outcome, results, CalmAdapter("none").describe())
    validate(results.to_dict())
    scenario = results.scenario("preemption_storm")
    assert scenario["parameters"]["num_gpu_blocks"] == sc.PREEMPTION_STORM.size("quick").num_gpu_blocks
    (entry,) = scenario["results"]
    assert "the highest concurrency preempted (a storm)" not in entry["checks"]
    assert entry["undecided_kinds"]["the highest concurrency preempted (a storm)"] == "did not fire"
    assert entry["undecided"]["the highest concurrency preempted (a storm)"].startswith("did not fire: ")
    assert entry["metrics"]["knee_concurrency"] is not None
    (sweep,) = scenario["sweeps"]
    assert len(sweep["points"]) == len(sc.PREEMPTION_STORM.size("quick").concurrencies)
    assert all("output_throughput" in p["metrics"] for p in sweep["points"])


def test_serve_ends_the_duration_at_the_last_event():
    job = sc.FLASH_CROWD.plan("quick", TINY)[0]
    trace = sc.serve(CalmAdapter("none"), job, "flash_crowd")
    assert trace.duration == pytest.approx(sc.last_event(trace))
    assert metrics.summarize(trace)["duration_s"] == pytest.approx(trace.duration)


# --------------------------------------------------------------------------------------------
# on the reference engine: the forced preemption of the crossover really happens


def test_crossover_forces_exactly_one_preemption_on_the_reference_engine(tiny_ckpt):
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    model = sc.Model.from_dir(tiny_ckpt, "tiny")
    scenario = sc.SwapVsRecompute()
    scenario.sizes = {"quick": sc.CrossoverSize(lengths=(40, 300), repeats=1)}
    outcome = sc.run(scenario, ReferenceAdapter(model.path), model, "quick")
    assert not outcome.failures(), outcome.explain()
    costs = {(p.mode, p.x): p.metrics for p in outcome.points}
    assert set(costs) == {("recompute", 40.0), ("swap", 40.0), ("recompute", 300.0), ("swap", 300.0)}


def test_reference_steps_tell_decodes_from_prefills(tiny_ckpt):
    """Step records count decode tokens as decode (the chunked-prefill claims rely on it)."""
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    model = sc.Model.from_dir(tiny_ckpt, "tiny")
    job = sc.SWAP_VS_RECOMPUTE.plan("quick", model)[0]
    trace = sc.serve(ReferenceAdapter(model.path), job, "x")
    assert trace.steps[0].num_prefill_tokens > 0 and trace.steps[0].num_decode_tokens == 0
    assert any(s.num_prefill_tokens == 0 and s.num_decode_tokens > 0 for s in trace.steps)


# --------------------------------------------------------------------------------------------
# the report reads what the scenarios record


def _steady_trace(tokens_per_s: float, n: int = 4, preempt: bool = False) -> object:
    gap = 1.0 / tokens_per_s * n
    reqs = [req(f"r{i:04d}", 0.0, [gap * (k + 1) for k in range(10)],
                preemptions=[(gap, "recompute")] if preempt and i == 0 else []) for i in range(n)]
    return make_trace(*reqs, steps=[step(gap * (k + 1), gap) for k in range(10)],
                      counters={"preemptions_recompute": 1 if preempt else 0, "recomputed_tokens": 10})


def test_the_report_headlines_are_filled_from_recorded_outcomes():
    from kvbench.report.render import headline_ratios

    results = Results()
    engines = [{"name": "reference", "kind": "reference"},
               {"name": "reference:preemption_mode=swap", "kind": "reference"},
               {"name": "hf-cb", "kind": "hf-cb"}]
    for engine, tps in zip(engines, (1000.0, 1100.0, 500.0), strict=True):
        storm = sc.PREEMPTION_STORM
        jobs = storm.plan("quick", TINY)
        traces = [_steady_trace(tps * (1 if j.x >= 8 else j.x / 8), preempt=j.x >= 8) for j in jobs]
        sc.record(storm.judge([sc.Served(j, t) for j, t in zip(jobs, traces, strict=True)], "quick", TINY),
                  results, engine)
    served = [sc.Served(j, _crossover_trace(j.mode, 0.008 + (j.x * 1e-4 if j.mode == "recompute" else 0.01)))
              for j in sc.SWAP_VS_RECOMPUTE.plan("quick", TINY)]
    sc.record(sc.SWAP_VS_RECOMPUTE.judge(served, "quick", TINY), results, engines[0])
    chunked = sc.Outcome(sc.CHUNKED_PREFILL, "quick", {"num_gpu_blocks": 512, "block_size": 16}, entries=[
        sc.ResultEntry(_steady_trace(100.0), mode="unchunked"), sc.ResultEntry(_steady_trace(200.0), mode="chunked")])
    sc.record(chunked, results, engines[0])
    prefix = sc.Outcome(sc.PREFIX_CACHING, "quick", {"num_gpu_blocks": 96, "block_size": 16}, entries=[
        sc.ResultEntry(make_trace(req("a", 0.0, [0.1]), counters={"recomputed_tokens": 400}), mode="no_prefix_caching"),
        sc.ResultEntry(make_trace(req("a", 0.0, [0.1]), counters={"recomputed_tokens": 100}), mode="prefix_caching")])
    sc.record(prefix, results, engines[0])

    storm_h, cross_h, chunk_h, prefix_h = headline_ratios(results)
    assert all(h["measured"] for h in (storm_h, cross_h, chunk_h, prefix_h)), [h["caption"] for h in
                                                                              (storm_h, cross_h, chunk_h, prefix_h)]
    assert "hf-cb" in storm_h["caption"]  # another engine, not the reference in another mode
    assert storm_h["value"].startswith("0.5")
    assert cross_h["value"] == "100"
    assert prefix_h["value"] == "75%"


def test_auto_claims_fail_for_an_auto_that_always_makes_one_fixed_modes_choice():
    good = sc.auto_vs_fixed_claims(105.0, 100.0, 90.0)
    assert list(good.values()) == [True, True] and all(c.endswith(sc.COST_CLOCK_CLAIM) for c in good)
    # auto forced to always swap serves the swap mode's schedule: worse than recompute, better than nothing
    always_swap = sc.auto_vs_fixed_claims(90.0, 100.0, 90.0)
    assert list(always_swap.values()) == [False, False]
    # one that always recomputes ties the better mode at best: no worse, but not better than both
    assert list(sc.auto_vs_fixed_claims(100.0, 100.0, 90.0).values()) == [True, False]
    assert list(sc.auto_vs_fixed_claims(101.5, 100.0, 90.0).values()) == [True, False]  # inside the 2%
    assert set(sc.auto_vs_fixed_claims(None, 100.0, 90.0).values()) == {None}
    # victims all priced one way: nothing to win from the mix, undecided (never passed)
    assert list(sc.auto_vs_fixed_claims(105.0, 100.0, 90.0, mixed=False).values()) == [True, None]


def test_undecided_claims_are_their_own_field_never_a_passed_check():
    """A claim left None is recorded under ``undecided`` with its reason, not among the checks (never "held"),
    and the report's claims table and summary say "undecided"."""
    from kvbench.bench.results import Results
    from kvbench.report.render import render_report

    outcome = sc.PREEMPTION_STORM.judge(_served(sc.PREEMPTION_STORM, [_quiet_trace()] * len(
        sc.PREEMPTION_STORM.plan("quick", TINY))), "quick", TINY)
    outcome.claims = {"preemptions grew with concurrency": True, "the highest concurrency preempted (a storm)": None}
    outcome.undecided_reasons, outcome.undecided_kinds = {}, {}  # a judge that gave no reason: the generic one
    results = Results()
    sc.record(outcome, results, "reference")
    (entry,) = results.scenario("preemption_storm")["results"]
    assert entry["checks"] == {"preemptions grew with concurrency": True}
    assert entry["undecided"] == {"the highest concurrency preempted (a storm)": sc.UNDECIDED_REASON}
    html = render_report(Results.from_dict(results.to_dict()))
    assert "? undecided" in html and "1/1 · 1 undecided" in html
    from kvbench.plugin.session_end import undecided_claims

    assert undecided_claims(results) == [  # the terminal's section
        f"preemption_storm [reference]: the highest concurrency preempted (a storm): {sc.UNDECIDED_REASON}"]
