"""Engine configuration: one dataclass, every field validated with an error that names it.

Names follow vLLM's engine arguments so its users feel at home. On CPU there is no device
memory to profile, so the device KV pool is sized by ``num_gpu_blocks_override`` or, failing
that, by ``kv_cache_space`` GiB (vLLM's CPU backend uses ``VLLM_CPU_KVCACHE_SPACE`` the same way).
On CUDA, without an override, the pool takes ``gpu_memory_utilization`` of the device's total
memory minus what the weights and a profiled forward pass use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from reference_engine.events import DEFAULT_MAX_EVENTS


class ConfigError(ValueError):
    """An invalid configuration value. ``field`` names the offending field."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"EngineConfig.{field}={value!r} is invalid: expected {allowed}")


PREEMPTION_MODES = ("recompute", "swap", "auto")  # auto: per victim, by cost (reference_engine.preemption_policy)
ADMISSION_POLICIES = ("none", "watermark", "aimd")  # see reference_engine.admission
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "sliced", "triton")
GiB = 1 << 30


@dataclass
class EngineConfig:
    """Everything that shapes the engine. See the module docstring for how the pools are sized."""

    model: str
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 0.5  # GiB of device KV pool on CPU when no override is given
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks (vLLM's default)
    num_cpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 512 with chunked prefill, else max_model_len
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    check_invariants: bool = False  # run the block manager's self-check after every step (slow)
    # decode attention: "torch" (the oracle), "sliced" (attention.sliced_decode_attention: fewer memory passes
    # on CPU), "triton", or "auto" = triton on CUDA if importable, torch on CUDA without it, sliced on CPU
    attention_backend: str = "auto"
    # Events retained in LLMEngine.events (oldest dropped first; 0 keeps none). A sink sees them all.
    max_events: int = DEFAULT_MAX_EVENTS
    # preemption_mode="auto" prices swap vs recompute with this hardware profile (a profile JSON file
    # from `kvbench calibrate`, or a built-in name such as "h200"); None: costs measured at engine start.
    cost_profile: str | None = None
    # Admission control (reference_engine.admission): "none" admits whatever fits now (vLLM's rule);
    # "watermark" admits only if the projected KV use over the next admission_horizon steps stays
    # under (1 - admission_headroom) of the pool; "aimd" caps running requests, halving the cap when
    # preemptions exceed preemption_budget per 100 steps and growing it by one per quiet window.
    admission_policy: str = "none"
    admission_headroom: float = 0.05
    admission_horizon: int = 64
    preemption_budget: float = 1.0
    # Prefill pacing (reference_engine.scheduler): while a request decodes, a step computes at most this
    # many prefill tokens beside the decodes (unchunked: a longer prompt only as the step's one prefill);
    # None: no cap.
    prefill_pacing_tokens: int | None = None

    def __post_init__(self) -> None:
        _positive_power_of_two("block_size", self.block_size, upper=128)
        _optional_int("num_gpu_blocks_override", self.num_gpu_blocks_override, low=1)
        _optional_int("num_cpu_blocks_override", self.num_cpu_blocks_override, low=0)
        _float_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        _float_range("kv_cache_space", self.kv_cache_space, 0.0, float("inf"), low_open=True)
        _float_range("swap_space", self.swap_space, 0.0, float("inf"))
        _integer("max_num_seqs", self.max_num_seqs, low=1)
        _integer("max_events", self.max_events, low=0)
        _optional_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        _optional_int("max_model_len", self.max_model_len, low=2)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("admission_policy", self.admission_policy, ADMISSION_POLICIES)
        _float_range("admission_headroom", self.admission_headroom, 0.0, 1.0, high_open=True)
        _integer("admission_horizon", self.admission_horizon, low=0)
        _float_range("preemption_budget", self.preemption_budget, 0.0, 100.0)
        _optional_int("prefill_pacing_tokens", self.prefill_pacing_tokens, low=1)
        if self.cost_profile is not None and (not isinstance(self.cost_profile, str) or not self.cost_profile):
            raise ConfigError("cost_profile", self.cost_profile, "None, a built-in profile name or a profile JSON path")
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "check_invariants"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError("seed", self.seed, "an integer")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", self.device, "'cpu', 'cuda' or 'cuda:N'")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a directory with config.json and *.safetensors")

    def resolve(self, model_max_len: int) -> EngineConfig:
        """Fill the defaults that depend on the model and check the fields that relate to each other."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ConfigError("max_model_len", max_model_len,
                              f"at most the model's max_position_embeddings ({model_max_len})")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 512 if self.enable_chunked_prefill else max_model_len
        if not self.enable_chunked_prefill and budget < max_model_len:
            # Without chunking a prompt is prefilled in one step, so the budget must hold the longest one.
            raise ConfigError("max_num_batched_tokens", budget,
                              f">= max_model_len ({max_model_len}) unless enable_chunked_prefill=True")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(max_model_len=max_model_len, max_num_batched_tokens=budget)
        return EngineConfig(**values)


def _positive_power_of_two(name: str, value: Any, upper: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > upper or value & (value - 1):
        raise ConfigError(name, value, f"a power of two from 1 to {upper}")


def _integer(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(name, value, f"an integer >= {low}")


def _optional_int(name: str, value: Any, low: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(name, value, f"None or an integer >= {low}")


def _float_range(name: str, value: Any, low: float, high: float, low_open: bool = False,
                 high_open: bool = False) -> None:
    # Finite only: NaN fails every comparison, and inf passed them but crashed sizing the pools.
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        bracket = "(" if low_open else "["
        closing = ")" if math.isinf(high) or high_open else "]"
        raise ConfigError(name, value, f"a finite number in {bracket}{low}, {high}{closing}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, "one of " + ", ".join(repr(a) for a in allowed))
