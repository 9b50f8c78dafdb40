"""The reference engine against its dense bounds, through pytest-benchmark's ``benchmark`` fixture.

What is measured, each variant side by side in one test:

1. **A decode step, paged vs dense**: one batch decode step (every request decoding its next token) on
   the paged KV cache, with each decode attention path (``torch``, the oracle; ``sliced``; ``cpp``
   where the C++ kernel builds), against the same model's weights on a dense (contiguous, non-paged)
   ``[batch, tokens, heads, dim]`` cache through ``scaled_dot_product_attention``: the bound that
   paging costs are measured from. The other paths' greedy tokens must equal the torch path's.
2. **Recompute saved by prefix caching**: one overloaded workload (measured: 32 requests of up to 300
   prompt tokens on a 40-block pool; smoke: 12 of up to 120 on 12 blocks) with and without prefix
   caching; the engine's own counters (recomputed, computed tokens, preemptions) are the figures, and
   caching must recompute fewer tokens.
3. **reference vs Hugging Face generate**: one uniform batch (every prompt the same length, so
   transformers needs no padding: its dense upper bound), greedy, EOS ignored, the reference engine in
   process with each decode attention path against ``generate`` on the batch as one tensor; the
   outputs must be token-equal.

On a shared machine times move by 2x between rounds, so the variants of a test run back to back in one
round, in an order rotating from round to round, and the ratios are taken within a round: each
test's ``extra_info`` (``--benchmark-json``) holds every variant's median and each ratio as
``median [min-max]`` over the rounds; pytest-benchmark's own figures are those of a whole round.

Sizes follow ``test_micro.py``'s rule: a smoke run by default (the tiny model, a few requests, two
rounds: a plain ``pytest suites/`` checks that every variant runs and agrees); measured sizes with
``--benchmark`` or any of pytest-benchmark's measuring options (``--benchmark-json``...): a batch-64
decode step of the ``small`` preset at 256 tokens of context, ``max(20, --benchmark-min-rounds)``
rounds; 64 prompts of 128 tokens + 64 output tokens for ``generate`` (the ``tiny`` model, ``small``
at ``--benchmark-scale full``), ``max(5, --benchmark-min-rounds)`` rounds. torch's threads follow
the benchmarks' policy (``KVBENCH_TORCH_THREADS``, else 1 on CPU)::

    pytest suites/benchmarks/test_dense_bounds.py --benchmark --benchmark-json bounds.json
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvbench.bench.formatting import fmt_median_range
from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from suites.benchmarks.test_micro import measuring

#: rounds of a measured run (at least; ``--benchmark-min-rounds`` raises them) and of a smoke run
MEASURED_DECODE_ROUNDS, MEASURED_GENERATE_ROUNDS, SMOKE_ROUNDS = 20, 5, 2


@dataclass(frozen=True)
class DecodeSize:
    model: str
    batch: int
    context: int


@dataclass(frozen=True)
class GenerateSize:
    model: str
    batch: int
    prompt: int
    output: int


def _rounds(config: pytest.Config, measured: int) -> int:
    if not measuring(config):
        return SMOKE_ROUNDS
    return max(measured, int(config.getoption("benchmark_min_rounds", 0) or 0))


def decode_backends() -> list[str]:
    """The decode attention paths to compare: torch (the oracle, first), sliced, and cpp where it builds."""
    from reference_engine.kernels.cpu_attention import cpu_kernel_available

    return ["torch", "sliced"] + (["cpp"] if cpu_kernel_available() else [])


def interleaved(benchmark: Any, fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each function once per round after one warm-up each, the order rotating from round to round,
    a round timed by ``benchmark``: ``{name: [seconds per round]}``, so that ratios are taken within a round."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    counter = itertools.count()

    def one_round() -> None:
        r = next(counter) % len(names)
        for name in names[r:] + names[:r]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    return times


def ratios(a: list[float], b: list[float]) -> str:
    """The round-by-round ratios a/b as ``median [min-max]``."""
    return fmt_median_range([x / y for x, y in zip(a, b, strict=True)], "{:.2f}x")


def _record(benchmark: Any, times: dict[str, list[float]], ratio_texts: dict[str, str], **info: Any) -> None:
    benchmark.extra_info.update({f"{name} median ms": 1e3 * statistics.median(t) for name, t in times.items()})
    benchmark.extra_info.update(ratio_texts, **info, rounds=len(next(iter(times.values()))))


# --------------------------------------------------------------------------------------------
# 1. a decode step, paged vs dense


@pytest.fixture
def decode_size(request: pytest.FixtureRequest) -> DecodeSize:
    return DecodeSize("small", 64, 256) if measuring(request.config) else DecodeSize("tiny", 4, 32)


def test_decode_step_paged_vs_dense(benchmark, decode_size, pinned_threads, request):
    with torch.inference_mode():  # no autograd bookkeeping in any variant
        _decode_step_paged_vs_dense(benchmark, decode_size, pinned_threads,
                                    _rounds(request.config, MEASURED_DECODE_ROUNDS))


def _decode_step_paged_vs_dense(benchmark: Any, size: DecodeSize, threads: int, rounds: int) -> None:
    batch, context = size.batch, size.context
    engine = LLMEngine(EngineConfig(model=str(builtin_checkpoint(size.model)), max_num_seqs=batch,
                                    num_gpu_blocks_override=batch * (context // 16 + 2)))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=16, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                          for r in engine.scheduler.running):
        engine.step()
    out = engine.scheduler.schedule()  # the decode step of the whole batch, without running it
    assert len(out.chunks) == batch and all(c.num_tokens == 1 for c in out.chunks)
    model, cache = engine.model, engine.kv_cache.device_cache

    def paged(backend: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            engine.runner.attention_backend = backend
            ids, pos, meta, last = engine.runner.prepare(out.chunks)
            return model.compute_logits(model(ids, pos, cache, meta)[last])
        return run

    # The dense bound: the same weights, each sequence's K/V in one contiguous [B, T, H, D] tensor.
    mc = model.config
    hq, hkv, d = mc.num_heads, mc.num_kv_heads, mc.head_dim
    dense_k = [torch.randn(batch, context + 1, hkv, d) for _ in range(mc.num_layers)]
    dense_v = [torch.randn(batch, context + 1, hkv, d) for _ in range(mc.num_layers)]
    positions = torch.full((batch,), context, dtype=torch.long)
    tokens = torch.randint(3, vocab, (batch,), generator=g)

    def dense() -> torch.Tensor:
        x = model.model.embed_tokens(tokens)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            # the same fused q/k/v matmul and single RoPE call as the paged model: only the cache differs
            qkv = attn.qkv(layer.input_layernorm(x))
            qk = attn.rope(qkv[:, : (hq + hkv) * d].view(batch, hq + hkv, d), positions)
            dense_k[i][:, context] = qk[:, hq:]
            dense_v[i][:, context] = qkv[:, (hq + hkv) * d :].view(batch, hkv, d)
            o = F.scaled_dot_product_attention(qk[:, :hq].unsqueeze(2), dense_k[i].transpose(1, 2),
                                               dense_v[i].transpose(1, 2), enable_gqa=True)
            x = x + attn.o_proj(o.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.compute_logits(model.model.norm(x))

    backends = decode_backends()
    oracle = paged("torch")()
    agreement = {}
    for backend in backends[1:]:
        logits = paged(backend)()
        agreement[f"{backend} vs torch max |logit diff|"] = (oracle - logits).abs().max().item()
        assert torch.equal(oracle.argmax(-1), logits.argmax(-1)), f"{backend}'s greedy tokens differ from torch's"
    times = interleaved(benchmark, {**{f"paged {b}": paged(b) for b in backends}, "dense": dense},
                        rounds)
    _record(benchmark, times, {f"{b} / dense": ratios(times[f"paged {b}"], times["dense"]) for b in backends},
            model=size.model, batch=batch, context=context, threads=threads, **agreement)


# --------------------------------------------------------------------------------------------
# 2. recompute saved by prefix caching


@dataclass(frozen=True)
class OverloadSize:
    requests: int
    max_prompt: int
    max_output: int
    blocks: int


@pytest.fixture
def overload_size(request: pytest.FixtureRequest) -> OverloadSize:
    return OverloadSize(32, 300, 100, 40) if measuring(request.config) else OverloadSize(12, 120, 40, 12)


def test_prefix_caching_saves_recompute(benchmark, overload_size):
    """Counts, not times: the same overloaded workload with prefix caching off and on."""
    size = overload_size
    ckpt = str(builtin_checkpoint("tiny"))
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, size.max_prompt + 1, (size.requests,), generator=g)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(1, size.max_output + 1, (size.requests,), generator=g)]
    counters = {}

    def serve_both() -> None:
        for caching in (False, True):
            engine = LLMEngine(EngineConfig(model=ckpt, num_gpu_blocks_override=size.blocks,
                                            enable_prefix_caching=caching))
            engine.generate(prompts, params)
            counters[caching] = engine.counters()

    benchmark.pedantic(serve_both, rounds=1, iterations=1)
    off, on = counters[False], counters[True]
    benchmark.extra_info.update({f"{key} ({label})": getattr(c, key) for label, c in (("off", off), ("on", on))
                                 for key in ("recomputed_tokens", "computed_tokens", "preemptions")})
    assert off.preemptions > 0 and on.preemptions > 0, f"the workload must overload the {size.blocks}-block pool"
    assert on.recomputed_tokens < off.recomputed_tokens
    assert on.computed_tokens < off.computed_tokens


# --------------------------------------------------------------------------------------------
# 3. reference vs Hugging Face generate


@pytest.fixture
def generate_size(request: pytest.FixtureRequest, kvbench_session: Any) -> GenerateSize:
    if not measuring(request.config):
        return GenerateSize("tiny", 4, 16, 8)
    return GenerateSize("small" if kvbench_session.scale == "full" else "tiny", 64, 128, 64)


def test_reference_vs_hf_generate(benchmark, generate_size, pinned_threads, request):
    from transformers import LlamaForCausalLM

    size = generate_size
    ckpt = str(builtin_checkpoint(size.model))
    prompts = torch.randint(3, 500, (size.batch, size.prompt), generator=torch.Generator().manual_seed(0))
    blocks = size.batch * ((size.prompt + size.output) // 16 + 2)
    backends = decode_backends()
    engines = {b: LLMEngine(EngineConfig(model=ckpt, num_gpu_blocks_override=blocks, max_num_seqs=size.batch,
                                         max_num_batched_tokens=max(size.batch * size.prompt, 2048),
                                         attention_backend=b)) for b in backends}
    hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, use_safetensors=True).eval()
    params = SamplingParams(max_tokens=size.output, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}

    def reference(backend: str) -> Callable[[], None]:
        def run() -> None:
            outputs[backend] = [o.token_ids for o in engines[backend].generate(prompts.tolist(), params)]
        return run

    @torch.inference_mode()
    def transformers_generate() -> None:
        seqs = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=size.output,
                           min_new_tokens=size.output, do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs["hf"] = seqs[:, size.prompt:].tolist()

    times = interleaved(benchmark, {**{f"reference {b}": reference(b) for b in backends},
                                    "hf generate": transformers_generate},
                        _rounds(request.config, MEASURED_GENERATE_ROUNDS))
    tokens = size.batch * size.output
    _record(benchmark, times,
            {f"reference {b} / hf throughput": ratios(times["hf generate"], times[f"reference {b}"]) for b in backends},
            **{f"{name} median tok/s": tokens / statistics.median(t) for name, t in times.items()},
            model=size.model, batch=size.batch, prompt=size.prompt, output=size.output, threads=pinned_threads)
    for backend in backends:
        assert outputs[backend] == outputs["hf"], f"reference ({backend}) and hf generate disagree"
