"""Token-exact greedy outputs under every kind of pressure, against transformers' greedy generate.

Every test asserts that the mechanism it is about actually fired: a test that passes because
nothing was preempted, swapped, chunked or cached would prove nothing.
"""

from __future__ import annotations

import pytest
import torch

from reference_engine import SamplingParams
from tests.conftest import greedy_params

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]

# name -> (engine overrides, {counter: minimum value} proving the mechanism fired)
PRESSURE = {
    "unpressured": (dict(num_gpu_blocks_override=2048), {}),
    "recompute": (dict(num_gpu_blocks_override=40), {"preemptions_recompute": 3}),
    "chunked16": (dict(num_gpu_blocks_override=2048, enable_chunked_prefill=True, max_num_batched_tokens=16),
                  {"prefill_chunks": 2}),
    "chunked64": (dict(num_gpu_blocks_override=2048, enable_chunked_prefill=True, max_num_batched_tokens=64),
                  {"prefill_chunks": 2}),
    "recompute+chunked64": (dict(num_gpu_blocks_override=48, enable_chunked_prefill=True, max_num_batched_tokens=64),
                            {"preemptions_recompute": 3, "prefill_chunks": 2}),
    "swap": (dict(num_gpu_blocks_override=40, preemption_mode="swap"),
             {"preemptions_swap": 3, "swap_ins": 3}),
    "prefix": (dict(num_gpu_blocks_override=40, enable_prefix_caching=True),
               {"preemptions_recompute": 3, "prefix_cache_hits": 1}),
    "swap+prefix+chunked": (dict(num_gpu_blocks_override=48, preemption_mode="swap", enable_prefix_caching=True,
                                 enable_chunked_prefill=True, max_num_batched_tokens=64),
                            {"preemptions_swap": 3, "swap_ins": 3, "prefill_chunks": 2}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(PRESSURE))
def test_greedy_outputs_equal_transformers(case, device, make_engine, workload, hf_greedy):
    overrides, fired = PRESSURE[case]
    engine = make_engine(device=device, **overrides)
    prompts, max_tokens = workload
    outputs = engine.generate(prompts, greedy_params(max_tokens))
    counters = engine.counters()
    for counter, minimum in fired.items():
        value = getattr(counters, counter)
        assert value >= minimum, f"{case}: {counter}={value}, the mechanism did not fire"
    if case == "unpressured":
        assert counters.preemptions == 0
    mismatched = [i for i, (o, ref) in enumerate(zip(outputs, hf_greedy, strict=True)) if o.token_ids != ref]
    assert not mismatched, f"{case}: {len(mismatched)} requests differ from transformers, first {mismatched[:5]}"
    assert all(o.finish_reason == "length" for o in outputs)


def test_preempted_requests_report_their_preemptions(make_engine, workload):
    prompts, max_tokens = workload
    engine = make_engine(num_gpu_blocks_override=40)
    outputs = engine.generate(prompts, greedy_params(max_tokens))
    assert sum(o.num_preemptions for o in outputs) == engine.counters().preemptions > 0
    assert sum(o.num_recomputed_tokens for o in outputs) == engine.counters().recomputed_tokens > 0


@pytest.mark.parametrize("block_size", [1, 4, 128])
def test_any_power_of_two_block_size(block_size, make_engine, workload, hf_greedy):
    prompts, max_tokens = workload
    prompts, max_tokens, expected = prompts[:8], [min(m, 12) for m in max_tokens[:8]], hf_greedy[:8]
    # 16 KiB-ish pools at every block size, small enough that block size 4 preempts
    engine = make_engine(block_size=block_size, num_gpu_blocks_override=max(2400 // block_size, 4),
                         enable_chunked_prefill=True, max_num_batched_tokens=96)
    outputs = engine.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == [e[:m] for e, m in zip(expected, max_tokens, strict=True)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_is_reproducible_across_preemption(mode, make_engine, workload):
    prompts, max_tokens = workload
    prompts, max_tokens = prompts[:16], max_tokens[:16]
    params = [SamplingParams(max_tokens=m, temperature=1.0, top_k=50, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    calm = make_engine(num_gpu_blocks_override=2048).generate(prompts, params)
    pressured_engine = make_engine(num_gpu_blocks_override=32, preemption_mode=mode)
    pressured = pressured_engine.generate(prompts, params)
    assert pressured_engine.counters().preemptions > 0
    assert [o.token_ids for o in pressured] == [o.token_ids for o in calm]
    # and the sampler really samples: another seed gives other tokens, greedy gives other tokens
    reseeded = make_engine(num_gpu_blocks_override=2048).generate(
        prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=1.0, top_k=50, top_p=0.95, seed=p.seed + 1,
                                 ignore_eos=True) for p in params])
    assert [o.token_ids for o in reseeded] != [o.token_ids for o in calm]
    greedy = make_engine(num_gpu_blocks_override=2048).generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in greedy] != [o.token_ids for o in calm]


def test_outputs_do_not_depend_on_batch_company(make_engine, workload, hf_greedy):
    """A request alone, and the same request in a reversed batch, get identical tokens."""
    prompts, max_tokens = workload
    engine = make_engine(num_gpu_blocks_override=2048)
    alone = engine.generate([prompts[5]], greedy_params([max_tokens[5]]))[0]
    reversed_outs = engine.generate(prompts[::-1], greedy_params(max_tokens[::-1]))
    assert alone.token_ids == reversed_outs[len(prompts) - 1 - 5].token_ids == hf_greedy[5]


def test_stop_token_and_eos(make_engine, workload, hf_greedy):
    prompts, _ = workload
    engine = make_engine(num_gpu_blocks_override=512)
    expected = hf_greedy[0]
    stop = expected[3]
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=50, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == expected[: expected.index(stop) + 1]


def test_generation_stops_at_max_model_len(make_engine, workload, hf_greedy):
    prompts, _ = workload
    engine = make_engine(num_gpu_blocks_override=512, max_model_len=320)
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=100, ignore_eos=True))[0]  # 300-token prompt
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    assert out.token_ids == hf_greedy[1][:20]


