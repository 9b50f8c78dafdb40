"""Matmuls with prepacked weights on the CPU (``linear_backend="onednn"``).

Why it exists: on CPU the linear layers are most of a decode step (the profile is in
docs/journal/measurements.md#reference-engine-vs-vllm-cpu), and ``torch.nn.functional.linear`` hands oneDNN a plain
row-major weight on every call, which it re-lays out into its blocked format each time. At the small row
counts of a decode step that re-layout costs as much as the multiply. oneDNN's own ``linear`` with a weight
packed once at load time (the op torch's inductor uses for frozen CPU models,
``torch.ops.mkldnn._linear_pointwise``) skips it: the same page says what it bought, per dtype.

The contract: :class:`PackedLinear` computes ``x @ W.T + b`` like the :class:`torch.nn.Linear` it wraps,
bit for bit in bfloat16 and float16 (the same oneDNN kernel, the weight only laid out ahead of time)
and within float32 rounding in float32 (the blocked kernel sums in another order); the tests hold it to
``F.linear``. The wrapped layer's parameters stay where they were (state-dict names unchanged, a tied
``lm_head`` still the embedding), and the packed copy is an extra buffer: packing costs one more copy of
each packed weight's memory, which ``linear_backend="torch"`` avoids.

**bfloat16 on a CPU without bfloat16 units** (AVX2 only: oneDNN can neither pack nor compute bfloat16 there,
and ``F.linear`` falls back to a scalar bfloat16 GEMM, 8-9x slower than float32 on ``small``'s shapes): the
weight is *widened* once, a float32 copy packed, and each matmul widens its rows to float32, multiplies and
rounds the result to bfloat16 once. That is the arithmetic of torch's own bfloat16 CPU GEMM (products of
bfloat16 values are exact in float32, sums accumulate in float32, one rounding at the end), with the sums in
another order: within one bfloat16 rounding of ``F.linear``, not bit-equal (the tests hold it to that). The
packed float32 copy takes twice the bfloat16 weight's memory.
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

    Probed once per dtype: a small packed matmul must run and agree with ``F.linear``; float16 also needs
    oneDNN's support for it on this CPU (bfloat16 without it is widened: :func:`widens`)."""
    if dtype in _why_not:
        return _why_not[dtype]
    why = _ops_present()
    if not why and dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        why = "oneDNN has no float16 kernels for this CPU"
    if not why:
        try:
            g = torch.Generator().manual_seed(0)
            linear = nn.Linear(32, 48, bias=False).to(dtype)  # bfloat16 without bf16 units: widened (above)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(48, 32, generator=g))
                x = torch.randn(5, 32, generator=g).to(dtype)
                got = PackedLinear(linear)(x)
                want = nn.functional.linear(x, linear.weight)
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                why = "oneDNN's packed matmul disagreed with torch's on a probe"
        except RuntimeError as exc:
            why = f"oneDNN's packed matmul failed on a probe ({str(exc)[:200]})"
    _why_not[dtype] = why
    return why


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


#: float32 weights with fewer elements are multiplied faster by ``F.linear`` (MKL) at every row count
#: measured, while bfloat16 packed was as fast or faster at every shape measured (the figures:
#: docs/journal/reference-engine.md, "Matmul packing decided per weight")
PACKED_MIN_FLOAT32_WEIGHT = 1 << 16


def packing_pays(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_linears` packs a layer with this weight: every weight but a float32 one of
    fewer than ``PACKED_MIN_FLOAT32_WEIGHT`` elements (a bfloat16 one widened, :func:`widens`, is packed
    whatever its size: the plain path it replaces is the slow scalar one).

    Not decided by row count as well: at a prefill's row counts packing gained nothing on ``small``'s
    shapes, and sending float32 prefills to ``F.linear`` (MKL) made the torch attention path's later decode
    steps slower in the same process, a side effect not understood, so not taken (the measurements:
    docs/journal/reference-engine.md, "Matmul packing decided per weight")."""
    return weight.dtype != torch.float32 or weight.numel() >= PACKED_MIN_FLOAT32_WEIGHT


def bf16_packing_supported() -> bool:
    """Whether oneDNN can pack and compute bfloat16 weights on this CPU (it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on an AVX2-only CPU its reorder raises)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def widens(dtype: torch.dtype) -> bool:
    """Whether a packed matmul in ``dtype`` computes in float32 (the module docstring): bfloat16 on a CPU
    where oneDNN has no bfloat16 kernels."""
    return dtype == torch.bfloat16 and not bf16_packing_supported()


class PackedLinear(nn.Module):
    """``linear``, with its weight also held in oneDNN's blocked layout, computed by oneDNN's linear
    (in float32, rounded to the layer's dtype once, where :func:`widens` says so).

    ``weight`` and ``bias`` are the wrapped layer's own parameters (shared, not copied); ``packed`` and
    ``packed_bias`` (the bias in the dtype the matmul computes in: the bias itself unless widened) are
    non-persistent buffers, so state dicts are those of the unwrapped model."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.dtype = linear.weight.dtype
        self.compute_dtype = torch.float32 if widens(self.dtype) else self.dtype
        with torch.no_grad():
            weight = linear.weight.detach().to(self.compute_dtype)
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
            bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype)
            self.register_buffer("packed_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)  # a no-op unless widened
        # oneDNN reads the rows as one dense matrix: a strided view (a slice of a fused product) is copied
        out = _packed_matmul(x if x.is_contiguous() else x.contiguous(), self.packed, self.packed_bias)
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, everything: bool = False) -> int:
    """Replace every :class:`torch.nn.Linear` under ``model`` that a forward pass calls, and whose
    weight :func:`packing_pays` for (``everything``: whatever its weight), with a :class:`PackedLinear`
    of it, in place; returns how many were packed.

    Left alone: linears whose packing would not pay (no packed copy in memory for them), and linears
    that forward passes do not call: a layer's unfused ``q_proj``/``gate_proj`` etc. (views of the fused
    weight, kept for the state dict) when :meth:`fuse_projections` has run."""
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
            if everything or packing_pays(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


__all__ = ["PackedLinear", "pack_linears", "packing_pays", "why_unavailable", "widens"]
