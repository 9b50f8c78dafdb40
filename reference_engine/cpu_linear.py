"""Matmuls with prepacked weights on the CPU (``linear_backend="onednn"``).

Why it exists: on CPU the linear layers are most of a decode step (profiled on ``small`` at batch 64:
70% of the step's torch time in bfloat16, 86% in float32), and ``torch.nn.functional.linear`` hands
oneDNN a plain row-major weight on every call, which it re-lays out into its blocked format each time.
At the small row counts of a decode step that re-layout costs as much as the multiply. oneDNN's own
``linear`` with a weight packed once at load time (the op torch's inductor uses for frozen CPU models,
``torch.ops.mkldnn._linear_pointwise``) skips it: see docs/results.md for what it bought, per dtype.

The contract: :class:`PackedLinear` computes ``x @ W.T + b`` like the :class:`torch.nn.Linear` it wraps,
bit for bit in bfloat16 and float16 (the same oneDNN kernel, the weight only laid out ahead of time)
and within float32 rounding in float32 (the blocked kernel sums in another order); the tests hold it to
``F.linear``. The wrapped layer's parameters stay where they were (state-dict names unchanged, a tied
``lm_head`` still the embedding), and the packed copy is an extra buffer: packing costs one more copy of
each packed weight's memory, which ``linear_backend="torch"`` avoids.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

_log = logging.getLogger(__name__)
_why_not: dict[torch.dtype, str] = {}


def _ops_present() -> str:
    """"" when torch has the oneDNN linear ops, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"torch {torch.__version__} has no torch.ops.mkldnn.{name}"
    return ""


def why_unavailable(dtype: torch.dtype) -> str:
    """Why packed matmuls cannot run in ``dtype`` on this machine ("" when they can).

    Probed once per dtype: a small packed matmul must run and agree with ``F.linear``; bfloat16 and
    float16 also need oneDNN's support for them on this CPU."""
    if dtype in _why_not:
        return _why_not[dtype]
    why = _ops_present()
    if not why and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        why = "oneDNN has no bfloat16 kernels for this CPU"
    if not why and dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        why = "oneDNN has no float16 kernels for this CPU"
    if not why:
        try:
            g = torch.Generator().manual_seed(0)
            weight = torch.randn(48, 32, generator=g).to(dtype)
            x = torch.randn(5, 32, generator=g).to(dtype)
            got = _packed_matmul(x, torch.ops.mkldnn._reorder_linear_weight(weight), None)
            want = nn.functional.linear(x, weight)
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                why = "oneDNN's packed matmul disagreed with torch's on a probe"
        except RuntimeError as exc:
            why = f"oneDNN's packed matmul failed on a probe ({str(exc)[:200]})"
    _why_not[dtype] = why
    return why


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


#: above this many rows (a prefill) the packed kernel no longer wins: within +-10% of ``F.linear``
#: either way on ``small``'s shapes, both dtypes, 1,024-2,048 rows (docs/results.md, "Which rows the
#: packed matmul serves")
PACKED_MAX_ROWS = 512
#: float32 weights with fewer elements are multiplied faster by ``F.linear`` (MKL) at every row count:
#: the tiny preset's 64 x 192 took 2.0x as long packed at 64 rows, 512 x 512 0.97x
PACKED_MIN_FLOAT32_WEIGHT = 1 << 16


def packed_rows(weight: torch.Tensor) -> range:
    """The row counts for which :class:`PackedLinear` calls the packed kernel on ``weight``, the others
    going to ``F.linear`` (measured on this project's machines, see the constants above).

    bfloat16 and float16: 1 to ``PACKED_MAX_ROWS`` (the packed kernel 0.5-0.9x of ``F.linear``'s time on
    decode batches). float32: 2 to ``PACKED_MAX_ROWS`` for weights of at least
    ``PACKED_MIN_FLOAT32_WEIGHT`` elements (0.7-0.95x), none below; one row is faster unpacked (1.2-1.8x)."""
    if weight.dtype != torch.float32:
        return range(1, PACKED_MAX_ROWS + 1)
    if weight.numel() < PACKED_MIN_FLOAT32_WEIGHT:
        return range(0)
    return range(2, PACKED_MAX_ROWS + 1)


class PackedLinear(nn.Module):
    """``linear``, with its weight also held in oneDNN's blocked layout, computed by oneDNN's linear.

    ``weight`` and ``bias`` are the wrapped layer's own parameters (shared, not copied); ``packed`` is a
    non-persistent buffer, so state dicts are those of the unwrapped model."""

    def __init__(self, linear: nn.Linear, rows: range | None = None):
        """``rows``: the row counts that take the packed kernel (default :func:`packed_rows` of the weight);
        the others are ``F.linear`` on the unpacked weight."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.rows = packed_rows(linear.weight) if rows is None else rows
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] not in self.rows:
            return nn.functional.linear(x, self.weight, self.bias)
        # oneDNN reads the rows as one dense matrix: a strided view (a slice of a fused product) is copied
        return _packed_matmul(x if x.is_contiguous() else x.contiguous(), self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed_rows={self.rows.start}..{self.rows.stop - 1}")


def pack_linears(model: nn.Module, rows: range | None = None) -> int:
    """Replace every :class:`torch.nn.Linear` under ``model`` that a forward pass calls with a
    :class:`PackedLinear` of it, in place; returns how many were packed.

    ``rows`` is passed to each :class:`PackedLinear` (default: :func:`packed_rows` of its weight). Left
    alone: linears that no row count would send to the packed kernel (no packed copy in memory for
    them), and linears that forward passes do not call: a layer's unfused ``q_proj``/``gate_proj``
    etc. (views of the fused weight, kept for the state dict) when :meth:`fuse_projections` has run."""
    skip: set[int] = set()
    for module in model.modules():  # the parts a fused projection replaced
        if getattr(module, "qkv", None) is not None:
            skip.update(id(getattr(module, n)) for n in ("q_proj", "k_proj", "v_proj"))
        if getattr(module, "gate_up", None) is not None:
            skip.update(id(getattr(module, n)) for n in ("gate_proj", "up_proj"))
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in skip:
                continue
            child_rows = packed_rows(child.weight) if rows is None else rows
            if len(child_rows):
                setattr(parent, name, PackedLinear(child, child_rows))
                count += 1
    return count


__all__ = ["PackedLinear", "pack_linears", "packed_rows", "why_unavailable"]
