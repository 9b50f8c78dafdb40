"""What a running server says it runs with, in kvbench's knob names: the settings the *engine* confirms,
never what kvbench asked for.

Two sources, both the server's own words over HTTP:

* ``vllm:cache_config_info``'s labels on ``/metrics`` (:func:`kvbench.drivers.server_metrics.knobs_from_config_info`):
  vLLM's cache settings (block size, pool, prefix caching); the reference server adds every knob, its token
  budget and chunked prefill among them.
* vLLM's ``GET /server_info?config_format=json`` (served when vLLM runs with ``VLLM_SERVER_DEV_MODE=1``, as
  vLLM's own benchmark sweeps start it): the whole ``VllmConfig`` the front end built and handed to the
  engine, after every platform adjustment. Its scheduler settings are what ``/metrics`` does not tell:
  ``max_num_batched_tokens`` (the most tokens one step computes; ``max_num_scheduled_tokens`` where that is
  set and smaller), ``enable_chunked_prefill``, ``max_num_seqs``, the scheduling policy, and the model's
  ``max_model_len``. Read with :func:`knobs_from_server_info`.

A setting neither source states is absent (unknown), never a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: where vLLM's /server_info reports it -> the knob: (config section, field)
_SERVER_INFO_FIELDS: dict[str, tuple[str, str]] = {
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "enable_chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "scheduling_policy": ("scheduler_config", "policy"),
    "block_size": ("cache_config", "block_size"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "num_gpu_blocks": ("cache_config", "num_gpu_blocks"),
    "max_model_len": ("model_config", "max_model_len"),
}
_KINDS = {"enable_chunked_prefill": bool, "enable_prefix_caching": bool, "scheduling_policy": str}


def knobs_from_server_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs vLLM's ``/server_info`` JSON (``config_format=json``) states, by kvbench's names; fields it
    leaves empty or of an unexpected type are left out. The step's token budget is the smaller of
    ``max_num_batched_tokens`` and ``max_num_scheduled_tokens`` (vLLM's scheduler takes the latter where it is
    set: speculative decoding reserves room in the batch)."""
    config = info.get("vllm_config")
    if not isinstance(config, Mapping):
        return {}
    knobs: dict[str, Any] = {}
    for knob, (section, name) in _SERVER_INFO_FIELDS.items():
        part = config.get(section)
        raw = part.get(name) if isinstance(part, Mapping) else None
        kind = _KINDS.get(knob, int)
        if isinstance(raw, bool) != (kind is bool) or not isinstance(raw, kind):
            continue
        knobs[knob] = raw
    scheduler = config.get("scheduler_config")
    scheduled = scheduler.get("max_num_scheduled_tokens") if isinstance(scheduler, Mapping) else None
    if isinstance(scheduled, int) and not isinstance(scheduled, bool) and "max_num_batched_tokens" in knobs:
        knobs["max_num_batched_tokens"] = min(knobs["max_num_batched_tokens"], scheduled)
    return knobs
