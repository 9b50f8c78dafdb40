"""Packed matmuls on the CPU (``linear_backend="onednn"``, :mod:`reference_engine.kernels.cpu_linear`) against
``torch.nn.functional.linear``, the oracle: bit-equal in bfloat16, within float32 rounding in float32,
for one row and many, with and without bias, on strided input; the model's state dict and tied head
untouched; token-equal greedy outputs from the engine under preemption; a wrongly packed weight is seen;
``auto`` picks it on CPU where it runs and says why where it cannot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.kernels import cpu_linear
from reference_engine.kernels.backends import resolve_backend
from reference_engine.model import load_model

pytestmark = pytest.mark.skipif(bool(cpu_linear.why_unavailable(torch.float32)),
                                reason=f"no oneDNN linear here: {cpu_linear.why_unavailable(torch.float32)}")


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_is_bit_equal_to_f_linear(rows: int, bias: bool) -> None:
    if cpu_linear.why_unavailable(torch.bfloat16):
        pytest.skip(cpu_linear.why_unavailable(torch.bfloat16))
    if cpu_linear.widens(torch.bfloat16):
        pytest.skip("no bfloat16 units: bfloat16 is widened (test_widened_bfloat16_*)")
    linear = _linear(96, 200, bias, torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(cpu_linear.PackedLinear(linear)(x), linear(x))


def _no_bf16_units(monkeypatch) -> None:
    """Play a CPU without bfloat16 units (an AVX2-only one), so the widened path runs on any CPU."""
    monkeypatch.setattr(cpu_linear, "bf16_packing_supported", lambda: False)
    assert cpu_linear.widens(torch.bfloat16) and not cpu_linear.widens(torch.float32)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_bfloat16_is_within_one_rounding_of_f_linear(rows: int, bias: bool, monkeypatch) -> None:
    """Without bfloat16 units the matmul runs in float32 on a packed float32 copy and rounds once: each
    element equals F.linear's bfloat16 result or is one bfloat16 step from it (the float32 sums run in
    another order), nearly all equal; it returns bfloat16 and its packed weight is float32."""
    _no_bf16_units(monkeypatch)
    linear = _linear(96, 200, bias, torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        packed = cpu_linear.PackedLinear(linear)
        got, want = packed(x), linear(x)
    assert packed.packed.dtype == torch.float32 and got.dtype == torch.bfloat16
    one_step = want.float().abs().clamp_min(1e-30) * 2.0**-7  # a bfloat16 ulp is at most 2^-7 of the value
    assert ((got.float() - want.float()).abs() <= one_step).all()
    assert (got == want).float().mean() > 0.97


def test_widened_bfloat16_that_skipped_its_rounding_would_be_seen(monkeypatch) -> None:
    """The comparison above can fail: a widened matmul that kept its float32 result (not rounded to
    bfloat16) misses its share of exact agreement, and one that multiplied the wrong weight is caught."""
    _no_bf16_units(monkeypatch)
    linear = _linear(96, 200, False, torch.bfloat16)
    x = torch.randn(64, 96).to(torch.bfloat16)
    with torch.inference_mode():
        packed = cpu_linear.PackedLinear(linear)
        want = linear(x)
        unrounded = cpu_linear._packed_matmul(x.float(), packed.packed, None)
        assert unrounded.dtype == torch.float32
        assert (unrounded == want.float()).float().mean() <= 0.97  # the test above's agreement bar is not met
        packed.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().float().roll(1, dims=0))
        assert not torch.allclose(packed(x).float(), want.float(), atol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_is_within_rounding_of_f_linear(rows: int, bias: bool) -> None:
    linear = _linear(96, 200, bias, torch.float32)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_strided_input_is_read_as_its_values() -> None:
    """A slice of a wider product (what a fused projection hands on) is not one dense matrix."""
    linear = _linear(64, 40, True, torch.float32)
    wide = torch.randn(9, 128)
    x = wide[:, 1::2]
    assert not x.is_contiguous()
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_a_wrongly_packed_weight_would_be_seen() -> None:
    """The comparisons above can fail: packing another weight (here the rows rolled by one) is caught."""
    linear = _linear(32, 48, False, torch.float32)
    packed = cpu_linear.PackedLinear(linear)
    packed.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().roll(1, dims=0))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        assert not torch.allclose(packed(x), linear(x), atol=1e-3)


def test_packing_a_model_keeps_its_state_dict_and_tied_head() -> None:
    model = load_model(builtin_checkpoint("tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = cpu_linear.pack_linears(model, everything=True)
    n = model.config.num_layers
    assert packed == 4 * n + 1  # qkv, o_proj, gate_up, down_proj per layer, and lm_head
    after = model.state_dict()
    assert after.keys() == before.keys()  # the packed copies are non-persistent buffers
    assert all(torch.equal(after[k], before[k]) for k in before)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].self_attn.qkv, cpu_linear.PackedLinear)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # the fused-away view, never called


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_outputs_are_token_equal_and_packing_ran(dtype: str, monkeypatch) -> None:
    """Uneven prompts under a pool small enough to preempt: every greedy output with packed matmuls
    equals the plain path's, the packed matmul ran (only) when asked for, and ``auto`` picks it on CPU."""
    if cpu_linear.why_unavailable(getattr(torch, dtype)):
        pytest.skip(cpu_linear.why_unavailable(getattr(torch, dtype)))
    model = str(builtin_checkpoint("tiny"))
    calls = []
    real = cpu_linear._packed_matmul

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_linear, "_packed_matmul", counting)
    monkeypatch.setattr(cpu_linear, "PACKED_MIN_FLOAT32_WEIGHT", 0)  # tiny's weights would stay unpacked
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (6, 41, 13, 70, 3, 28)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "onednn", "auto"):
        engine = LLMEngine(EngineConfig(model=model, block_size=4, num_gpu_blocks_override=40, dtype=dtype,
                                        linear_backend=backend))
        assert engine.linear_backend == ("onednn" if backend == "auto" else backend)
        runs = len(calls)
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (len(calls) > runs) == (backend != "torch")
        assert engine.counters().preemptions > 0  # the comparison covers recomputed sequences
    assert outputs["onednn"] == outputs["torch"] == outputs["auto"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_small_float32_weights_are_left_unpacked(dtype) -> None:
    """Which layers ``pack_linears`` packs: a float32 weight below the size bound stays an ``nn.Linear``
    (``F.linear`` was faster there), a larger one and any bfloat16 one are packed."""
    big = _linear(512, 256, True, dtype)  # 131,072 elements: above the float32 bound
    small = _linear(64, 192, False, dtype)  # 12,288
    # bfloat16 is packed on every CPU: as it is where oneDNN computes it, widened to float32 where not
    assert cpu_linear.packing_pays(big.weight)
    assert cpu_linear.packing_pays(small.weight) == (dtype != torch.float32)
    model = load_model(builtin_checkpoint("tiny"), dtype=dtype)  # every weight below the bound
    assert cpu_linear.pack_linears(model) == (0 if dtype == torch.float32 else 4 * model.config.num_layers + 1)


def test_onednn_off_cpu_is_refused_naming_the_device() -> None:
    with pytest.raises(ValueError, match="linear_backend='onednn' runs on the CPU"):
        resolve_backend("linear_backend", "onednn", torch.device("cuda"), torch.float32)
    assert resolve_backend("linear_backend", "auto", torch.device("cuda"), torch.float32) == "torch"


def test_where_onednn_cannot_run_auto_falls_back_and_onednn_says_why(monkeypatch) -> None:
    monkeypatch.setitem(cpu_linear._why_not, torch.bfloat16, "oneDNN has no bfloat16 kernels for this CPU")
    assert resolve_backend("linear_backend", "auto", torch.device("cpu"), torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match=r"cannot run in torch\.bfloat16: oneDNN has no bfloat16 kernels"):
        resolve_backend("linear_backend", "onednn", torch.device("cpu"), torch.bfloat16)


def test_a_bad_value_names_the_field() -> None:
    from reference_engine.config import ConfigError

    with pytest.raises(ConfigError, match="linear_backend"):
        EngineConfig(model="m", linear_backend="mkl")
