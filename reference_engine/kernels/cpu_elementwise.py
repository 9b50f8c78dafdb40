"""Fused RMSNorm, SwiGLU and RoPE for the CPU (``elementwise_backend="cpp"``): ``csrc/fused_elementwise.cpp``,
built on first use like the attention kernel (:mod:`reference_engine.kernels.cpu_build`).

Why it exists: with the matmuls packed, a long bfloat16 prefill spends a large share of its step in the
elementwise layers (the profile: docs/journal/reference-engine.md, "2026-12-03, night"), because the torch path writes
and re-reads a whole [tokens, hidden] tensor per operation and, in bfloat16, widens every one to float32 and
rounds it back. The kernels do each layer in one pass over its rows with the same float32 math and the same
rounding steps (the C++ file lists them). The torch path in :mod:`reference_engine.model` stays the oracle:
the tests hold the kernels to it, bit for bit for SwiGLU and RoPE and within float32 rounding of the sum of
squares for RMSNorm (``tests/engine/test_cpu_elementwise.py``). Float16 and other devices keep the torch path.

:func:`reference_engine.model.fuse_elementwise` points a loaded model's RMSNorm, RoPE and fused gate/up MLP layers
at these kernels (the model knows its layers; a kernel knows no model); ``elementwise_backend="auto"`` does
that on the CPU when the build works, and says once why not when it does not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from reference_engine.kernels import cpu_build

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "fused_elementwise.cpp"
_PREFIX = "reference_engine_fused_elementwise"
# No -ffast-math: the kernels round where the torch path rounds, and nothing may be contracted or reordered.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)
#: the kernels, built on first use; tests set its ``error`` to play a machine without a compiler
EXTENSION = cpu_build.LazyExtension(_SOURCE, _PREFIX, _CFLAGS, "the fused elementwise kernels")


def why_unavailable(dtype: torch.dtype) -> str:
    """Why the kernels cannot run in ``dtype`` here ("" when they can; builds them on the first call)."""
    if dtype not in DTYPES:
        return f"the fused elementwise kernels take float32 and bfloat16, not {dtype}"
    try:
        EXTENSION.load()
    except RuntimeError as exc:
        return str(exc)
    return ""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ([tokens, hidden], rows contiguous) with ``weight`` ([hidden], x's
    dtype): what :class:`reference_engine.model.RMSNorm` returns. A new contiguous tensor."""
    return (EXTENSION.module or EXTENSION.load()).rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ([tokens, heads, head_dim], each row's heads contiguous: a slice of a fused q/k/v
    product is fine) at ``cos`` and ``sin`` ([tokens, 1, head_dim], contiguous, x's dtype): what
    :meth:`reference_engine.model.RotaryEmbedding.rotate` returns. A new contiguous tensor."""
    return (EXTENSION.module or EXTENSION.load()).rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ([tokens, 2 x intermediate], gate then up, rows contiguous):
    what :class:`reference_engine.model.MLP` computes between its matmuls. A new contiguous tensor."""
    return (EXTENSION.module or EXTENSION.load()).silu_mul(gate_up)

