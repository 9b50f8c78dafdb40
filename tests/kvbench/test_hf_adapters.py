"""Tests of the ``hf`` (ground truth) and ``hf-cb`` (transformers continuous batching) adapters.

Tiny model (``kvbench.models.random_llama``'s ``tiny`` preset: vocab 512, hidden 64, 2 layers, GQA), a handful of short
requests, block size 16. What was observed on CPU with transformers 5.24 and is asserted here:

* generous pool: ``hf-cb`` greedy outputs equal ``hf``'s exactly, nothing preempted, nothing leaked;
* pool too small for all requests at once: the engine soft-resets victims (recompute of prompt +
  generated tokens, ``OffloadingManager.offload_requests``) and the outputs are *still exactly* ``hf``'s;
* one request larger than the whole pool: ``ContinuousBatchProcessor.prepare_next_batch`` raises
  "No requests can be scheduled and no requests can be offloaded." and every request still in flight fails.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvbench.bench.workloads import Workload, WorkloadRequest
from kvbench.conformance.equivalence import compare
from kvbench.core.trace import TraceRecorder
from kvbench.engines.base import GenRequest, Knobs
from kvbench.engines.hf.continuous_batching import HFContinuousBatchingAdapter, map_knobs
from kvbench.engines.hf.generate import HFAdapter
from kvbench.models.random_llama import write_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_TOKENS = 16
BLOCK = 16
PROMPT_LENS = (9, 23, 40, 57)  # the longest request needs 57 + 16 = 73 tokens = 5 blocks


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0))


def _prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=gen).tolist()  # above the special tokens


@pytest.fixture(scope="module")
def requests_() -> list[GenRequest]:
    gen = torch.Generator().manual_seed(1234)
    return [GenRequest(f"r{i}", _prompt(gen, n), MAX_TOKENS) for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def hf(ckpt_dir: str) -> HFAdapter:
    return HFAdapter(ckpt_dir)


@pytest.fixture(scope="module")
def cb(ckpt_dir: str) -> HFContinuousBatchingAdapter:
    return HFContinuousBatchingAdapter(ckpt_dir)


@pytest.fixture(scope="module")
def reference(hf: HFAdapter, requests_: list[GenRequest]) -> list[list[int]]:
    return [o.token_ids for o in hf.generate(requests_).outputs]


def _assert_same_as_hf(hf: HFAdapter, requests: list[GenRequest], expected: list[list[int]], result) -> None:
    for request, want, got in zip(requests, expected, result.outputs, strict=True):
        margins = hf.top2_margins(request.prompt_token_ids, want)
        verdict = compare(want, got.token_ids, margins, actual_finish_reason=got.finish_reason)
        assert verdict.status == "exact", f"{request.request_id}: {verdict.explain()}\n" + "\n".join(result.evidence)


# ---------------------------------------------------------------------------------------------------- hf


def test_hf_greedy_outputs_exactly_max_tokens(reference: list[list[int]]):
    assert [len(t) for t in reference] == [MAX_TOKENS] * len(PROMPT_LENS)


def test_hf_top2_margins_match_teacher_forced_argmax(hf: HFAdapter, requests_, reference):
    request, tokens = requests_[1], reference[1]
    margins = hf.top2_margins(request.prompt_token_ids, tokens)
    assert len(margins) == len(tokens)
    assert all(m > 0 for m in margins)  # greedy picks are strict argmaxes of a random-weight model
    # The distribution at position len(prompt) + i - 1 predicts token i: its argmax is the greedy pick.
    ids = torch.tensor([request.prompt_token_ids + tokens[:-1]])
    with torch.inference_mode():
        logits = hf.model(ids).logits[0, len(request.prompt_token_ids) - 1:]
    assert logits.argmax(-1).tolist() == tokens
    assert hf.top2_margins(request.prompt_token_ids, []) == []


def test_hf_seeded_sampling_is_reproducible(hf: HFAdapter):
    prompt = list(range(10, 30))
    a, b, c = (hf.generate([GenRequest("s", prompt, 12, temperature=1.0, seed=s)]).outputs[0].token_ids
               for s in (7, 7, 8))
    assert a == b
    assert a != c
    assert len(a) == 12


def test_hf_rejects_unknown_options(ckpt_dir: str):
    with pytest.raises(ValueError, match="unknown option"):
        HFAdapter(ckpt_dir, {"block_size": "16"})
    assert "num_gpu_blocks" in HFAdapter.unsupported_knobs
    assert not HFAdapter.capabilities & {"recompute", "swap", "prefix_caching", "chunked_prefill"}


def test_adapters_import_without_transformers():
    code = ("import sys, kvbench.engines.hf.generate, kvbench.engines.hf.continuous_batching, "
            "kvbench.conformance.equivalence; "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------------------------- knobs


@dataclass
class _Cfg:  # the few model-config fields map_knobs reads
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    hidden_size: int = 64


def test_map_knobs_table():
    knobs = Knobs(block_size=16, num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=32,
                  enable_prefix_caching=False, enable_chunked_prefill=True, scheduling_policy="fcfs",
                  preemption_mode="recompute")
    kwargs, _ = map_knobs(knobs, {"scheduler": "prefill_first", "safety_margin": "0.0"}, _Cfg())
    assert kwargs == {"page_size": 16, "num_blocks": 8, "max_requests_per_batch": 4, "max_batch_tokens": 32,
                      "allow_block_sharing": False, "scheduler_type": "prefill_first", "safety_margin": 0.0,
                      "cpu_offload_space": 0.0}
    # num_cpu_blocks -> GiB: 2 layers * K,V * 2 kv heads * head_dim 16 * 4 bytes * 16 tokens = 8 KiB a block
    kwargs, _ = map_knobs(Knobs(block_size=16, num_cpu_blocks=128, preemption_mode="swap"), {}, _Cfg(), "cuda")
    assert kwargs["cpu_offload_space"] * 1024**3 == pytest.approx(128 * 8192)


@pytest.mark.parametrize(("knobs", "options", "device", "match"), [
    (Knobs(max_model_len=128), {}, "cpu", "length cap"),
    (Knobs(enable_chunked_prefill=False), {}, "cpu", "enable_chunked_prefill"),
    (Knobs(scheduling_policy="priority"), {}, "cpu", "priorit"),
    (Knobs(preemption_mode="swap", num_cpu_blocks=8), {}, "cpu", "pin_memory"),
    (Knobs(preemption_mode="swap"), {}, "cuda", "needs a CPU offload pool"),
    (Knobs(block_size=2), {}, "cpu", "page_size must be >= 4"),
    (Knobs(), {"scheduler": "lifo"}, "cpu", "scheduler"),
])
def test_map_knobs_refuses_what_the_engine_cannot_do(knobs, options, device, match):
    with pytest.raises(ValueError, match=match):
        map_knobs(knobs, options, _Cfg(), device)


def test_hf_cb_capabilities(ckpt_dir: str):
    cpu = HFContinuousBatchingAdapter(ckpt_dir)
    assert cpu.capabilities == {"recompute", "prefix_caching", "chunked_prefill", "abort"}
    assert "swap" in HFContinuousBatchingAdapter(ckpt_dir, {"device": "cuda"}).capabilities
    with pytest.raises(ValueError, match="unknown option"):
        HFContinuousBatchingAdapter(ckpt_dir, {"num_blocks": "8"})


# ------------------------------------------------------------------------------------------ hf-cb runs


def test_hf_cb_equals_hf_with_a_generous_pool(hf, cb, requests_, reference):
    logger = logging.getLogger("ContinuousBatchingLogger")
    level, handlers = logger.level, list(logger.handlers)
    result = cb.generate(requests_, Knobs(block_size=BLOCK, num_gpu_blocks=64))
    _assert_same_as_hf(hf, requests_, reference, result)
    assert [o.finish_reason for o in result.outputs] == ["length"] * len(requests_)
    c = result.counters
    assert (c["preemptions_recompute"], c["preemptions_swap"], c["recomputed_tokens"], c["leaked_blocks"]) == (0,) * 4
    assert c["computed_tokens"] == sum(PROMPT_LENS) + len(PROMPT_LENS) * (MAX_TOKENS - 1)
    assert any("num_blocks=64" in line for line in result.evidence)
    assert (logger.level, logger.handlers) == (level, handlers)  # the log capture cleaned up after itself


def test_hf_cb_under_memory_pressure_soft_resets_and_stays_exact(hf, cb, requests_, reference):
    # 6 blocks = 96 tokens for 193 tokens of requests; the largest alone (73 tokens) fits.
    knobs = Knobs(block_size=BLOCK, num_gpu_blocks=6, enable_prefix_caching=False)
    result = cb.generate(requests_, knobs)
    c = result.counters
    assert c["preemptions_recompute"] > 0, result.evidence  # the mechanism fired...
    assert c["preemptions_swap"] == 0  # ...and it was a soft reset: no CPU pool on CPU
    assert c["recomputed_tokens"] > 0
    assert sum(o.num_preemptions for o in result.outputs) == c["preemptions_recompute"]
    assert any("soft reset" in line for line in result.evidence)
    # the probe's count is the one the engine's own "Offloaded ..." log lines give
    assert f"hf-cb cross-check: preemptions_recompute = {c['preemptions_recompute']}, as the engine's " \
           "'Offloaded ... soft reset' INFO lines say" in result.evidence
    assert c["leaked_blocks"] == 0
    _assert_same_as_hf(hf, requests_, reference, result)  # observed: still exactly hf's greedy tokens


def test_hf_cb_chunked_prefill_stays_exact(hf, cb, requests_, reference):
    result = cb.generate(requests_, Knobs(block_size=BLOCK, num_gpu_blocks=64, max_num_batched_tokens=16))
    # pieces of at most 16 tokens: at least 0 + 1 + 2 + 3 that leave prompt tokens for later (the contract
    # counts k - 1 for k pieces); more when a step's budget is shared
    assert result.counters["prefill_chunks"] >= sum((n + 15) // 16 - 1 for n in PROMPT_LENS)
    _assert_same_as_hf(hf, requests_, reference, result)


def test_hf_cb_prefix_caching_hits_and_stays_exact(hf, cb):
    gen = torch.Generator().manual_seed(99)
    shared = _prompt(gen, 40)  # two full blocks of 16 are shareable
    requests = [GenRequest(f"p{i}", shared + _prompt(gen, 3 + i), 8) for i in range(3)]
    expected = [o.token_ids for o in hf.generate(requests).outputs]
    # A block is hashed only after its forward pass, so requests prefilled in the same step cannot share:
    # a 48-token budget keeps p0's 43-token prompt almost alone in the first step (p1 gets a 5-token chunk,
    # searched before p0's blocks were hashed: a miss); p2 comes later and hits p0's two full blocks.
    knobs = Knobs(block_size=BLOCK, num_gpu_blocks=64, max_num_batched_tokens=48, enable_prefix_caching=True)
    result = cb.generate(requests, knobs)
    hits = result.counters["prefix_cache_hits"]
    assert hits >= 32 and hits % BLOCK == 0, result.counters  # whole blocks only
    assert result.counters["prefix_cache_queries"] >= result.counters["prefix_cache_hits"]
    assert result.counters["recomputed_tokens"] == 0
    assert any(line.startswith(f"hf-cb cross-check: prefix_cache_hits = {hits},") for line in result.evidence)
    _assert_same_as_hf(hf, requests, expected, result)


def test_hf_cb_request_larger_than_the_pool_kills_every_request_in_flight(cb):
    # Upstream behaviour, not ours: with the big request prefilling in chunks, it is the only active request
    # when it runs out of blocks; nothing can be offloaded (one active request is always kept), so
    # prepare_next_batch raises and _handle_critical_error fails every request, bystanders included.
    gen = torch.Generator().manual_seed(0)
    requests = [GenRequest("big", _prompt(gen, 57), 16)] + [GenRequest(f"small{i}", _prompt(gen, 8), 16)
                                                             for i in range(3)]
    result = cb.generate(requests, Knobs(block_size=BLOCK, num_gpu_blocks=3, max_num_batched_tokens=16))
    assert [o.finish_reason for o in result.outputs] == ["error"] * 4
    assert any("No requests can be scheduled and no requests can be offloaded" in line for line in result.evidence)


def test_hf_cb_seeded_sampling_and_one_setup_per_run(cb):
    prompt = list(range(10, 30))
    knobs = Knobs(block_size=BLOCK, num_gpu_blocks=16)  # unset, the CPU cache is sized to 60% of RAM: slow
    runs = [cb.generate([GenRequest("s", prompt, 10, temperature=1.0, seed=5)], knobs).outputs[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 10
    with pytest.raises(ValueError, match="share temperature"):
        cb.generate([GenRequest("a", prompt, 4), GenRequest("b", prompt, 4, temperature=0.7)])


# ---------------------------------------------------------------------------------------------- serve


def _workload(requests: list[WorkloadRequest], concurrency: int | None = None) -> Workload:
    return Workload(name="test", requests=requests, concurrency=concurrency, spec={})


def test_hf_cb_serve_open_loop_under_pressure(hf, cb, requests_, reference):
    workload = _workload([WorkloadRequest(r.request_id, r.prompt_token_ids, r.max_tokens, 0.02 * i)
                          for i, r in enumerate(requests_)])
    recorder = TraceRecorder("hf-cb", "open-loop")
    cb.serve(workload, recorder, Knobs(block_size=BLOCK, num_gpu_blocks=6, enable_prefix_caching=False))
    trace = recorder.finish()
    assert set(trace.requests) == {r.request_id for r in requests_}
    for r in trace.requests.values():
        assert r.finish_reason == "length"
        assert len(r.token_times) == MAX_TOKENS
        assert r.arrival <= r.admitted <= r.token_times[0] <= r.finished
        assert r.token_times == sorted(r.token_times)
    assert trace.steps and all(0.0 <= s.kv_usage <= 1.0 for s in trace.steps)
    assert sum(s.num_prefill_tokens + s.num_decode_tokens for s in trace.steps) == trace.counters["computed_tokens"]
    preemptions = sum(len(r.preemptions) for r in trace.requests.values())
    assert preemptions == trace.counters["preemptions_recompute"] == sum(s.num_preempted for s in trace.steps)
    assert sum(r.recomputed_tokens for r in trace.requests.values()) == trace.counters["recomputed_tokens"]
    assert trace.counters["leaked_blocks"] == 0
    assert trace.not_exposed == {}


def test_hf_cb_serve_closed_loop_with_abort(cb):
    gen = torch.Generator().manual_seed(5)
    requests = [WorkloadRequest("long", _prompt(gen, 10), 400, 0.0, abort_at=0.05)]
    requests += [WorkloadRequest(f"q{i}", _prompt(gen, 10), 8, 0.0) for i in range(3)]
    recorder = TraceRecorder("hf-cb", "closed-loop")
    cb.serve(_workload(requests, concurrency=2), recorder, Knobs(block_size=BLOCK, num_gpu_blocks=64))
    trace = recorder.finish()
    long = trace.requests["long"]
    assert long.finish_reason == "abort" and len(long.token_times) < 400
    assert all(trace.requests[f"q{i}"].finish_reason == "length" for i in range(3))
    assert trace.counters["leaked_blocks"] == 0  # the cancelled request's blocks went back to the pool
    # closed loop: two in flight; each later request is released when an earlier one ends
    ends = sorted(trace.requests[rid].finished for rid in ("long", "q0", "q1"))
    assert trace.requests["q0"].arrival < ends[0] <= trace.requests["q1"].arrival
    assert ends[1] <= trace.requests["q2"].arrival
