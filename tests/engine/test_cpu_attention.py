"""The compiled CPU decode kernel (``attention_backend="cpp"``, ``reference_engine/kernels/csrc/paged_decode.cpp``)
against the torch path, the oracle: the same outputs for any block size, GQA grouping, head size, uneven
lengths and scattered block ids; close in bfloat16; token-equal greedy outputs from the engine under
preemption; a kernel that reads one key too many is seen; and ``auto`` picks it on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.models.builtin import builtin_checkpoint
from reference_engine import EngineConfig, LLMEngine, SamplingParams
from reference_engine.kernels import cpu_attention
from reference_engine.kernels.backends import resolve_backend
from tests.engine.test_sliced_attention import _case, _run

pytestmark = pytest.mark.skipif(not cpu_attention.cpu_kernel_available(),
                                reason=f"no CPU kernel here: {cpu_attention.why_unavailable()}")


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_kernel_equals_the_torch_path(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = _case([1, 5, 17, 33, 64, 9, 2], block_size, num_heads, num_kv_heads, head_dim=head_dim)
    torch.testing.assert_close(_run(case, "cpp"), _run(case, "torch"), atol=1e-5, rtol=1e-5)


def test_bfloat16_stays_close_to_the_torch_path() -> None:
    case = _case([6, 31, 50, 200], 16, 8, 2, head_dim=64, dtype=torch.bfloat16)
    got = _run(case, "cpp")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _run(case, "torch").float(), atol=2e-2, rtol=2e-2)


def test_a_kernel_reading_past_the_sequence_would_be_seen() -> None:
    """The comparison can fail: lengths two keys too long (reading the next slots of the last block, or the
    padding column) give a different result from the oracle's."""
    case = _case([2, 30], 4, 4, 2)
    got = cpu_attention.paged_decode_attention(case["q"], case["kv_cache"], 1, case["block_tables"],
                                               case["seq_lens"] + 2)
    assert not torch.allclose(got[0], _run(case, "torch")[0], atol=1e-3)


def test_bad_input_is_refused_with_the_reason() -> None:
    case = _case([3], 4, 4, 2)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_attention.paged_decode_attention(case["q"], case["kv_cache"], 1, case["block_tables"].int(),
                                             case["seq_lens"])
    with pytest.raises(RuntimeError, match="layer out of range"):
        cpu_attention.paged_decode_attention(case["q"], case["kv_cache"], 7, case["block_tables"], case["seq_lens"])


def test_loading_the_kernel_keeps_ieee_denormals() -> None:
    """Built with -ffast-math for its own loops, it must not switch the process to flush-to-zero."""
    assert np.float32(1e-39) * np.float32(1.0) != 0
    assert torch.tensor(1e-39, dtype=torch.float32).item() != 0


def test_engine_greedy_outputs_are_token_equal_and_the_kernel_ran(monkeypatch) -> None:
    """Uneven prompts at block size 4 under a pool small enough to preempt: every output with the kernel
    equals the torch path's, the kernel ran (only) when asked for, and ``auto`` picks it on CPU."""
    model = str(builtin_checkpoint("tiny"))
    calls = []
    real = cpu_attention.paged_decode_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", counting)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 40, 13, 77, 2, 29)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpp", "auto"):
        engine = LLMEngine(EngineConfig(model=model, block_size=4, num_gpu_blocks_override=40,
                                        attention_backend=backend))
        assert engine.attention_backend == ("cpp" if backend == "auto" else backend)
        runs = len(calls)
        outputs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (len(calls) > runs) == (backend != "torch")
        assert engine.counters().preemptions > 0  # the comparison covers recomputed sequences
    assert outputs["cpp"] == outputs["torch"] == outputs["auto"]


def test_cpp_off_cpu_is_refused_naming_the_device() -> None:
    with pytest.raises(ValueError, match="attention_backend='cpp' runs on the CPU"):
        resolve_backend("attention_backend", "cpp", torch.device("cuda"), torch.float32)


def test_without_a_compiler_auto_falls_back_to_sliced_and_cpp_says_why(monkeypatch) -> None:
    def no_build():
        monkeypatch.setattr(cpu_attention.EXTENSION, "error", "the CPU attention kernel could not be built (no g++)")
        raise RuntimeError(cpu_attention.EXTENSION.error)

    monkeypatch.setattr(cpu_attention, "_load", no_build)
    assert resolve_backend("attention_backend", "auto", torch.device("cpu"), torch.float32) == "sliced"
    with pytest.raises(ValueError, match=r"attention_backend='cpp' cannot run: .*no g\+\+"):
        resolve_backend("attention_backend", "cpp", torch.device("cpu"), torch.float32)


def test_two_checkouts_of_one_version_build_from_one_unchanging_copy(tmp_path, monkeypatch) -> None:
    """The build command names its source's path, so each checkout building from its own file made ninja
    rebuild over the other's; the source is copied to a folder named by its digest, written once."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    original = cpu_attention.EXTENSION.source
    sources = []
    for checkout in ("a", "b"):
        copy = tmp_path / checkout / "csrc" / original.name
        copy.parent.mkdir(parents=True)
        copy.write_bytes(original.read_bytes())
        monkeypatch.setattr(cpu_attention.EXTENSION, "source", copy)
        sources.append(cpu_attention._build_source())
    (name_a, built_a), (name_b, built_b) = sources
    assert (name_a, built_a) == (name_b, built_b) and built_a.parent == tmp_path / "ext" / name_a
    before = built_a.stat().st_mtime_ns
    cpu_attention._build_source()
    assert built_a.stat().st_mtime_ns == before  # not rewritten: ninja sees nothing changed
    copy.write_bytes(original.read_bytes() + b"\n// another version\n")
    name_c, built_c = cpu_attention._build_source()
    assert name_c != name_a and built_c.read_bytes().endswith(b"another version\n")
