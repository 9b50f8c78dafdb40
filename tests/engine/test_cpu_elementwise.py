"""Fused RMSNorm, SwiGLU and RoPE on the CPU (``elementwise_backend="cpp"``,
:mod:`reference_engine.kernels.cpu_elementwise`) against the torch path in :mod:`reference_engine.model`, the
oracle: SwiGLU bit-equal in float32 and bfloat16, vector body and scalar tail (where torch's own kernels are
its AVX-512 or AVX2 build; else within rounding), RoPE bit-equal on a slice of a wider product, RMSNorm within
rounding of its sum of squares (bfloat16: at most one unit in the last place, and rarely), NaN kept; the layers
fall back where the kernel does not apply; the engine's greedy tokens equal under preemption; a kernel that
rounds differently is seen; ``auto`` picks it on CPU where it builds and says why where it cannot."""

from __future__ import annotations

import pytest
import torch

from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.config import ConfigError
from reference_engine.kernels import cpu_elementwise
from reference_engine.kernels.backends import resolve_backend
from reference_engine.model import MLP, ModelConfig, RMSNorm, fuse_elementwise, load_model

pytestmark = pytest.mark.skipif(bool(cpu_elementwise.why_unavailable(torch.float32)),
                                reason=f"no fused kernels here: {cpu_elementwise.why_unavailable(torch.float32)}")
DTYPES = [torch.float32, torch.bfloat16]


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    return norm.requires_grad_(False)


def _torch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.clone().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate, inplace=True).mul_(up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (37, 512), (300, 200), (5, 7)])
def test_rms_norm_matches_the_torch_path(dtype, rows, hidden) -> None:
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    norm = _norm(hidden, dtype)
    want, got = norm(x), cpu_elementwise.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.bfloat16:  # the sum of squares in another order: now and then one ulp apart
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
        assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows() -> None:
    base = torch.randn(9, 96, dtype=torch.bfloat16, generator=None)
    x = base[:, 16:80]  # rows of 64 contiguous elements, 96 apart
    norm = _norm(64, torch.bfloat16)
    torch.testing.assert_close(cpu_elementwise.rms_norm(x, norm.weight, norm.eps), norm(x.contiguous()),
                               rtol=8e-3, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1408), (64, 192), (3, 45), (300, 16)])
