"""EngineConfig and SamplingParams validation: every invalid value is refused up front, with an error
that names the field and states what would be valid."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from reference_engine import ConfigError, EngineConfig, LLMEngine, SamplingParams

MODEL = "/nonexistent/model"  # construction does no I/O; only LLMEngine reads the directory

# (field, invalid value, a fragment of the allowed-values text the message must contain)
INVALID_FIELDS: list[tuple[str, Any, str]] = [
    ("block_size", 0, "a power of two from 1 to 128"),
    ("block_size", 3, "a power of two from 1 to 128"),
    ("block_size", 256, "a power of two from 1 to 128"),
    ("block_size", -16, "a power of two from 1 to 128"),
    ("block_size", True, "a power of two from 1 to 128"),
    ("block_size", 16.0, "a power of two from 1 to 128"),
    ("block_size", "16", "a power of two from 1 to 128"),
    ("num_gpu_blocks_override", 0, "None or an integer >= 1"),
    ("num_gpu_blocks_override", -4, "None or an integer >= 1"),
    ("num_gpu_blocks_override", 2.5, "None or an integer >= 1"),
    ("num_gpu_blocks_override", True, "None or an integer >= 1"),
    ("num_cpu_blocks_override", -1, "None or an integer >= 0"),
    ("num_cpu_blocks_override", "8", "None or an integer >= 0"),
    ("gpu_memory_utilization", 0, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", 0.0, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", 1.5, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", -0.1, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", math.nan, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", True, "a finite number in (0.0, 1.0]"),
    ("gpu_memory_utilization", "0.9", "a finite number in (0.0, 1.0]"),
    ("kv_cache_space", 0, "a finite number in (0.0, inf)"),
    ("kv_cache_space", -1.0, "a finite number in (0.0, inf)"),
    ("kv_cache_space", math.inf, "a finite number in (0.0, inf)"),
    ("kv_cache_space", math.nan, "a finite number in (0.0, inf)"),
    ("swap_space", -0.5, "a finite number in [0.0, inf)"),
    ("swap_space", math.inf, "a finite number in [0.0, inf)"),
    ("swap_space", None, "a finite number in [0.0, inf)"),
    ("max_num_seqs", 0, "an integer >= 1"),
    ("max_num_seqs", -1, "an integer >= 1"),
    ("max_num_seqs", None, "an integer >= 1"),
    ("max_num_seqs", 1.5, "an integer >= 1"),
    ("max_num_seqs", False, "an integer >= 1"),
    ("max_num_batched_tokens", 0, "None or an integer >= 1"),
    ("max_num_batched_tokens", 64.0, "None or an integer >= 1"),
    ("max_model_len", 1, "None or an integer >= 2"),
    ("max_model_len", 0, "None or an integer >= 2"),
    ("max_model_len", "2048", "None or an integer >= 2"),
    ("preemption_mode", "evict", "one of 'recompute', 'swap'"),
    ("preemption_mode", "Swap", "one of 'recompute', 'swap'"),
    ("preemption_mode", None, "one of 'recompute', 'swap'"),
    ("scheduling_policy", "lifo", "one of 'fcfs', 'priority'"),
    ("scheduling_policy", "FCFS", "one of 'fcfs', 'priority'"),
    ("dtype", "float64", "one of 'float32', 'float16', 'bfloat16'"),
    ("dtype", "fp16", "one of 'float32', 'float16', 'bfloat16'"),
    ("dtype", None, "one of 'float32', 'float16', 'bfloat16'"),
    ("device", "tpu", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "gpu", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "cudafoo", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "cuda:x", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "cuda:", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", "", "'cpu', 'cuda' or 'cuda:N'"),
    ("device", 0, "'cpu', 'cuda' or 'cuda:N'"),
    ("enable_chunked_prefill", 1, "True or False"),
    ("enable_chunked_prefill", "yes", "True or False"),
    ("enable_prefix_caching", 0, "True or False"),
    ("enable_prefix_caching", None, "True or False"),
    ("check_invariants", "false", "True or False"),
    ("seed", 1.5, "an integer"),
    ("seed", True, "an integer"),
    ("seed", "0", "an integer"),
    ("model", "", "a directory with config.json"),
    ("model", None, "a directory with config.json"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in INVALID_FIELDS])
def test_invalid_field_raises_config_error_naming_it(field: str, value: Any, allowed: str) -> None:
    kwargs = {"model": MODEL, field: value}
    with pytest.raises(ConfigError) as info:
        EngineConfig(**kwargs)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field
    assert err.value is value or (isinstance(value, float) and math.isnan(value))
    message = str(err)
    assert f"EngineConfig.{field}=" in message and "expected" in message
    assert allowed in message, message


# Boundary values that must be accepted: the edges of each range above.
VALID_FIELDS: list[tuple[str, Any]] = [
    ("block_size", 1), ("block_size", 2), ("block_size", 128),
    ("num_gpu_blocks_override", 1), ("num_gpu_blocks_override", None),
    ("num_cpu_blocks_override", 0), ("num_cpu_blocks_override", None),
    ("gpu_memory_utilization", 1.0), ("gpu_memory_utilization", 0.01),
    ("kv_cache_space", 1e-3), ("kv_cache_space", 2),
    ("swap_space", 0), ("swap_space", 0.0),
    ("max_num_seqs", 1),
    ("max_num_batched_tokens", 1), ("max_num_batched_tokens", None),
    ("max_model_len", 2), ("max_model_len", None),
    ("preemption_mode", "swap"), ("scheduling_policy", "priority"),
    ("dtype", "bfloat16"), ("dtype", "float16"),
    ("device", "cpu"), ("device", "cuda"), ("device", "cuda:0"), ("device", "cuda:12"),
    ("enable_chunked_prefill", True), ("seed", -1), ("seed", 2**40),
]


@pytest.mark.parametrize(("field", "value"), VALID_FIELDS, ids=[f"{f}={v!r}" for f, v in VALID_FIELDS])
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(EngineConfig(model=MODEL, **{field: value}), field) == value


def test_defaults_are_valid() -> None:
    config = EngineConfig(model=MODEL)
    assert (config.block_size, config.preemption_mode, config.scheduling_policy) == (16, "recompute", "fcfs")


# ---------------------------------------------------------------------- resolve: fields that relate
def test_max_model_len_above_the_models_positions_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=MODEL, max_model_len=2048).resolve(1024)
    assert info.value.field == "max_model_len"
    assert "2048" in str(info.value) and "max_position_embeddings (1024)" in str(info.value)


def test_max_model_len_above_the_checkpoint_is_refused_by_the_engine(tiny_ckpt: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("max_position_embeddings (1024)")) as info:
        LLMEngine(EngineConfig(model=tiny_ckpt, max_model_len=1025))
    assert info.value.field == "max_model_len"


def test_budget_below_max_model_len_needs_chunked_prefill() -> None:
    config = EngineConfig(model=MODEL, max_num_batched_tokens=256, max_model_len=512)
    with pytest.raises(ConfigError) as info:
        config.resolve(1024)
    assert info.value.field == "max_num_batched_tokens"
    assert ">= max_model_len (512)" in str(info.value) and "enable_chunked_prefill=True" in str(info.value)
    # the default max_model_len (the model's) is checked too
    with pytest.raises(ConfigError, match=re.escape("(1024)")):
        EngineConfig(model=MODEL, max_num_batched_tokens=1023).resolve(1024)
    chunked = EngineConfig(model=MODEL, max_num_batched_tokens=256, max_model_len=512,
                           enable_chunked_prefill=True).resolve(1024)
    assert (chunked.max_num_batched_tokens, chunked.max_model_len) == (256, 512)


@pytest.mark.parametrize(("chunked", "expected_budget"), [(False, 1024), (True, 512)])
def test_resolve_fills_model_dependent_defaults(chunked: bool, expected_budget: int) -> None:
    config = EngineConfig(model=MODEL, enable_chunked_prefill=chunked)
    resolved = config.resolve(1024)
    assert (resolved.max_model_len, resolved.max_num_batched_tokens) == (1024, expected_budget)
    assert config.max_model_len is None, "resolve returns a new config and leaves the original alone"


# ---------------------------------------------------------------------- SamplingParams
INVALID_SAMPLING: list[tuple[str, Any, str]] = [
    ("max_tokens", 0, "an integer >= 1"),
    ("max_tokens", -3, "an integer >= 1"),
    ("max_tokens", 1.5, "an integer >= 1"),
    ("max_tokens", "8", "an integer >= 1"),
    ("max_tokens", None, "an integer >= 1"),
    ("temperature", -0.1, "a finite number >= 0"),
    ("temperature", "hot", "a finite number >= 0"),
    ("temperature", None, "a finite number >= 0"),
    ("temperature", math.nan, "a finite number >= 0"),
    ("temperature", math.inf, "a finite number >= 0"),
    ("top_k", -1, "0 (off) or an integer >= 1"),
    ("top_k", 2.5, "0 (off) or an integer >= 1"),
    ("top_p", 0, "a number in (0, 1]"),
    ("top_p", 0.0, "a number in (0, 1]"),
    ("top_p", 1.5, "a number in (0, 1]"),
    ("top_p", -0.2, "a number in (0, 1]"),
    ("top_p", math.nan, "a number in (0, 1]"),
    ("top_p", "0.9", "a number in (0, 1]"),
    ("seed", 1.5, "None or an integer"),
    ("seed", "42", "None or an integer"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID_SAMPLING,
                         ids=[f"{f}={v!r}" for f, v, _ in INVALID_SAMPLING])
def test_invalid_sampling_params_raise_value_error_naming_the_field(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}=") and allowed in message, message


def test_sampling_params_edges_are_accepted() -> None:
    params = SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=0, stop_token_ids=[5, 6])
    assert params.greedy and params.stop_token_ids == (5, 6)
    assert not SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9).greedy
