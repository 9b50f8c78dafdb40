"""The Triton decode kernel against the torch path (the oracle) and a float64 dense reference.

On CPU the kernel runs in Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton is first imported: triton decorates its own library functions at import. The pytest
process may have imported triton already (and must keep compiled kernels for the ``gpu`` tests), so the
interpreted runs happen in one spawned child process started with the variable set; the parent asserts.
The interpreter is slow: sizes here are small (head_dim 16, a few sequences of < 80 tokens).

Every case scatters each sequence's blocks over a shuffled pool, pads the block tables with random
valid block ids (which must be ignored) and uses lengths that are not multiples of the block size.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable here (it is a Linux x86_64 dependency)")

from reference_engine.attention import AttentionMetadata, build_group, paged_attention
from reference_engine.kernels import triton_attention
from reference_engine.kernels.backends import resolve_backend
from reference_engine.kernels.triton_attention import (
    paged_decode_attention,
    triton_available,
)

SEQ_LENS = [1, 7, 33, 70]  # one key only; a partial block; just past a tile of 32; several tiles
NUM_LAYERS = 2
LAYER = 1  # not 0, so a wrong layer offset shows
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def interpreter() -> Iterator[Callable[..., Any]]:
    """``run(fn, *args)``: call a function of this module in a child process whose triton is interpreted."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        mode = pool.submit(_kernel_mode).result()  # the child starts here, with the variable set
    try:
        assert mode == "interpreted", f"the child process's kernel is {mode}, not interpreted"
        yield lambda fn, *args, **kwargs: pool.submit(fn, *args, **kwargs).result()
    finally:
        pool.shutdown()


def _kernel_mode() -> str:
    return triton_attention._MODE


