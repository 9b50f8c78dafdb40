"""The sliced decode attention (``attention_backend="sliced"``) against the torch path,
the oracle: the same outputs for any block size, GQA grouping, uneven lengths, scattered block ids and
slice size, and token-equal greedy outputs from the engine."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine import attention as attention_module
from reference_engine.attention import AttentionMetadata, build_group, paged_attention, sliced_decode_attention

LAYER, NUM_LAYERS = 1, 2


def _case(seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int = 16,
          dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """A paged cache holding each sequence's earlier keys, its new token's q/k/v, shuffled block ids and
    a spare column of padding pointing at random blocks."""
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    cache = torch.randn((num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), generator=g).to(dtype)
    physical = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(needed) + 1), generator=g)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor(physical[:n])
        physical = physical[n:]
    batch = len(seq_lens)
    return {"q": torch.randn(batch, num_heads, head_dim, generator=g).to(dtype),
            "k": torch.randn(batch, num_kv_heads, head_dim, generator=g).to(dtype),
            "v": torch.randn(batch, num_kv_heads, head_dim, generator=g).to(dtype),
            "kv_cache": cache, "block_tables": tables, "seq_lens": torch.tensor(seq_lens), "block_size": block_size}


def _run(case: dict, backend: str, **kwargs) -> torch.Tensor:
    """``paged_attention`` on the case's decode step with ``backend`` (it writes the new K/V first)."""
    batch = len(case["seq_lens"])
    last = case["seq_lens"] - 1
    rows = torch.arange(batch)
    meta = AttentionMetadata(
        slot_blocks=case["block_tables"][rows, last // case["block_size"]],
        slot_offsets=last % case["block_size"],
        groups=[build_group(rows.view(-1, 1), last.view(-1, 1), torch.ones(batch, 1, dtype=torch.bool),
                            case["block_tables"], case["block_size"])],
        backend=backend)
    return paged_attention(case["q"], case["k"], case["v"], case["kv_cache"].clone(), LAYER, meta)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_sliced_equals_the_torch_path(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    case = _case([1, 5, 17, 33, 64, 9, 2], block_size, num_heads, num_kv_heads)
    torch.testing.assert_close(_run(case, "sliced"), _run(case, "torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sequences", [1, 3, 7], ids=["one-sequence", "three-with-a-remainder", "all-at-once"])
def test_slice_size_does_not_change_the_result(sequences: int) -> None:
    """Slices of one sequence, of three (7 = 3 + 3 + 1) and of the whole batch give the torch path's result."""
    case = _case([3, 12, 40, 7, 25, 1, 30], 4, 4, 2)
    per_sequence = 2 * case["block_tables"].shape[1] * 4 * 2 * 16 * 4  # K and V: blocks x [4, 2, 16] float32
    slice_bytes = sequences * per_sequence
    expected = _run(case, "torch")
    cache = case["kv_cache"].clone()
    last = case["seq_lens"] - 1  # the new tokens' K/V written, as paged_attention does first
    blocks, offsets = case["block_tables"][torch.arange(len(last)), last // 4], last % 4
    cache[blocks, LAYER, 0, offsets], cache[blocks, LAYER, 1, offsets] = case["k"], case["v"]
    got = sliced_decode_attention(case["q"], cache, LAYER, case["block_tables"], case["seq_lens"],
                                  slice_bytes=slice_bytes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_stays_close_to_the_torch_path() -> None:
    case = _case([6, 31, 50], 16, 8, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(_run(case, "sliced").float(), _run(case, "torch").float(), atol=2e-2, rtol=2e-2)


def test_a_wrong_slice_would_be_seen() -> None:
    """The comparison can fail: a sliced path that forgets the mask (reads the padding) differs."""
    case = _case([2, 30], 4, 4, 2)
    wrong = {**case, "seq_lens": torch.tensor([8, 32])}  # the same tables read 6 and 2 keys too far
    assert not torch.allclose(_run(wrong, "sliced")[0], _run(case, "torch")[0], atol=1e-3)


def test_engine_greedy_outputs_are_token_equal_and_sliced_really_ran(monkeypatch) -> None:
    """Prompts of uneven lengths at block size 4 under a pool small enough to preempt: every output of
    the sliced backend equals the torch path's, and the sliced function ran (only) when asked for."""
    model = str(builtin_checkpoint("tiny"))
    calls = []
    real = attention_module.sliced_decode_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_module, "sliced_decode_attention", counting)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 40, 13, 77, 2, 29)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "sliced"):
        engine = LLMEngine(EngineConfig(model=model, block_size=4, num_gpu_blocks_override=40,
                                        attention_backend=backend))
        assert engine.attention_backend == backend
        runs = len(calls)
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (len(calls) > runs) == (backend == "sliced")
        assert engine.counters().preemptions > 0  # the comparison covers recomputed sequences
    assert outputs["sliced"] == outputs["torch"]
    auto = LLMEngine(EngineConfig(model=model, num_gpu_blocks_override=8)).attention_backend
    assert auto in ("cpp", "sliced")  # auto on CPU: the compiled kernel, or sliced where it cannot be built
