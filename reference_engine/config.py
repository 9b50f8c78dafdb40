"""Engine configuration: one dataclass, every field validated with an error that names it.

Names follow vLLM's engine arguments so its users feel at home. On CPU there is no device
memory to profile, so the device KV pool is sized by ``num_gpu_blocks_override`` or, failing
that, by ``kv_cache_space`` GiB (vLLM's CPU backend uses ``VLLM_CPU_KVCACHE_SPACE`` the same way).
On CUDA, without an override, the pool takes ``gpu_memory_utilization`` of the device's total
memory minus what is already in use once the weights are loaded (no forward pass is profiled, so
leave room for activations with a lower ``gpu_memory_utilization``).
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


PREEMPTION_MODES = ("recompute", "swap", "auto")  # auto: per victim, by cost (reference_engine.policies.preemption)
ADMISSION_POLICIES = ("none", "watermark", "aimd", "full_prompt")  # see reference_engine.policies.admission
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "sliced", "cpp", "triton")
LINEAR_BACKENDS = ("auto", "torch", "onednn")
ELEMENTWISE_BACKENDS = ("auto", "torch", "cpp")
GiB = 1 << 30
# A CPU step of more tokens than this runs as forward passes of about this many, so the first to sample are
# streamed before the step ends. A 2,048-token step of `small` as 4 passes of 512 took 0.5-3% longer than as
# one (one thread, float32 and bfloat16); as 8 of 256, 3-6% (docs/reference-engine.md).
CPU_MICROBATCH_TOKENS = 512


@dataclass
class EngineConfig:
    """Everything that shapes the engine. What each field means and accepts is :data:`FIELD_DOCS` (the
    server's ``--help`` prints it); the module docstring says how the pools are sized."""

    model: str
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 0.5
    swap_space: float = 4.0
    num_cpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    check_invariants: bool = False
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    elementwise_backend: str = "auto"
    max_events: int = DEFAULT_MAX_EVENTS
    cost_profile: str | None = None
    admission_policy: str = "none"
    admission_headroom: float = 0.05
    admission_horizon: int = 64
    preemption_budget: float = 1.0
    prefill_pacing_tokens: int | None = None
    microbatch_tokens: int | None = None

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
        _optional_int("microbatch_tokens", self.microbatch_tokens, low=0)
        if self.cost_profile is not None and (not isinstance(self.cost_profile, str) or not self.cost_profile):
            raise ConfigError("cost_profile", self.cost_profile, "None, a built-in profile name or a profile JSON path")
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        _choice("elementwise_backend", self.elementwise_backend, ELEMENTWISE_BACKENDS)
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
        microbatch = self.microbatch_tokens
        if microbatch is None:  # on CUDA a pass costs launches, not the rows it computes: one per step
            microbatch = CPU_MICROBATCH_TOKENS if self.device == "cpu" else 0
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(max_model_len=max_model_len, max_num_batched_tokens=budget, microbatch_tokens=microbatch)
        return EngineConfig(**values)


#: What each field means and what it accepts: one sentence or two, plain text (the server's ``--help``
#: prints them as they are). A test holds every field described.
FIELD_DOCS: dict[str, str] = {
    "model": "checkpoint directory: a Hugging Face Llama config.json with *.safetensors weights",
    "block_size": "tokens per KV block; a power of two from 1 to 128",
    "num_gpu_blocks_override": "device KV pool size in blocks (an integer >= 1); unset: sized from kv_cache_space "
                               "on CPU, gpu_memory_utilization on CUDA",
    "gpu_memory_utilization": "on CUDA without a block override, the share of device memory for weights and the "
                              "KV pool; a number in (0, 1]",
    "kv_cache_space": "on CPU without a block override, GiB of device KV pool; a number > 0",
    "swap_space": "GiB of host memory for swapped-out blocks (vLLM's default 4), reserved only when "
                  "preemption_mode is swap or auto; a number >= 0",
    "num_cpu_blocks_override": "host (swap) pool size in blocks (an integer >= 0); unset: sized from swap_space",
    "max_num_seqs": "most requests running in one step; an integer >= 1",
    "max_num_batched_tokens": "token budget of one step (an integer >= 1); unset: 512 with chunked prefill, else "
                              "max_model_len (without chunking it must be at least max_model_len)",
    "max_model_len": "longest prompt + output accepted, in tokens (an integer >= 2, at most the model's "
                     "max_position_embeddings); unset: max_position_embeddings",
    "enable_chunked_prefill": "split a prompt's prefill over steps within the token budget",
    "enable_prefix_caching": "reuse the KV blocks of an identical prompt prefix",
    "preemption_mode": "what happens to a preempted request's KV: recompute (freed, computed again), swap "
                       "(copied to the host pool; recompute when it is full) or auto (whichever costs less, per "
                       "victim)",
    "scheduling_policy": "fcfs (first come, first served; the latest admitted is preempted first) or priority "
                         "(lowest priority value first; the least important is preempted first)",
    "seed": "seed of sampling for requests that give none; an integer",
    "device": "cpu, cuda or cuda:N",
    "dtype": "weights and KV dtype: float32, float16 or bfloat16",
    "check_invariants": "run the block manager's self-check after every step (slow; for debugging)",
    "attention_backend": "decode attention: torch (the readable oracle), sliced (fewer memory passes on CPU), "
                         "cpp (a C++ kernel reading the blocks in place on CPU, built on first use), triton "
                         "(CUDA, or TRITON_INTERPRET=1), or auto (triton on CUDA if importable, torch on CUDA "
                         "without it; on CPU cpp, or sliced where cpp cannot be built)",
    "linear_backend": "matmuls: torch (torch.nn.functional.linear), onednn (CPU: weights packed once into "
                      "oneDNN's layout, one more copy of them in memory) or auto (onednn on CPU where it runs, "
                      "torch elsewhere)",
    "elementwise_backend": "RMSNorm and SwiGLU: torch (the readable oracle), cpp (CPU, float32 and bfloat16: one "
                           "fused pass per layer, a C++ kernel built on first use) or auto (cpp where it runs, "
                           "torch elsewhere)",
    "max_events": "engine events retained in LLMEngine.events, oldest dropped first (0 keeps none; a sink sees "
                  "them all); an integer >= 0",
    "cost_profile": "how preemption_mode=auto prices swap against recompute: a hardware profile JSON file from "
                    "kvbench calibrate, or a built-in name such as h200; unset: costs measured at engine start",
    "admission_policy": "none (admit whatever fits now: the first chunk), watermark (admit only if the projected KV "
                        "use over the next admission_horizon steps stays under 1 - admission_headroom of the "
                        "pool) or aimd (cap running requests: halved when preemptions exceed preemption_budget "
                        "per 100 steps, raised by one per quiet window) or full_prompt (admit only if the whole "
                        "sequence fits the free blocks: vLLM V1's scheduler_reserve_full_isl)",
    "admission_headroom": "watermark admission: share of the pool kept free; a number in [0, 1)",
    "admission_horizon": "watermark admission: steps of growth projected for running requests; an integer >= 0",
    "preemption_budget": "aimd admission: preemptions per 100 steps tolerated before the cap is halved; a number "
                         "in [0, 100]",
    "prefill_pacing_tokens": "while a request decodes, at most this many prefill tokens per step beside the "
                             "decodes (without chunking, a longer prompt only as the step's one prefill); an "
                             "integer >= 1; unset: no cap",
    "microbatch_tokens": "a step of more tokens than this runs as forward passes of at most about this many "
                         "(whole chunks, those that sample first), and the server streams each pass's tokens as "
                         "soon as it has sampled them, before the step ends (with the packed CPU matmul the logits "
                         "are equal bit for bit to one pass's); an integer >= 0 (0: one pass per step); unset: "
                         "512 on CPU, 0 on CUDA",
}


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
