"""Knobs: kvbench's engine-neutral names for the levers every paged-KV engine has.

Checks force pressure through them; each adapter maps them onto its own configuration and lists
the ones it cannot map.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Knobs:
    """Engine-neutral configuration. ``None`` means "the engine's default".

    Fields follow vLLM's names. ``num_gpu_blocks`` is the size of the device KV pool in blocks,
    ``num_cpu_blocks`` the host (swap / offload) pool in blocks.
    """

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    preemption_mode: str | None = None  # "recompute" | "swap" ("auto": reference_engine's per-victim choice)
    scheduling_policy: str | None = None  # "fcfs" | "priority"
    # "none" | "watermark" | "aimd": reference_engine's admission control (capability "admission_control");
    # only scenarios that need that capability set it
    admission_policy: str | None = None
    # the watermark policy's share of the pool kept free of projected use (reference_engine's
    # admission_headroom); only the policies scenario's trade-off curve sets it
    admission_headroom: float | None = None
    # prefill tokens a step computes beside decodes (reference_engine's prefill_pacing_tokens)
    prefill_pacing_tokens: int | None = None

    def merged(self, other: Knobs) -> Knobs:
        """``other``'s non-None fields win over ours."""
        updates = {f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        return replace(self, **updates)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


#: "Every knob at the engine's default", shared as the default argument of adapter methods.
DEFAULT_KNOBS = Knobs()
