"""The torch thread policy shared by the storm benchmarks and ``kvbench demo``."""

from __future__ import annotations

import io

import pytest
import torch

from kvbench.bench.threads import ENV_VAR, describe, pinned_torch_threads, torch_threads


def test_policy_one_thread_on_cpu_at_both_scales_else_torch_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_threads("quick") == torch_threads("full") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_threads("quick") is None and torch_threads("full") is None


def test_the_environment_overrides_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "3")
    assert torch_threads("quick") == torch_threads("full") == 3
    assert describe(3) == f"torch threads: 3 (from {ENV_VAR})"
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{ENV_VAR}='{bad}': expected a positive integer"):
            torch_threads("quick")


def test_pinning_restores_the_previous_number(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pinned_torch_threads("quick") as threads:
            assert threads == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_demo_runs_under_the_benchmarks_policy_and_says_so(monkeypatch):
    """The demo printed a 9x recompute/swap "difference" with torch's 2 threads that one thread removed."""
    import reference_engine
    from kvbench.demo import run_demo

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[int] = []
    generate = reference_engine.LLMEngine.generate

    def recording(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(reference_engine.LLMEngine, "generate", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    out = io.StringIO()
    try:
        assert run_demo(out, num_requests=3, num_gpu_blocks=19) == 0
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1]  # both modes ran on one thread
    assert out.getvalue().splitlines()[0] == f"torch threads: 1 ({ENV_VAR} to change)"