def test_swiglu_is_bit_equal_to_the_torch_path(dtype, rows, inter) -> None:
    """45: a vector body and a scalar tail (AVX-512 takes 16 lanes, AVX2 8; torch's kernels two vectors)."""
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    got = cpu_elementwise.silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2"):  # torch's kernel splits rows as ours
        assert torch.equal(got, _torch_swiglu(gate_up))
    else:
        torch.testing.assert_close(got, _torch_swiglu(gate_up), rtol=8e-3 if dtype == torch.bfloat16 else 1e-6,
                                   atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_stays_nan(dtype) -> None:
    x = torch.ones(2, 32, dtype=dtype)
    x[1, 3] = float("nan")
    norm = _norm(32, dtype)
    out = cpu_elementwise.rms_norm(x, norm.weight, norm.eps)
    assert out[1].isnan().all() and not out[0].isnan().any()
    gate_up = torch.ones(2, 64, dtype=dtype)
    gate_up[0, 5] = float("nan")
    assert cpu_elementwise.silu_mul(gate_up)[0, 5].isnan()


def test_bad_input_is_refused_naming_it() -> None:
    norm = _norm(32, torch.float32)
    with pytest.raises(RuntimeError, match="rms_norm weight"):
        cpu_elementwise.rms_norm(torch.ones(2, 32), norm.weight[:16], 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_elementwise.silu_mul(torch.ones(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="even number of columns"):
        cpu_elementwise.silu_mul(torch.ones(2, 7))


def test_fused_layers_fall_back_where_the_kernel_does_not_apply(monkeypatch) -> None:
    cfg = ModelConfig.from_dir(builtin_checkpoint("tiny"))
    model = load_model(builtin_checkpoint("tiny"))
    fused = fuse_elementwise(model)
    # two norms a layer, the final norm, every MLP, and the one RoPE every layer shares
    assert fused == 2 * cfg.num_layers + 1 + cfg.num_layers + 1
    assert all(isinstance(m.fused, type(cpu_elementwise.rms_norm)) for m in model.modules() if isinstance(m, RMSNorm))
    calls = []
    monkeypatch.setattr(model.model.norm, "fused", lambda *a: calls.append(a) or torch.zeros(1))
    model.model.norm(torch.ones(2, 3, cfg.hidden_size))  # 3-D: the torch path
    model.model.norm(torch.ones(4, cfg.hidden_size, dtype=torch.bfloat16))  # not the weight's dtype
    assert not calls
    model.model.norm(torch.ones(4, cfg.hidden_size))
    assert len(calls) == 1
    unfused = MLP(cfg)  # no gate_up projection: nothing to fuse, the torch path
    assert unfused.fused is None
    rope = model.model.rotary_emb
    assert rope.fused is cpu_elementwise.rope
    monkeypatch.setattr(rope, "fused", lambda *a: calls.append(a) or torch.zeros(1))
    cos_sin = rope.at(torch.arange(4), torch.float32)
    head_dim = cfg.head_dim
    rope.rotated(torch.ones(4, 2, head_dim).transpose(0, 1), rope.at(torch.arange(2), torch.float32))  # heads apart
    rope.rotated(torch.ones(4, 2, head_dim, dtype=torch.bfloat16), cos_sin)  # not the tables' dtype
    assert len(calls) == 1
    rope.rotated(torch.ones(4, 2, head_dim), cos_sin)
    assert len(calls) == 2


def _rope_input(rows: int, heads: int, dim: int, dtype: torch.dtype):
    """A [rows, heads, dim] slice of a wider product (as the fused q/k/v hands it on) and RoPE's tables at
    positions up to 4,000."""
    from reference_engine.model import RotaryEmbedding

    g = torch.Generator().manual_seed(rows + dim)
    wide = (torch.randn(rows, (heads + 3) * dim, generator=g) * 3).to(dtype)
    x = wide[:, : heads * dim].view(rows, heads, dim)
    rope = RotaryEmbedding(dim, 4096, 10000.0)
    return rope, x, rope.at(torch.randint(0, 4096, (rows,), generator=g), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "heads", "dim"), [(1, 12, 64), (300, 6, 32), (7, 3, 10), (64, 1, 128)])
def test_rope_is_bit_equal_to_the_torch_path(dtype, rows, heads, dim) -> None:
    rope, x, cos_sin = _rope_input(rows, heads, dim, dtype)
    assert rows == 1 or not x.is_contiguous()  # rows apart by more than their heads
    got = cpu_elementwise.rope(x, *cos_sin)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, rope.rotate(x, cos_sin))


def test_a_rope_that_rounds_otherwise_or_rotates_the_other_way_is_seen() -> None:
    """The comparison above can fail: RoPE rounded once at the end (not after each product) differs in
    bfloat16, and rotating by the other sign (x * cos - rotate_half(x) * sin) differs in float32."""
    _, x, (cos, sin) = _rope_input(64, 4, 64, torch.bfloat16)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    once = (x.float() * cos.float() + rotated.float() * sin.float()).to(torch.bfloat16)
    assert not torch.equal(once, cpu_elementwise.rope(x, cos, sin))
    _, x, (cos, sin) = _rope_input(64, 4, 64, torch.float32)
    other_way = x * cos - torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert not torch.allclose(other_way, cpu_elementwise.rope(x, cos, sin))


def test_rope_refuses_bad_input_naming_it() -> None:
    cos = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="rope x"):
        cpu_elementwise.rope(torch.ones(2, 3, 7), torch.ones(2, 1, 7), torch.ones(2, 1, 7))  # odd head_dim
    with pytest.raises(RuntimeError, match="rope x"):
        cpu_elementwise.rope(torch.ones(3, 2, 8).transpose(0, 1), cos, cos)  # heads not contiguous in a row
    with pytest.raises(RuntimeError, match="rope cos/sin"):
        cpu_elementwise.rope(torch.ones(2, 3, 8), cos.to(torch.bfloat16), cos)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_outputs_equal_the_torch_paths_under_preemption(dtype) -> None:
    model = str(builtin_checkpoint("tiny"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (6, 41, 13, 70, 3, 28)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpp", "auto"):
        engine = LLMEngine(EngineConfig(model=model, block_size=4, num_gpu_blocks_override=40, dtype=dtype,
                                        elementwise_backend=backend))
        assert engine.elementwise_backend == ("cpp" if backend == "auto" else backend)
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.counters().preemptions > 0  # the comparison covers recomputed sequences
    assert outputs["cpp"] == outputs["torch"] == outputs["auto"]


def test_a_kernel_that_rounds_otherwise_is_seen(monkeypatch) -> None:
    """The comparison above can fail: SwiGLU rounded once at the end instead of after the silu, as a
    kernel that skipped the torch path's intermediate rounding would do, differs in bfloat16."""
    gate_up = (torch.randn(64, 384, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    once = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    assert not torch.equal(once, cpu_elementwise.silu_mul(gate_up))


def test_choosing_the_backend() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("elementwise_backend", "auto", cpu, torch.bfloat16) == "cpp"
    assert resolve_backend("elementwise_backend", "torch", cpu, torch.float32) == "torch"
    # the kernels take no float16
    assert resolve_backend("elementwise_backend", "auto", cpu, torch.float16) == "torch"
    assert resolve_backend("elementwise_backend", "auto", cuda, torch.float32) == "torch"
    with pytest.raises(ValueError, match="elementwise_backend='cpp' runs on the CPU"):
        resolve_backend("elementwise_backend", "cpp", cuda, torch.float32)
    with pytest.raises(ValueError, match=r"cannot run in torch\.float16"):
        resolve_backend("elementwise_backend", "cpp", cpu, torch.float16)
    with pytest.raises(ConfigError, match="elementwise_backend"):
        EngineConfig(model="m", elementwise_backend="fused")


def test_without_a_compiler_auto_falls_back_and_cpp_says_why(monkeypatch) -> None:
    monkeypatch.setattr(cpu_elementwise.EXTENSION, "module", None)
    monkeypatch.setattr(cpu_elementwise.EXTENSION, "error", "the fused elementwise kernels could not be built (no g++)")
    assert resolve_backend("elementwise_backend", "auto", torch.device("cpu"), torch.float32) == "torch"
    with pytest.raises(ValueError, match=r"elementwise_backend='cpp' cannot run .*no g\+\+"):
        resolve_backend("elementwise_backend", "cpp", torch.device("cpu"), torch.float32)
