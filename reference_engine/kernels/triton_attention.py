"""Triton paged attention for the decode group: one query token per sequence, K/V read through the block table.

The torch path in :mod:`reference_engine.attention` gathers every sequence's blocks into a padded
``[B, K, Hkv, D]`` copy before calling SDPA. This kernel reads K and V straight from the paged cache
instead, one tile of keys at a time, and keeps a running (online) softmax, so nothing is copied and
no work is spent on padding. It handles the decode group only; prefills and prefill chunks stay on
the torch path.

What it supports:

- any power-of-two ``block_size`` >= 1 (the key tile is independent of the block size: a tile may span
  many blocks, or a block many tiles), any ``head_dim`` (padded to a power of two >= 16 and masked);
- GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``;
- float32, float16 and bfloat16 caches and queries; K/V are converted to ``q.dtype`` (as the torch path does),
  accumulation is float32, and float32 dots use IEEE precision (not TF32) so that in float32 the kernel
  matches the torch oracle within the tests' 1e-5 (about 1e-7 measured in the interpreter).

One program handles one (sequence, kv head) pair and all the query heads that share that kv head,
as the rows of one ``tl.dot`` (rows padded to 16, the smallest dot Triton allows). Index arithmetic
for one tile of ``BLOCK_N`` keys, with ``block_size = 4`` and ``BLOCK_N = 8``::

    logical key j        0 1 2 3 | 4 5 6 7            j = start + arange(BLOCK_N), masked where j >= seq_len
    j // block_size      0 0 0 0 | 1 1 1 1  -> block_tables[seq, j // block_size] = physical block, e.g. 7 | 2
    j %  block_size      0 1 2 3 | 0 1 2 3  -> slot inside that block
    address of K[j]      kv_cache[block, layer, 0, slot, kv_head, :]     V[j]: the same with 1 for 0

On CPU the kernel runs in Triton's interpreter when ``TRITON_INTERPRET=1`` is set **before triton is
first imported**: Triton decides at decoration time whether a function is compiled or interpreted, and
its own library (``tl.sum``, ``tl.max``) is decorated when ``triton.language`` is imported, so the
variable cannot be switched later in a process (tests use a child process).

Grid: ``(num_seqs, num_kv_heads)``. A long context with a small batch leaves most of a GPU idle;
splitting the keys across programs (flash-decoding) would be the next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux x86_64 dependency only; the torch path works everywhere
    triton = None
    tl = None

DEFAULT_BLOCK_N = 32  # keys per loop iteration; any power of two >= 16


def triton_available(device: torch.device | str) -> bool:
    """True when the kernel can run on ``device``: a CUDA device with triton importable, or a CPU device
    while ``TRITON_INTERPRET=1`` (the interpreter, for tests: correct but slow)."""
    if _MODE not in ("compiled", "interpreted"):
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return _MODE == "compiled" and torch.cuda.is_available()
    return device.type == "cpu" and _MODE == "interpreted"


def why_unavailable(device: torch.device) -> str:
    """Why the kernel cannot run on ``device`` (meaningful where :func:`triton_available` is False)."""
    if _MODE == "no triton":
        return "triton is not importable"
    if _MODE == "mixed":
        return ("TRITON_INTERPRET changed between importing triton and importing this module; "
                "set it before either import")
    if device.type == "cuda":
        if _MODE == "interpreted":
            return "TRITON_INTERPRET=1 is set, and the interpreter runs on CPU tensors only"
        return "torch.cuda.is_available() is False"
    return f"device {device} needs CUDA, or TRITON_INTERPRET=1 set before triton is imported for a CPU device"


def _paged_decode_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale,
    q_stride_seq, q_stride_head,
    out_stride_seq, out_stride_head,
    cache_stride_block, cache_stride_kv, cache_stride_slot, cache_stride_head,
    layer_offset,  # layer * cache_stride_layer, in elements
    table_stride_seq,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (a power of two: // and % are shifts and masks)
    BLOCK_M: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per iteration
    DOT_DTYPE: tl.constexpr,  # operand dtype of both dots: q's dtype (float32 for bfloat16 in the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 operands, so no TF32 rounding
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
                mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]; padded rows are 0, never stored

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp(score - m_i) * V
    k_base = cache_ptr + layer_offset + kv_head * cache_stride_head
    table = block_tables_ptr + seq * table_stride_seq
    for start in range(0, seq_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        # Table entries past the sequence's last block are never read (they may be padding).
        blocks = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slots = keys % BLOCK_SIZE
        k_ptrs = k_base + blocks[:, None] * cache_stride_block + slots[:, None] * cache_stride_slot + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
        v = tl.load(k_ptrs + cache_stride_kv, mask=kv_mask, other=0.0).to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N], float32
        s = tl.where(key_ok[None, :], s, float("-inf"))
        # The first tile always holds key 0 (seq_len >= 1), so m_new is finite from then on and
        # exp(-inf - m_new) = 0 wipes the empty initial state.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _jit_mode() -> tuple[str, Callable[..., Any] | None]:
    """Jit the kernel and say how it runs: "compiled", "interpreted", "no triton", or "mixed" when the kernel
    and triton's own library were decorated in different modes (the interpreter cannot call a compiled
    ``tl.sum``, nor the compiler an interpreted one)."""
    if triton is None:
        return "no triton", None
    from triton.runtime.interpreter import InterpretedFunction

    kernel = triton.jit(_paged_decode_kernel)
    interpreted = isinstance(kernel, InterpretedFunction)
    if interpreted != isinstance(tl.sum, InterpretedFunction):
        return "mixed", kernel
    return ("interpreted" if interpreted else "compiled"), kernel


_MODE, _KERNEL = _jit_mode()
_TL_DTYPES = {} if tl is None else {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, *,
                           block_n: int = DEFAULT_BLOCK_N) -> torch.Tensor:
    """Attention of one new query per sequence over that sequence's keys in the paged cache.

    Args:
        q: ``[B, Hq, D]``, the query of the token at position ``seq_lens[b] - 1`` of sequence ``b``.
            Its own K/V must already be in the cache (``paged_attention`` writes them first).
        kv_cache: ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (index 0 = K, 1 = V), float32,
            float16 or bfloat16, last dim contiguous; ``block_size`` a power of two; ``Hq % Hkv == 0``.
        layer: which layer's K/V to read.
        block_tables: ``[B, max_blocks]`` int32 or int64 physical block ids. Row ``b`` must hold valid
            ids for its first ``ceil(seq_lens[b] / block_size)`` entries (not checked: that would cost
            a device sync per layer); later entries are never read.
        seq_lens: ``[B]`` int32 or int64, each >= 1: the number of keys, including the new token.
        scale: score scale, default ``1 / sqrt(D)`` (what SDPA uses).
        block_n: keys per loop iteration, a power of two >= 16 (a tuning knob; results do not depend on it
            beyond float rounding).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``. K/V are converted to ``q.dtype`` before each dot, as the torch path
        does; scores, softmax and the weighted sum accumulate in float32.
    """
    _check_inputs(q, kv_cache, layer, block_tables, seq_lens, block_n)
    if not triton_available(q.device):
        raise RuntimeError(f"paged_decode_attention cannot run here: {why_unavailable(q.device)}; "
                           "use reference_engine.attention.paged_attention (the torch path)")
    num_seqs, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    cache_stride = kv_cache.stride()
    # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584, "not supported
    # yet"), so there the dots run in float32; compiled kernels use bfloat16 tensor cores.
    dot_dtype = torch.float32 if q.dtype == torch.bfloat16 and _MODE == "interpreted" else q.dtype
    _KERNEL[(num_seqs, num_kv_heads)](
        out, q, kv_cache, block_tables, seq_lens,
        float(scale),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        cache_stride[0], cache_stride[2], cache_stride[3], cache_stride[4],
        layer * cache_stride[1],
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        DOT_DTYPE=_TL_DTYPES[dot_dtype],
        DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",  # tf32 is the default; moot for 16-bit
    )
    return out


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, block_n: int) -> None:
    """Shape, dtype and device checks that need no device sync; each error names the argument."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError("kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    _, num_layers, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q num_heads {num_heads} is not a multiple of kv_cache num_kv_heads {num_kv_heads}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"kv_cache block_size {block_size} must be a power of two >= 1")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is out of range for a cache of {num_layers} layers")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two >= 16")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} dtype {t.dtype} is not supported: expected float32, float16 or bfloat16")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} dtype {t.dtype} is not supported: expected int32 or int64")
    devices = {t.device for t in (q, kv_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError("q, kv_cache, block_tables and seq_lens must share one device, "
                         f"got {sorted(map(str, devices))}")