class DecodeCase:
    """A paged cache holding ``seq_lens[b] - 1`` keys per sequence, plus the new token's q, k, v."""

    def __init__(self, seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.seq_lens = torch.tensor(seq_lens)
        blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_needed) + 3  # spare blocks: only ever reached through padding
        shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=g).to(dtype)
        # Shuffled physical ids, so a sequence's blocks are neither contiguous nor in order; one spare
        # column of padding filled with random valid ids.
        physical = torch.randperm(num_blocks, generator=g).tolist()
        self.block_tables = torch.randint(0, num_blocks, (len(seq_lens), max(blocks_needed) + 1), generator=g)
        for b, n in enumerate(blocks_needed):
            self.block_tables[b, :n] = torch.tensor(physical[:n])
            physical = physical[n:]
        self.q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)  # [B, Hq, D]
        self.k = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g).to(dtype)  # [B, Hkv, D]
        self.v = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=g).to(dtype)
        for name in ("seq_lens", "kv_cache", "block_tables", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))

    def torch_path(self) -> torch.Tensor:
        """The torch path's decode output; as in the engine, it writes the new tokens' K/V into the cache."""
        batch = len(self.seq_lens)
        last = self.seq_lens - 1
        rows = torch.arange(batch, device=self.q.device)
        meta = AttentionMetadata(
            slot_blocks=self.block_tables[rows, last // self.block_size], slot_offsets=last % self.block_size,
            groups=[build_group(rows.view(-1, 1), last.view(-1, 1), torch.ones(batch, 1, dtype=torch.bool,
                                device=self.q.device), self.block_tables, self.block_size)])
        return paged_attention(self.q, self.k, self.v, self.kv_cache, LAYER, meta)

    def kernel(self, **kwargs) -> torch.Tensor:
        return paged_decode_attention(self.q, self.kv_cache, LAYER, self.block_tables, self.seq_lens, **kwargs)

    def dense_reference(self) -> torch.Tensor:
        """Float64 softmax attention over each sequence's keys, gathered one position at a time."""
        num_heads, num_kv_heads = self.q.shape[1], self.kv_cache.shape[4]
        outs = []
        for b, n in enumerate(self.seq_lens.tolist()):
            j = torch.arange(n, device=self.q.device)
            blocks, slots = self.block_tables[b, j // self.block_size], j % self.block_size
            keys = self.kv_cache[blocks, LAYER, 0, slots].double()  # [n, Hkv, D]
            values = self.kv_cache[blocks, LAYER, 1, slots].double()
            # Query head h reads kv head h // group: repeat each kv head group times, in order.
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, Hq, D]
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.einsum("hd,nhd->hn", self.q[b].double(), keys) / math.sqrt(self.q.shape[-1])
            outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
        return torch.stack(outs)


def _decode_results(seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int = 16,
                    dtype: torch.dtype = torch.float32, seed: int = 0, cache_dtype: torch.dtype | None = None,
                    poison: bool = False, **kernel_kwargs: Any) -> dict[str, torch.Tensor]:
    """(In the child.) Build a case and return the kernel's output, the torch path's and the dense reference.

    ``poison``: fill every cache slot the kernel must not read with NaN (the spare blocks the padding points at
    and the slots past each sequence's end). The torch path reads those slots and masks the scores, and
    0 * NaN in its weighted sum is NaN, so it is skipped then.
    """
    case = DecodeCase(seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed)
    if cache_dtype is not None:
        case.kv_cache, case.k, case.v = case.kv_cache.to(cache_dtype), case.k.to(cache_dtype), case.v.to(cache_dtype)
    results = {}
    if poison:
        j_all = [torch.arange(n) for n in seq_lens]
        for b, j in enumerate(j_all):  # write the new tokens' K/V as the torch path would
            blocks, slots = case.block_tables[b, j[-1] // block_size], j[-1] % block_size
            case.kv_cache[blocks, LAYER, 0, slots], case.kv_cache[blocks, LAYER, 1, slots] = case.k[b], case.v[b]
        keep = torch.zeros(case.kv_cache.shape[0], block_size, dtype=torch.bool)  # [num_blocks, block_size]
        for b, j in enumerate(j_all):
            keep[case.block_tables[b, j // block_size], j % block_size] = True
        case.kv_cache.masked_fill_(~keep.view(keep.shape[0], 1, 1, block_size, 1, 1), float("nan"))
    else:
        results["torch"] = case.torch_path()  # also writes the new tokens' K/V into the cache
    results["kernel"] = case.kernel(**kernel_kwargs)
    results["dense"] = case.dense_reference()
    return results


def _engine_outputs(model_dir: str) -> dict[str, Any]:
    """(In the child.) Greedy outputs per backend, and how many times the triton backend called the kernel."""
    from reference_engine import EngineConfig, LLMEngine, SamplingParams

    calls = []
    kernel = triton_attention.paged_decode_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    triton_attention.paged_decode_attention = counting
    try:
        prompts = [[5, 6, 7], [9] * 11, list(range(3, 20))]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        outputs = {}
        for backend in ("torch", "triton"):
            engine = LLMEngine(EngineConfig(model=model_dir, block_size=4, num_gpu_blocks_override=32,
                                            attention_backend=backend))
            outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        triton_attention.paged_decode_attention = kernel
    return {"outputs": outputs, "kernel_calls": len(calls)}


def _assert_matches(results: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    got = results["kernel"]
    assert not got.isnan().any()
    if "torch" in results:
        assert got.shape == results["torch"].shape and got.dtype == results["torch"].dtype
        torch.testing.assert_close(got, results["torch"], atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), results["dense"], atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_decode_matches_torch_path_and_dense(interpreter, block_size: int, num_heads: int,
                                             num_kv_heads: int) -> None:
    _assert_matches(interpreter(_decode_results, SEQ_LENS, block_size, num_heads, num_kv_heads,
                                seed=block_size + num_heads))


@pytest.mark.parametrize("block_n", [16, 64])
def test_tile_width_does_not_change_the_result(interpreter, block_n: int) -> None:
    # block_size 32: a 16-key tile covers half a block, a 64-key tile spans two blocks.
    _assert_matches(interpreter(_decode_results, [5, 40, 77], 32, 4, 1, seed=7, block_n=block_n))


def test_head_dim_not_a_power_of_two(interpreter) -> None:
    _assert_matches(interpreter(_decode_results, [3, 19, 50], 8, 4, 1, head_dim=24, seed=3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision(interpreter, dtype: torch.dtype) -> None:
    results = interpreter(_decode_results, SEQ_LENS, 16, 4, 2, dtype=dtype, seed=5)
    assert results["kernel"].dtype == dtype
    _assert_matches(results, TOLERANCE[dtype])


def test_float16_cache_with_float32_queries(interpreter) -> None:
    # Both paths convert the cache to q's dtype, so they agree to float32 rounding.
    _assert_matches(interpreter(_decode_results, SEQ_LENS, 4, 4, 2, seed=6, cache_dtype=torch.float16))


def test_never_reads_past_a_sequence_or_through_padding(interpreter) -> None:
    _assert_matches(interpreter(_decode_results, [2, 13, 30], 8, 4, 2, seed=11, poison=True))


def test_engine_outputs_equal_across_backends(interpreter, tiny_ckpt: str) -> None:
    """Greedy outputs with the triton decode path == the torch path, and the kernel really ran."""
    from reference_engine import EngineConfig

    if "attention_backend" not in {f.name for f in fields(EngineConfig)}:
        pytest.skip("EngineConfig has no attention_backend field yet (the wiring is not applied)")
    result = interpreter(_engine_outputs, tiny_ckpt)
    assert result["outputs"]["triton"] == result["outputs"]["torch"]
    assert result["kernel_calls"] > 0, "the triton backend never called the decode kernel"


@pytest.mark.parametrize(("change", "message"), [
    ({"q": torch.zeros(2, 3, 16)}, "not a multiple"),
    ({"q": torch.zeros(2, 4, 8)}, "head_dim"),
    ({"layer": 1}, "layer 1 is out of range"),
    ({"seq_lens": torch.ones(3, dtype=torch.long)}, "seq_lens must be"),
    ({"block_tables": torch.zeros(2, 1)}, "block_tables dtype"),
    ({"block_n": 8}, "block_n 8"),
])
def test_bad_arguments_are_named(change: dict, message: str) -> None:
    args = {"q": torch.zeros(2, 4, 16), "kv_cache": torch.zeros(4, 1, 2, 4, 2, 16), "layer": 0,
            "block_tables": torch.zeros(2, 1, dtype=torch.long), "seq_lens": torch.ones(2, dtype=torch.long)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def _availability() -> tuple[bool, str, str]:
    cpu = torch.device("cpu")
    return (triton_available("cpu"), resolve_backend("attention_backend", "triton", cpu, torch.float32),
            resolve_backend("attention_backend", "auto", cpu, torch.float32))


def test_availability_follows_the_interpreter(interpreter) -> None:
    # The interpreter is usable on CPU when asked for, never picked by "auto".
    available, asked, auto = interpreter(_availability)
    assert (available, asked) == (True, "triton") and auto in ("cpp", "sliced")  # auto on CPU: the CPU paths
    if triton_attention._MODE == "compiled":  # this process: compiled kernels, so no CPU
        assert not triton_available("cpu")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_backend("attention_backend", "triton", torch.device("cpu"), torch.float32)
        with pytest.raises(RuntimeError, match="cannot run here"):
            paged_decode_attention(torch.zeros(1, 2, 16), torch.zeros(1, 1, 2, 4, 2, 16), 0,
                                   torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        resolve_backend("attention_backend", "flash", torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_on_cuda(dtype: torch.dtype, block_size: int) -> None:
    """Compiled, on a real GPU, at realistic sizes (head_dim 128, GQA 4, contexts up to ~1000 tokens)."""
    if not triton_available("cuda"):
        pytest.skip(f"triton cannot compile for CUDA in this process (kernel mode: {triton_attention._MODE})")
    case = DecodeCase([1, 15, 200, 513, 1000, 37], block_size, num_heads=16, num_kv_heads=4, head_dim=128,
                      dtype=dtype, seed=block_size, device="cuda")
    expected = case.torch_path()
    got = case.kernel()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), case.dense_reference(), atol=tol, rtol=tol)
