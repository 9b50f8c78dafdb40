"""The two preemption-aware policies: ``preemption_mode="auto"`` and admission control.

Decisions are tested on plain numbers (no model): :func:`choose` on given prices, the scheduler's
auto victims and admission gates on a :class:`BlockManager` of a few blocks. One engine test on the
tiny model proves auto fired both ways in one run and that its outputs equal an unpressured run's.
"""

from __future__ import annotations

import collections
import random

import pytest

from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.block_manager import BlockManager
from reference_engine.config import ConfigError
from reference_engine.policies.admission import AIMD, AdmissionPolicy, Watermark, make_admission, remaining_growth
from reference_engine.policies.preemption import Candidate, VictimFacts, Why, choose
from reference_engine.policies.preemption_costs import LinearCosts
from reference_engine.policies.startup_costs import measure_linear_costs
from reference_engine.request import Request, RequestStatus
from reference_engine.scheduler import Scheduler

BS = 4
# swap: 2 x (10 us + 1 us per block); recompute: 10 us per token. Swap is cheaper from one block on.
COSTS = LinearCosts(per_block_s=1e-6, per_copy_s=1e-5, per_token_s=1e-5)


def req(rid: str, prompt: int | list[int], max_tokens: int = 8) -> Request:
    tokens = list(range(100 + hash(rid) % 1000, 100 + hash(rid) % 1000 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def sched(gpu: int, cpu: int = 0, *, mode: str = "recompute", caching: bool = False,
          admission: AdmissionPolicy | None = None, max_num_seqs: int = 16) -> Scheduler:
    bm = BlockManager(gpu, cpu, BS, caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=256,
                     preemption_mode=mode, clock=lambda: 0.0, preemption_costs=COSTS, admission=admission)


def run_step(s: Scheduler, token: int = 1):
    out = s.schedule()
    s.update(out, {c.request.request_id: token for c in out.chunks if c.completes})
    return out


# ---------------------------------------------------------------------------------------------
# choose(): prices and a victim's facts in, a decision value out


def victim(num_blocks: int, computed: int, surviving: int = 0, shared: int = 0, *, free_host: int,
           next_in_line: Candidate | None = None) -> VictimFacts:
    return VictimFacts(Candidate(num_blocks, computed, surviving, shared), free_host, next_in_line=next_in_line)


def test_choose_swaps_when_cheaper_and_recomputes_when_not():
    long = choose(COSTS, victim(10, 40, free_host=100))
    assert (long.mode, long.why, long.reason) == ("swap", Why.SWAP_CHEAPER, "swap cheaper")
    assert (long.wanted, long.fell_back) == ("swap", False)
    assert long.estimated_swap_s == pytest.approx(2 * (1e-5 + 10e-6))
    assert long.estimated_recompute_s == pytest.approx(40e-5)
    # 39 of 40 tokens survive a recompute (prefix cache): one token to recompute beats a round trip
    cached = choose(COSTS, victim(10, 40, surviving=39, free_host=100))
    assert (cached.mode, cached.why, cached.wanted) == ("recompute", Why.RECOMPUTE_CHEAPER, "recompute")
    assert "kept by the prefix cache" in cached.reason
    assert cached.recompute_tokens == 1


def test_choose_host_pool_full_and_host_room_reserved():
    full = choose(COSTS, victim(10, 40, free_host=9))
    assert (full.mode, full.reason) == ("recompute", "swap cheaper but host pool full")
    assert (full.why, full.fell_back, full.wanted) == (Why.HOST_POOL_FULL, True, "swap")
    # Would leave 2 host blocks while the next victim in line holds 20 that save more per block
    # (80 tokens: 37 us a block against the victim's 28 us): keep the room for it.
    big = Candidate(20, 80, 0)
    kept = choose(COSTS, victim(2, 8, free_host=4, next_in_line=big))
    assert (kept.mode, kept.reason) == ("recompute", "host room kept for the next victim in line")
    assert (kept.why, kept.fell_back, kept.wanted) == (Why.HOST_ROOM_KEPT, False, "recompute")
    # The same victim with enough room left, or a next in line that saves nothing by a swap: swapped.
    assert choose(COSTS, victim(2, 8, free_host=40, next_in_line=big)).mode == "swap"
    assert choose(COSTS, victim(2, 8, free_host=4, next_in_line=Candidate(20, 80, 80))).mode == "swap"
    # ... or one that shares blocks (it would be recomputed, so it needs no room)
    assert choose(COSTS, victim(2, 8, free_host=4, next_in_line=Candidate(20, 80, 0, shared_blocks=1))).mode == "swap"


def test_choose_recomputes_a_victim_sharing_blocks_even_when_swap_is_cheaper():
    # A swap-in brings shared blocks back as private copies (held for the rest of the request's life).
    shared = choose(COSTS, victim(10, 40, surviving=8, shared=2, free_host=100))
    assert shared.mode == "recompute" and "unshared" in shared.reason and shared.why is Why.SHARES_BLOCKS
    assert choose(COSTS, victim(10, 40, surviving=8, free_host=100)).mode == "swap"


def test_model_costs_price_a_recompute_beside_the_waiting_prompts():
    # On a GPU a decode step is memory-bound: 128 tokens beside 64 decodes alone look almost free, but
    # beside a full step of waiting prompts (compute-bound) each recomputed token costs its compute.
    from reference_engine.costs import load_model_shape, load_profile
    from reference_engine.costs.cost_model import CostModel
    from reference_engine.policies.preemption_costs import ModelCosts

    costs = ModelCosts(CostModel(load_model_shape("llama-3-8b"), load_profile("h200")), 16)
    beside_decodes = costs.recompute_seconds(128, 64, 64 * 1500)
    beside_prompts = costs.recompute_seconds(128, 64, 64 * 1500, 2048)
    assert beside_prompts > 10 * beside_decodes
    assert beside_prompts > costs.swap_seconds(8)  # so a 128-token victim is then cheaper to swap


def test_measure_linear_costs_takes_slopes():
    clock = [0.0]
    timer = lambda: clock[0]  # noqa: E731

    def copy(n):
        clock[0] += 3e-5 + n * 2e-6

    def prefill(n):
        clock[0] += 1e-3 + n * 5e-5

    c = measure_linear_costs(copy, prefill, timer, blocks=8, short=32, long=128)
    assert c.per_block_s == pytest.approx(2e-6) and c.per_copy_s == pytest.approx(3e-5)
    assert c.per_token_s == pytest.approx(5e-5)


# ---------------------------------------------------------------------------------------------
# the scheduler in auto mode


def test_auto_swaps_a_long_victim_and_records_why():
    s = sched(gpu=6, cpu=16, mode="auto")
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)  # 2 blocks each, growing to 5
    s.add(a)
    s.add(b)
    for _ in range(12):
        run_step(s)
        if s.counters.preemptions:
            break
    (ev,) = [e for e in s.events if e.kind == "preempted"]
    assert ev.request_id == "b" and ev.data["mode"] == "swap" and ev.data["reason"] == "swap cheaper"
    assert ev.data["why"] == "swap_cheaper"
    assert ev.data["estimated_swap_s"] < ev.data["estimated_recompute_s"]
    assert s.counters.preemptions_swap == s.counters.swap_outs == 1 and s.counters.preemptions_recompute == 0
    assert b.status is RequestStatus.SWAPPED


def test_auto_recomputes_a_victim_whose_blocks_are_shared():
    # Prefix caching on: b shares a's first 3 blocks, so recomputing b costs only its tail while a
    # swap would copy all of its blocks.
    s = sched(gpu=9, cpu=32, mode="auto", caching=True)
    shared = list(range(500, 512))  # 3 full blocks
    a, b = req("a", [*shared, 1], max_tokens=16), req("b", [*shared, 2], max_tokens=16)
    s.add(a)
    run_step(s)  # a's blocks computed and cached before b arrives
    s.add(b)
    for _ in range(20):
        run_step(s)
        if s.counters.preemptions:
            break
    (ev,) = [e for e in s.events if e.kind == "preempted"]
    assert ev.data["mode"] == "recompute" and "kept by the prefix cache" in ev.data["reason"]
    assert s.counters.preemptions_recompute == 1 and s.counters.swap_fallbacks == 0


def test_auto_cheaper_swap_without_host_room_is_a_counted_fallback():
    s = sched(gpu=6, cpu=1, mode="auto")
    s.add(req("a", 8, max_tokens=12))
    s.add(req("b", 8, max_tokens=12))
    for _ in range(12):
        run_step(s)
        if s.counters.preemptions:
            break
    (ev,) = [e for e in s.events if e.kind == "preempted"]
    assert ev.data["mode"] == "recompute" and ev.data["reason"] == "swap cheaper but host pool full"
    assert (ev.data["why"], ev.data["wanted"]) == ("host_pool_full", "swap")
    assert s.counters.swap_fallbacks == 1 and s.counters.preemptions_recompute == 1


# ---------------------------------------------------------------------------------------------
# admission


def test_auto_prices_own_cached_blocks_as_lost_when_running_requests_will_draw_them():
    # v's first 3 blocks are cached but held only by v. With a running over many more steps, its growth
    # draws them off the free queue before v could be readmitted: priced as recomputed. With a about
    # to finish (one token left, 2 blocks free), they are kept.
    for a_tokens, expected in ((100, 13), (2, 1)):
        s = sched(gpu=8, cpu=32, mode="auto", caching=True)
        a, v = req("a", 8, max_tokens=a_tokens), req("v", 13, max_tokens=100)
        s.add(a)
        s.add(v)
        run_step(s)
        assert s.bm.num_free_gpu_blocks == 2 and v.num_computed_tokens == 13
        decision = s._auto_decision(v, 4)
        assert decision.recompute_tokens == expected, a_tokens


def test_auto_keeps_host_room_for_the_next_victim_in_line():
    # Linear prices: saving per block grows with the victim's size (38 us - 20 us / blocks). A 2-block
    # victim would leave 4 of 6 host blocks while the next victim in line needs 5 and saves more per
    # block: recomputed. With room for both, or when the next in line is the smaller one: swapped.
    # The largest running request is not the one kept room for unless it is next in line.
    def decide(*sizes: int, cpu: int):
        s = sched(gpu=24, cpu=cpu, mode="auto")
        for i, n in enumerate(sizes):
            s.add(req(f"r{i}", n))
        run_step(s)
        late = f"r{len(sizes) - 1}"
        return s._auto_decision(s.requests[late], len(s.bm.block_tables[late]))

    kept = decide(20, 8, cpu=6)
    assert (kept.mode, kept.reason) == ("recompute", "host room kept for the next victim in line")
    assert decide(20, 8, cpu=7).mode == "swap"
    assert decide(8, 20, cpu=6).mode == "swap"
    assert decide(20, 4, 8, cpu=6).mode == "swap"  # next in line: the 1-block r1, not the 5-block r0


def test_remaining_growth_is_bounded_by_max_tokens_and_model_len():
    r = req("r", 10, max_tokens=5)
    assert remaining_growth(r, 64) == 5 and remaining_growth(r, 3) == 3
    assert remaining_growth(r, 64, max_model_len=12) == 2


def test_watermark_projects_growth_of_running_requests():
    bm = BlockManager(10, 0, BS)
    running = req("a", 8, max_tokens=8)  # holds 2 blocks, will need 4 within 8 steps
    assert bm.allocate_slots(running, 8)
    new = req("n", 4, max_tokens=4)  # 2 blocks within the horizon
    w = Watermark(horizon=8, headroom=0.0)
    assert w.projected_blocks(new, [running], bm) == 2 + 2 + 2
    assert w.admits(new, [running], bm)
    tight = Watermark(horizon=8, headroom=0.5)  # 6 > 5 blocks allowed
    assert not tight.admits(new, [running], bm)
    assert tight.admits(new, [], bm), "an empty batch always admits: no stall"
    assert Watermark(horizon=0, headroom=0.5).admits(new, [running], bm), "no look-ahead: 2 + 0 + 1 <= 5"


def test_watermark_avoids_the_preemption_plain_admission_makes():
    def serve(admission):
        s = sched(gpu=8, admission=admission)
        for i in range(3):
            s.add(req(f"r{i}", 6, max_tokens=10))  # 2 blocks each at admission, 4 at the end
        steps = 0
        while s.has_unfinished():
            run_step(s)
            steps += 1
        return s.counters.preemptions, steps

    plain, _ = serve(None)
    gated, _ = serve(Watermark(horizon=16, headroom=0.0))
    assert plain > 0, "the workload must preempt without admission control, or the test shows nothing"
    assert gated == 0


def test_aimd_halves_on_excess_preemptions_and_grows_when_quiet():
    p = AIMD(max_num_seqs=16, budget_per_window=1, window=10)
    p.after_step(1)
    assert p.cap == 16, "within the budget: no cut"
    p.after_step(1)
    assert p.cap == 8
    bm = BlockManager(4, 0, BS)
    assert p.admits(req("x", 1), [req(f"r{i}", 1) for i in range(7)], bm)
    assert not p.admits(req("x", 1), [req(f"r{i}", 1) for i in range(8)], bm)
    for _ in range(10):
        p.after_step(0)
    assert p.cap == 9


def test_make_admission_and_config_validation():
    assert isinstance(make_admission("watermark", max_num_seqs=4, horizon=8, headroom=0.1, budget=1), Watermark)
    assert isinstance(make_admission("aimd", max_num_seqs=4, horizon=8, headroom=0.1, budget=1), AIMD)
    for field, value in [("admission_policy", "fifo"), ("admission_headroom", 1.0), ("admission_headroom", -0.1),
                         ("admission_horizon", -1), ("preemption_budget", float("nan")), ("preemption_mode", "autoo"),
                         ("cost_profile", "")]:
        with pytest.raises(ConfigError) as e:
            EngineConfig(model="m", **{field: value})
        assert e.value.field == field
    EngineConfig(model="m", preemption_mode="auto", admission_policy="aimd", preemption_budget=0)


# ---------------------------------------------------------------------------------------------
# on the tiny model: auto fires both ways, outputs exact


def _mixed_workload():
    """Twelve requests: short ones sharing a 32-token system prompt, and two long unique ones."""
    rng = random.Random(0)
    system = [rng.randrange(5, 500) for _ in range(32)]
    prompts, params = [], []
    for i in range(12):
        if i % 6 == 3:
            prompts.append([rng.randrange(5, 500) for _ in range(rng.randrange(200, 300))])
            params.append(SamplingParams(max_tokens=32, ignore_eos=True))
        else:
            prompts.append(system + [rng.randrange(5, 500) for _ in range(rng.randrange(4, 20))])
            params.append(SamplingParams(max_tokens=rng.randrange(16, 40), ignore_eos=True))
    return prompts, params


def test_auto_chooses_both_modes_in_one_run_and_outputs_are_exact(tiny_ckpt):
    prompts, params = _mixed_workload()
    alone = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=1024, enable_prefix_caching=True))
    expected = [o.token_ids for o in alone.generate(prompts, params)]
    assert alone.counters().preemptions == 0
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=40, num_cpu_blocks_override=24,
                                    preemption_mode="auto", enable_prefix_caching=True))
    assert isinstance(engine.scheduler.preemption_costs, LinearCosts)
    assert engine.scheduler.preemption_costs.source.startswith("measured")
    engine.scheduler.preemption_costs = COSTS  # fixed prices: the choices must not depend on the machine's load
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    c = engine.counters()
    modes = [e.data["mode"] for e in engine.events if e.kind == "preempted"]
    assert c.preemptions_swap > 0 and c.preemptions_recompute > 0, modes
    assert modes.count("swap") == c.preemptions_swap and modes.count("recompute") == c.preemptions_recompute
    assert engine.block_manager.is_whole()


