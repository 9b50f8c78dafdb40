"""The prefill path for whole prefills (``prefill_from_start_attention``: every sequence of the prefill
group starts at position 0, so its keys are its own new tokens) against the torch path, the oracle, on
metadata the model runner builds for real scheduled steps: uneven prompts, GQA, decodes beside them,
float32 and bfloat16. The runner marks a group ``from_start`` only when no chunk continues a cached
prefix, and marking one that does would be seen (its earlier keys would be ignored)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench.checkpoints import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.attention import AttentionMetadata, paged_attention

LAYER = 1


def _engine(**overrides) -> LLMEngine:
    config = {"model": str(builtin_checkpoint("tiny")), "block_size": 4, "num_gpu_blocks_override": 96,
              "attention_backend": "sliced", **overrides}
    return LLMEngine(EngineConfig(**config))


def _add(engine: LLMEngine, lengths: list[int], max_tokens: int = 4) -> None:
    g = torch.Generator().manual_seed(sum(lengths))
    for n in lengths:
        engine.add_request(f"r{len(engine.scheduler.requests)}", torch.randint(3, 500, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _scheduled_meta(engine: LLMEngine) -> tuple[int, AttentionMetadata]:
    """The next step's flat token count and attention metadata, without running the step."""
    out = engine.scheduler.schedule()
    input_ids, _, meta, _ = engine.runner.prepare(out.chunks, out.block_ids)
    return len(input_ids), meta


def _attention(engine: LLMEngine, tokens: int, meta: AttentionMetadata, backend: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``paged_attention`` of one layer for random q/k/v on a copy of the engine's cache (random too)."""
    mc = engine.model.config
    g = torch.Generator().manual_seed(7)
    q = torch.randn(tokens, mc.num_heads, mc.head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, mc.num_kv_heads, mc.head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, mc.num_kv_heads, mc.head_dim, generator=g).to(dtype)
    cache = torch.randn(engine.kv_cache.device_cache.shape, generator=g).to(dtype)
    return paged_attention(q, k, v, cache, LAYER, dataclasses.replace(meta, backend=backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prefills_equal_the_torch_path(dtype: torch.dtype) -> None:
    engine = _engine()
    _add(engine, [5, 17, 3, 12, 1, 8])
    tokens, meta = _scheduled_meta(engine)
    [prefills] = [g for g in meta.groups if g.token_index.shape[1] > 1]
    assert prefills.from_start  # the path under test is the one taken
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(_attention(engine, tokens, meta, "sliced", dtype).float(),
                               _attention(engine, tokens, meta, "torch", dtype).float(), atol=tol, rtol=tol)


def test_whole_prefills_beside_decodes_equal_the_torch_path() -> None:
    engine = _engine()
    _add(engine, [6, 9])
    engine.step()  # both prefilled: they decode in the next step
    _add(engine, [11, 4, 26])
    tokens, meta = _scheduled_meta(engine)
    assert sorted(g.token_index.shape[1] > 1 for g in meta.groups) == [False, True]
    assert [g.from_start for g in meta.groups if g.token_index.shape[1] > 1] == [True]
    torch.testing.assert_close(_attention(engine, tokens, meta, "sliced"), _attention(engine, tokens, meta, "torch"),
                               atol=1e-5, rtol=1e-5)


def test_a_chunk_continuing_its_prompt_is_not_from_start_and_marking_it_so_would_be_seen() -> None:
    first = _engine(enable_chunked_prefill=True, max_num_batched_tokens=8)
    _add(first, [20])
    assert [g.from_start for g in _scheduled_meta(first)[1].groups] == [True]  # positions 0..7
    engine = _engine(enable_chunked_prefill=True, max_num_batched_tokens=8)
    _add(engine, [20])
    engine.step()  # the first chunk: positions 0..7 are cached now
    tokens, meta = _scheduled_meta(engine)
    [chunk] = meta.groups
    assert not chunk.from_start  # positions 8..15 attend to 0..7 in the cache
    expected = _attention(engine, tokens, meta, "torch")
    torch.testing.assert_close(_attention(engine, tokens, meta, "sliced"), expected, atol=1e-5, rtol=1e-5)
    wrong = dataclasses.replace(meta, groups=[dataclasses.replace(chunk, from_start=True)])
    assert not torch.allclose(_attention(engine, tokens, wrong, "sliced"), expected, atol=1e-3)


def test_engine_outputs_are_token_equal_to_the_torch_path() -> None:
    """Greedy outputs with the whole-prefill path (sliced) equal the oracle's (torch), prefix caching
    and a pool small enough to preempt included (recomputed prefills start from 0 again)."""
    outputs = {}
    for backend in ("torch", "sliced"):
        engine = _engine(attention_backend=backend, num_gpu_blocks_override=40, enable_prefix_caching=True)
        g = torch.Generator().manual_seed(3)
        shared = torch.randint(3, 500, (12,), generator=g).tolist()
        prompts = [shared + torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (6, 30, 2, 19, 44, 9)]
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16,
                                                                                       ignore_eos=True))]
        assert engine.counters().preemptions > 0
    assert outputs["sliced"] == outputs["torch"]
