"""What swap, prefix caching, priority and aborts do, observed through the engine's own counters,
events and KV tensors (issue: swap / prefix caching / priority)."""

from __future__ import annotations

import pytest
import torch

from reference_engine import SamplingParams
from tests.conftest import greedy_params


def _prompts(n: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _events(engine, kind: str, **match):
    return [e for e in engine.events if e.kind == kind and all(e.data.get(k) == v for k, v in match.items())]


def test_swapped_blocks_are_byte_identical_after_the_round_trip(tiny_ckpt, workload):
    """Snapshot each victim's device blocks as they leave, compare with where they land on return
    (the same check the conformance suite runs, through the reference adapter)."""
    from kvbench.engines.base import GenRequest, Knobs
    from kvbench.engines.inprocess.reference import ReferenceAdapter

    prompts, max_tokens = workload
    requests = [GenRequest(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    adapter = ReferenceAdapter(tiny_ckpt, {"check_invariants": "true"})
    compared, mismatches = adapter.swap_round_trip(
        requests, Knobs(num_gpu_blocks=40, num_cpu_blocks=256, preemption_mode="swap"))
    assert compared > 0, "nothing was swapped in: the check proved nothing"
    assert not mismatches, mismatches[:5]


def test_swap_events_carry_bytes_and_time(make_engine, workload):
    engine = make_engine(num_gpu_blocks_override=40, preemption_mode="swap")
    prompts, max_tokens = workload
    engine.generate(prompts, greedy_params(max_tokens))
    outs, ins = _events(engine, "swapped_out"), _events(engine, "swapped_in")
    assert outs and ins
    assert all(e.data["bytes"] > 0 and e.data["seconds"] >= 0 for e in outs + ins)
    c = engine.counters()
    assert c.swapped_out_bytes == c.swapped_in_bytes > 0
    # each event carries its own request's bytes: they add up to the engine's totals
    assert sum(e.data["bytes"] for e in outs) == c.swapped_out_bytes
    assert sum(e.data["bytes"] for e in ins) == c.swapped_in_bytes
    # swapped requests resume before new admissions and never in a step that swapped out
    out_steps = {e.step for e in outs}
    assert not out_steps.intersection(e.step for e in ins)


def test_host_pool_exhaustion_falls_back_to_recompute(make_engine, workload, hf_greedy):
    prompts, max_tokens = workload
    engine = make_engine(num_gpu_blocks_override=40, preemption_mode="swap", num_cpu_blocks_override=6)
    outputs = engine.generate(prompts, greedy_params(max_tokens))
    c = engine.counters()
    assert c.swap_fallbacks > 0 and c.preemptions_recompute == c.swap_fallbacks
    assert _events(engine, "swap_fallback")
    assert [o.token_ids for o in outputs] == hf_greedy
    assert all(o.finished for o in outputs)


def test_prefix_caching_on_equals_off_and_hits(make_engine):
    """Shared system prompt: identical outputs with caching on and off, and hits > 0 with it on."""
    system = _prompts(1, 100, seed=1)[0]
    prompts = [system + p for p in _prompts(12, 30, seed=2)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    off = make_engine(num_gpu_blocks_override=512).generate(prompts, params)
    engine = make_engine(num_gpu_blocks_override=512, enable_prefix_caching=True, max_num_seqs=4)
    on = engine.generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    hits = engine.counters().prefix_cache_hits
    assert hits >= 6 * 96  # 6 full blocks of the system prompt, later requests
    assert sum(o.num_cached_tokens for o in on) == hits
    assert _events(engine, "prefix_hit")


def test_concurrent_requests_share_prefix_blocks_by_refcount(make_engine):
    system = _prompts(1, 64, seed=3)[0]
    a, b = (system + p for p in _prompts(2, 10, seed=4))
    engine = make_engine(num_gpu_blocks_override=64, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.add_request("a", a, params)
    engine.step()  # a prefilled: its 4 full blocks are now hashed
    engine.add_request("b", b, params)
    engine.step()
    shared = set(engine.block_manager.blocks_of("a")[:4])
    assert shared == set(engine.block_manager.blocks_of("b")[:4])
    assert all(engine.block_manager.pool.blocks[i].ref_cnt == 2 for i in shared)
    while engine.has_unfinished_requests():
        engine.step()


def test_prefix_caching_makes_recompute_cheaper(make_engine, workload, hf_greedy):
    """Same overloaded workload: with caching, recompute preemptions compute strictly fewer tokens."""
    prompts, max_tokens = workload
    results = {}
    for caching in (False, True):
        engine = make_engine(num_gpu_blocks_override=40, enable_prefix_caching=caching)
        outputs = engine.generate(prompts, greedy_params(max_tokens))
        assert [o.token_ids for o in outputs] == hf_greedy
        results[caching] = engine.counters()
    assert results[False].preemptions_recompute > 0 and results[True].preemptions_recompute > 0
    assert results[True].prefix_cache_hits > 0
    assert results[True].computed_tokens < results[False].computed_tokens
    assert results[True].recomputed_tokens < results[False].recomputed_tokens


def test_mid_prefill_preemption_resumes_past_cached_blocks(make_engine):
    """A long prompt preempted in the middle of a chunked prefill keeps its computed full blocks
    (the seeds note that vLLM loses chunked-prefill progress on preemption: ours does not, while
    the blocks survive in the cache)."""
    engine = make_engine(num_gpu_blocks_override=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                         max_num_batched_tokens=32)
    decoder, long_prompt = _prompts(1, 30, seed=5)[0], _prompts(1, 240, seed=6)[0]
    engine.add_request("decoder", decoder, SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while not _events(engine, "preempted"):
        engine.step()
    first = _events(engine, "preempted")[0]
    # the long prompt is the latest admitted, and it was caught in the middle of its prefill
    assert first.request_id == "long" and 0 < first.data["tokens_discarded"] < 240
    while engine.has_unfinished_requests():
        engine.step()
    resumed = [e for e in _events(engine, "admitted", resumed=True) if e.request_id == "long"]
    assert resumed and resumed[0].data["cached_tokens"] >= 16, "the resume recomputed from scratch"
    # and the answer is still right
    alone = make_engine(num_gpu_blocks_override=64).generate([long_prompt], SamplingParams(max_tokens=4,
                                                                                          ignore_eos=True))
    finished = [e for e in engine.events if e.kind == "finished" and e.request_id == "long"]
    assert finished and finished[0].data["output_tokens"] == len(alone[0].token_ids)


def test_priority_preemption_evicts_the_lowest_priority_running_request(make_engine):
    engine = make_engine(num_gpu_blocks_override=18, scheduling_policy="priority")
    prompts = _prompts(4, 60, seed=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for rid, prompt, prio in zip(("p0", "p2", "p1"), prompts[:3], (0, 2, 1), strict=True):
        engine.add_request(rid, prompt, params, priority=prio)
    engine.step()  # all three admitted: 3 x 4 blocks, 6 left
    assert len(engine.scheduler.running) == 3
    engine.add_request("urgent", prompts[3] + prompts[3], params, priority=0)  # 120 tokens: needs 8 blocks
    engine.step()
    victims = [e.request_id for e in _events(engine, "preempted")]
    assert victims and victims[0] == "p2", victims
    while engine.has_unfinished_requests():
        engine.step()


def test_fcfs_preempts_the_latest_admitted(make_engine):
    engine = make_engine(num_gpu_blocks_override=12)
    prompts = _prompts(3, 60, seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=60, ignore_eos=True))
    while not _events(engine, "preempted"):
        engine.step()
    assert _events(engine, "preempted")[0].request_id == "r2"
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill", "preempted", "swapped", "finished"])
def test_abort_in_any_state_frees_blocks(state, make_engine):
    mode = "swap" if state == "swapped" else "recompute"
    engine = make_engine(num_gpu_blocks_override=12, preemption_mode=mode, enable_chunked_prefill=True,
                         max_num_batched_tokens=32, enable_prefix_caching=True)
    prompts = _prompts(3, 60, seed=10)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    target = {"waiting": "r2", "running": "r0", "mid_prefill": "r0", "preempted": None, "swapped": None,
              "finished": None}[state]
    if state == "mid_prefill":
        engine.step()
        assert 0 < engine.scheduler.requests["r0"].num_computed_tokens < 60
    elif state == "running":
        engine.step(), engine.step()
    elif state in ("preempted", "swapped"):
        while not _events(engine, "preempted"):
            engine.step()
        target = _events(engine, "preempted")[0].request_id
        req = engine.scheduler.requests[target]
        assert req.status.value == ("swapped" if state == "swapped" else "waiting")
        if state == "swapped":
            assert engine.block_manager.host_tables[target]
    elif state == "finished":
        while "r0" in engine.scheduler.requests:
            engine.step()
        assert engine.abort_request("r0") is False
        target = None
    if target is not None:
        assert engine.abort_request(target)
        outs = engine.step().outputs
        assert any(o.request_id == target and o.finish_reason == "abort" for o in outs)
        assert target not in engine.block_manager.block_tables and target not in engine.block_manager.host_tables
        assert _events(engine, "aborted")[0].data["state"] == ("waiting" if state == "preempted" else
                                                               "running" if state == "mid_prefill" else state)
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_invariants()
    assert engine.block_manager.is_whole()


def _small_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """16 short requests, half behind a shared 16-token prefix: with block size 4 and a 24-block pool,
    ~110 cheap steps with preemptions, cache hits and chunks (a fake-model dry run measured it)."""
    system = _prompts(1, 16, seed=11)[0]
    g = torch.Generator().manual_seed(12)
    lengths = torch.randint(4, 33, (16,), generator=g).tolist()
    max_tokens = torch.randint(8, 25, (16,), generator=g).tolist()
    prompts = [(system if i % 2 else []) + _prompts(1, n, seed=100 + i)[0] for i, n in enumerate(lengths)]
    return prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]


@pytest.fixture(scope="module")
def small_workload_alone(tiny_ckpt) -> list[list[int]]:
    """The small workload's greedy outputs from an engine that never runs out of blocks."""
    from reference_engine import EngineConfig, LLMEngine

    prompts, params = _small_workload()
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, block_size=4, num_gpu_blocks_override=512))
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_events_add_up_to_the_counters(mode, make_engine, small_workload_alone):
    """Under pressure, with prefix caching and chunked prefill: every counter is the sum of its events
    (seen through a sink), and of the per-request numbers in the outputs; the answers stay exact."""
    prompts, params = _small_workload()
    received = []
    engine = make_engine(block_size=4, num_gpu_blocks_override=24, preemption_mode=mode, enable_prefix_caching=True,
                         enable_chunked_prefill=True, max_num_batched_tokens=16, max_events=10,
                         num_cpu_blocks_override=8 if mode == "swap" else None)
    engine.add_event_sink(received.append)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == small_workload_alone
    c = engine.counters()
    assert len(engine.events) == 10 and engine.events.num_recorded == len(received)


    def of(kind: str, **match) -> list:
        return [e for e in received if e.kind == kind and all(e.data.get(k) == v for k, v in match.items())]

    recompute, swap = of("preempted", mode="recompute"), of("preempted", mode="swap")
    assert (len(recompute), len(swap), len(of("swap_fallback"))) == (
        c.preemptions_recompute, c.preemptions_swap, c.swap_fallbacks)
    assert c.preemptions_recompute > 0 and c.prefix_cache_hits > 0 and c.prefill_chunks > 0
    if mode == "swap":
        assert c.preemptions_swap > 0 and c.swap_fallbacks > 0, "the host pool should both take and refuse"
    outs, ins = of("swapped_out"), of("swapped_in")
    assert (len(outs), len(ins)) == (c.swap_outs, c.swap_ins) and c.swap_outs == c.preemptions_swap
    assert sum(e.data["bytes"] for e in outs) == c.swapped_out_bytes
    assert sum(e.data["bytes"] for e in ins) == c.swapped_in_bytes
    assert sum(e.data["seconds"] / e.data["requests"] for e in outs + ins) == pytest.approx(c.swap_seconds)
    assert sorted((e.request_id, e.step, e.data["blocks"]) for e in outs) == sorted(
        (e.request_id, e.step, e.data["blocks"]) for e in swap), "each swap preemption copies its blocks"
    assert sum(e.data["tokens"] for e in of("prefix_hit")) == c.prefix_cache_hits
    assert sum(e.data["output_tokens"] for e in of("finished")) == c.generated_tokens

    # Per request: both modes count as preemptions; recompute and cache hits add up to the totals.
    per_request = {o.request_id: o.num_preemptions for o in outputs if o.num_preemptions}
    preempted_ids = [e.request_id for e in recompute + swap]
    assert per_request == {rid: preempted_ids.count(rid) for rid in set(preempted_ids)}
    assert sum(o.num_recomputed_tokens for o in outputs) == c.recomputed_tokens
    assert sum(o.num_cached_tokens for o in outputs) == c.prefix_cache_hits

    # Every discarded token was either computed again or, at the next admission, restored from the
    # prefix cache (up to the highest position the request had held: beyond it nothing was owed).
    restored, highest = 0, {}
    for e in received:
        if e.kind == "preempted" and e.data["mode"] == "recompute":
            highest[e.request_id] = max(highest.get(e.request_id, 0), e.data["tokens_discarded"])
        elif e.kind == "admitted" and e.data["resumed"]:
            restored += min(e.data["cached_tokens"], highest.get(e.request_id, 0))
    assert restored > 0, "no resume was served from the cache: the check proved less than it claims"
    assert sum(e.data["tokens_discarded"] for e in recompute) == c.recomputed_tokens + restored