def test_watermark_engine_outputs_exact_with_fewer_preemptions(tiny_ckpt):
    prompts, params = _mixed_workload()
    counts, outputs = {}, {}
    for policy in ("none", "watermark"):
        engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=40, admission_policy=policy,
                                        admission_headroom=0.0))
        outputs[policy] = [o.token_ids for o in engine.generate(prompts, params)]
        counts[policy] = engine.counters().preemptions
        assert engine.block_manager.is_whole()
    assert outputs["none"] == outputs["watermark"]
    assert counts["none"] > 0 and counts["watermark"] < counts["none"], counts


# ---------------------------------------------------------------------------------------------
# prefill pacing: a cap on the prefill tokens of steps with decodes


def _paced_sched(cap: int | None, *, chunked: bool = False) -> Scheduler:
    bm = BlockManager(64, 0, BS)
    return Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, clock=lambda: 0.0,
                     enable_chunked_prefill=chunked, prefill_pacing_tokens=cap)


def _prefill_beside_decodes(s: Scheduler, steps: int = 40) -> list[tuple[int, int]]:
    """(prefill tokens, decode tokens) of each step until done."""
    shapes = []
    while s.has_unfinished() and len(shapes) < steps:
        out = run_step(s)
        shapes.append((out.num_prefill_tokens, out.num_decode_tokens))
    return shapes