def test_model_logits_match_transformers(tiny_ckpt, make_engine):
    """Prefill logits of a batch of different-length prompts, paged, vs transformers: <= 1e-4."""
    from transformers import LlamaForCausalLM

    from reference_engine.scheduler import ScheduledChunk

    hf = LlamaForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32, use_safetensors=True).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 64, 129, 300)]
    engine = make_engine(num_gpu_blocks_override=128)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    assert len(out.chunks) == 4 and all(isinstance(c, ScheduledChunk) for c in out.chunks)
    with torch.inference_mode():
        input_ids, positions, meta, _ = engine.runner.prepare(out.chunks)
        ours = engine.model.compute_logits(engine.model(input_ids, positions, engine.kv_cache.device_cache, meta))
        row = 0
        for chunk, prompt in zip(out.chunks, prompts, strict=True):
            assert chunk.request.prompt_token_ids == prompt
            theirs = hf(torch.tensor([prompt])).logits[0]
            diff = (ours[row : row + len(prompt)] - theirs).abs().max().item()
            assert diff <= 1e-4, f"prompt of {len(prompt)} tokens: max abs logit difference {diff}"
            row += len(prompt)
    engine.scheduler.update(out, {})  # computed, nothing sampled


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does() -> None:
    """Greedy picks by ``max(dim).indices`` (faster on CPU than ``argmax``); on ties both must give the
    first index of the maximum, or a tie would pick another token than Hugging Face's ``argmax``."""
    from reference_engine.request import Request
    from reference_engine.sampler import sample
    from reference_engine.sampling_params import SamplingParams

    logits = torch.randint(0, 3, (64, 512), generator=torch.Generator().manual_seed(0)).float()  # ties everywhere
    logits[5] = 1.0  # a whole row tied
    requests = [Request(f"r{i}", [1], SamplingParams(max_tokens=1), 0.0) for i in range(64)]
    assert sample(logits, requests, engine_seed=0) == logits.argmax(dim=-1).tolist()
    assert sample(logits, requests, engine_seed=0)[5] == 0