def test_pacing_unchunked_admits_one_long_prompt_per_step_beside_decodes():
    def first_steps(cap):
        s = _paced_sched(cap)
        s.add(req("d", 4, max_tokens=20))
        run_step(s)  # d decodes from now on
        for i in range(3):
            s.add(req(f"long{i}", 20))  # over the cap of 16: never split, so one per step
        s.add(req("short", 6))
        return [out for out in (run_step(s), run_step(s), run_step(s))]

    plain = first_steps(None)
    assert plain[0].num_prefill_tokens == 66, "without pacing all four are admitted beside the decode"
    paced = first_steps(16)
    assert [o.num_prefill_tokens for o in paced] == [20, 20, 20]
    assert all(o.num_decode_tokens >= 1 for o in paced), "the decode ran every step"
    # prompts that fit the cap share a step: two of 6 tokens beside the decode
    s = _paced_sched(16)
    s.add(req("d", 4, max_tokens=20))
    run_step(s)
    s.add(req("a", 6))
    s.add(req("b", 6))
    assert run_step(s).num_prefill_tokens == 12


def test_pacing_chunked_caps_prefill_beside_decodes_and_not_without():
    def shapes(cap):
        s = _paced_sched(cap, chunked=True)
        s.add(req("d", 4, max_tokens=30))
        run_step(s)
        for i in range(3):
            s.add(req(f"p{i}", 50, max_tokens=4))
        return _prefill_beside_decodes(s)

    plain = shapes(None)
    assert max(p for p, d in plain if d) == 150, "unpaced, all three prefill beside the decode at once"
    paced = shapes(16)
    assert all(p <= 16 for p, d in paced if d), paced
    assert sum(p for p, _ in paced) == 150, "every prompt token was still prefilled"
    # a step without decodes is not paced: the first step of a fresh engine prefills everything it can
    s = _paced_sched(16, chunked=True)
    for i in range(2):
        s.add(req(f"q{i}", 50))
    assert run_step(s).num_prefill_tokens == 100


def test_pacing_config_validation():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ConfigError) as e:
            EngineConfig(model="m", prefill_pacing_tokens=bad)
        assert e.value.field == "prefill_pacing_tokens"
    assert EngineConfig(model="m", prefill_pacing_tokens=1).prefill_pacing_tokens == 1


@pytest.mark.parametrize("chunked", [False, True])
def test_pacing_with_watermark_engine_outputs_exact(tiny_ckpt, chunked):
    """Pacing changes when prompts are prefilled, never what is generated; and it fired (a step beside
    decodes that the unpaced run filled with more prefill than the cap)."""
    prompts, params = _mixed_workload()
    cap = 64

    def serve(**extra):
        engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=40, enable_chunked_prefill=chunked,
                                        **extra))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        final, shapes = {}, []
        while engine.has_unfinished_requests():
            result = engine.step()
            for o in result.outputs:
                if o.finished:
                    final[o.request_id] = o.token_ids
            shapes.append((result.record.num_prefill_tokens, result.record.num_decode_tokens))
        assert engine.block_manager.is_whole()
        admitted = collections.Counter(e.step for e in engine.events if e.kind == "admitted")
        return [final[f"r{i}"] for i in range(len(prompts))], shapes, admitted

    expected, plain, _ = serve()
    got, paced, admitted = serve(admission_policy="watermark", prefill_pacing_tokens=cap)
    assert got == expected
    assert any(p > cap for p, d in plain if d), "the unpaced run must prefill past the cap beside decodes"
    over = [step for step, (p, d) in enumerate(paced, start=1) if d and p > cap]
    if chunked:
        assert not over, paced
    else:  # unsplit prompts: past the cap only as the step's one prefill (steps count from 1)
        assert over, "a prompt over the cap must have been admitted beside decodes (the rule's case)"
        assert all(admitted[step] == 1 for step in over), (over, admitted)
