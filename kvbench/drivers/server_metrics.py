"""A server's ``/metrics`` (Prometheus text) read as kvbench's counters, knobs and queue samples.

Which metric feeds which counter of the contract (:mod:`kvbench.core.counters`) is one table,
:data:`COUNTER_METRICS`: for each cumulative counter, the metrics that say it, first one present wins.
First ``reference_engine:<counter>_total``, the counter under its own name (the reference server
publishes every field of its ``EngineCounters`` so, and any server may), then vLLM's name where vLLM
counts the same thing. Foreign names are renamed there and nowhere else::

    contract counter        metric (first one present wins)
    ----------------------  ----------------------------------------------------------------------
    every counter below     reference_engine:<counter>_total
    preemptions_recompute   else vllm:num_preemptions_total, when the caller says that the server
    preemptions_swap        preempts in that mode only (``preemptions_are``): the other mode is 0
    preemptions_total       vllm:num_preemptions_total (the engine's one total, checked against the modes),
                            unless it was read as a mode's count: then it is told once, and left out
    prefix_cache_queries    else vllm:prefix_cache_queries_total                      tokens
    prefix_cache_hits       else vllm:prefix_cache_hits_total                         tokens
    generated_tokens        else vllm:generation_tokens_total
    prompt_tokens           else vllm:prompt_tokens_total (cached prompt tokens included)
    finished_length         else vllm:request_success_total{finished_reason="length"}
    finished_stop           else vllm:request_success_total{finished_reason="stop"}
    request_preemptions     vllm:request_num_preemptions_sum (per finished request, summed)
    aborts                  else vllm:request_success_total{finished_reason="abort"}
    num_gpu_blocks          vllm:cache_config_info{num_gpu_blocks}, else reference_engine:num_gpu_blocks
    num_cpu_blocks          vllm:cache_config_info{num_cpu_blocks}
    leaked_blocks           blocks in use once the server is idle: (num_gpu_blocks - reference_engine:
                            num_free_gpu_blocks), else round(vllm:kv_cache_usage_perc x num_gpu_blocks);
                            plus round(reference_engine:cpu_cache_usage_perc x num_cpu_blocks)

llama.cpp's server (``llamacpp:`` names, tools/server/server-task.cpp at 0c1e570) is read so::

    generated_tokens        llamacpp:tokens_predicted_total (added when a slot is released: finished,
                            cancelled or failed alike)
    prefix_cache_hits       llamacpp:prompt_tokens_cached_total                        tokens
    prompt_tokens           llamacpp:prompt_tokens_total (computed prompt tokens, counted as each batch is
    prefix_cache_queries    decoded) + llamacpp:prompt_tokens_cached_total: every prompt token once per request
    in flight (queues)      llamacpp:requests_processing + llamacpp:requests_deferred

Preemptions stay "not exposed" on it: llama.cpp has no preemption (a slot is released only when its request
ends), but a zero kvbench wrote in would read as a count the server made, and a check that needs pressure
shown by preemptions must say it could not show it, not that it saw none.

and nothing else: it publishes no finish reasons, no aborts, no pool size and (since 0c1e570) no KV usage
gauge, so ``finished_*``, ``aborts``, ``num_gpu_blocks`` and ``leaked_blocks`` stay "not exposed" on it.

A metric the server does not publish leaves its counter ``None`` ("not exposed"), never 0. Counts are
rounded to integers; ``swap_seconds`` is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvbench.core.counters import Counters
from kvbench.core.trace import StepRecord

#: a sample name and the labels a sample must carry to count
Source = tuple[str, dict[str, str]]


def _own(counter: str) -> Source:
    return f"reference_engine:{counter}_total", {}


#: contract counter -> the metrics that say it, first one present wins: its own name, then vLLM's
COUNTER_METRICS: dict[str, tuple[Source, ...]] = {
    "preemptions_recompute": (_own("preemptions_recompute"),),
    "preemptions_swap": (_own("preemptions_swap"),),
    "preemptions_total": (("vllm:num_preemptions_total", {}),),
    "swap_outs": (_own("swap_outs"),),
    "swap_ins": (_own("swap_ins"),),
    "swap_fallbacks": (_own("swap_fallbacks"),),
    "swapped_out_bytes": (_own("swapped_out_bytes"),),
    "swapped_in_bytes": (_own("swapped_in_bytes"),),
    "swap_seconds": (_own("swap_seconds"),),
    "prefix_cache_queries": (_own("prefix_cache_queries"), ("vllm:prefix_cache_queries_total", {})),
    "prefix_cache_hits": (_own("prefix_cache_hits"), ("vllm:prefix_cache_hits_total", {}),
                          ("llamacpp:prompt_tokens_cached_total", {})),
    "prefill_chunks": (_own("prefill_chunks"),),
    "computed_tokens": (_own("computed_tokens"),),
    "recomputed_tokens": (_own("recomputed_tokens"),),
    "generated_tokens": (_own("generated_tokens"), ("vllm:generation_tokens_total", {}),
                         ("llamacpp:tokens_predicted_total", {})),
    "prompt_tokens": (_own("prompt_tokens"), ("vllm:prompt_tokens_total", {})),
    "finished_length": (_own("finished_length"), ("vllm:request_success_total", {"finished_reason": "length"})),
    "finished_stop": (_own("finished_stop"), ("vllm:request_success_total", {"finished_reason": "stop"})),
    "request_preemptions": (_own("request_preemptions"), ("vllm:request_num_preemptions_sum", {})),
    "aborts": (_own("aborts"), ("vllm:request_success_total", {"finished_reason": "abort"})),
}
_NOT_ROUNDED = {"swap_seconds"}
#: llama.cpp: prompt tokens computed, and prompt tokens served from a slot's cache (their sum: every prompt token)
LLAMACPP_PROMPT = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total")
#: llama.cpp's queue gauges: slots processing a request, and requests waiting for a slot
LLAMACPP_QUEUES = ("llamacpp:requests_processing", "llamacpp:requests_deferred")


def is_llamacpp(snap: MetricsSnapshot) -> bool:
    """Whether ``snap`` is llama.cpp's server's ``/metrics``."""
    return snap.has(LLAMACPP_QUEUES[0])
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second is vLLM v0's name
CONFIG_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape: sample name -> [(labels, value)]. Sample names keep their ``_total`` suffix."""

    samples: Mapping[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        """Parse Prometheus text exposition; a malformed body raises ValueError saying so."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        except Exception as e:  # the parser raises bare ValueError/IndexError on bad lines
            raise ValueError(f"/metrics is not Prometheus text: {e}") from e
        return cls(samples)

    def has(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of ``name`` whose labels include ``labels``; None if none match."""
        matched = [v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == w for k, w in labels.items())]
        return sum(matched) if matched else None

    def labels(self, name: str) -> dict[str, str] | None:
        """The labels of the first sample of ``name`` (info metrics), or None."""
        rows = self.samples.get(name)
        return dict(rows[0][0]) if rows else None


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def cumulative_counters(snap: MetricsSnapshot, preemptions_are: str | None = None) -> Counters:
    """The contract's counters as the server's cumulative totals (subtract a before-scrape with
    :meth:`Counters.minus`), read through :data:`COUNTER_METRICS`. ``preemptions_are``
    ("recompute"|"swap") says which mode ``vllm:num_preemptions_total`` counts on a server that does
    not count preemptions by mode (vLLM v1 only recomputes); without it that total feeds no mode. A total
    read as a mode's count is told once: ``preemptions_total`` is then left out (``None``), so that no
    check compares the one metric with itself."""
    values: dict[str, Any] = {}
    for name, sources in COUNTER_METRICS.items():
        metric, labels = next(((m, lab) for m, lab in sources if snap.has(m)), sources[0])
        value = snap.value(metric, **labels)
        values[name] = value if name in _NOT_ROUNDED else _int(value)
    by_mode = values["preemptions_recompute"] is not None or values["preemptions_swap"] is not None
    if not by_mode and preemptions_are in ("recompute", "swap") and values["preemptions_total"] is not None:
        values[f"preemptions_{preemptions_are}"] = values["preemptions_total"]
        # a server that cannot preempt the other way exposes that mode as a true zero
        values["preemptions_swap" if preemptions_are == "recompute" else "preemptions_recompute"] = 0
        # the total now *is* the by-mode count: told once, so it is not offered as a second telling
        values["preemptions_total"] = None
    if is_llamacpp(snap):
        _llamacpp_counts(snap, values)
    values["num_gpu_blocks"], values["num_cpu_blocks"] = pool_sizes(snap)
    return Counters(**{k: v for k, v in values.items() if v is not None})


def _llamacpp_counts(snap: MetricsSnapshot, values: dict[str, Any]) -> None:
    """llama.cpp's counts that are not one metric each (see the module docstring's table)."""
    computed, cached = (snap.value(name) for name in LLAMACPP_PROMPT)
    if computed is not None and cached is not None:
        for name in ("prompt_tokens", "prefix_cache_queries"):
            if values.get(name) is None:
                values[name] = round(computed + cached)


def _queues(snap: MetricsSnapshot) -> tuple[float | None, float | None]:
    """(running, waiting) requests: vLLM's gauges, else llama.cpp's (slots processing, tasks deferred)."""
    running, waiting = snap.value("vllm:num_requests_running"), snap.value("vllm:num_requests_waiting")
    if running is None and waiting is None and is_llamacpp(snap):
        running, waiting = (snap.value(name) for name in LLAMACPP_QUEUES)
    return running, waiting


def pool_sizes(snap: MetricsSnapshot) -> tuple[int | None, int | None]:
    """(device blocks, host blocks) from ``vllm:cache_config_info`` labels, else the reference extras."""
    info = snap.labels(CONFIG_INFO) or {}
    gpu = _label_int(info.get("num_gpu_blocks")) or _int(snap.value("reference_engine:num_gpu_blocks"))
    return gpu, _label_int(info.get("num_cpu_blocks"))


def _label_int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def blocks_in_use(snap: MetricsSnapshot) -> int | None:
    """Device + host blocks held right now (the leak gauge when the server is idle); None if not exposed.

    Evictable prefix-cache blocks count as free, as they do in the server's own free count."""
    gpu, cpu = pool_sizes(snap)
    free = snap.value("reference_engine:num_free_gpu_blocks")
    usage = next((snap.value(n) for n in _USAGE if snap.has(n)), None)
    if gpu is not None and free is not None:
        used = gpu - round(free)
    elif gpu is not None and usage is not None:
        used = round(usage * gpu)
    else:
        return None
    cpu_usage = snap.value("reference_engine:cpu_cache_usage_perc")
    if cpu and cpu_usage is not None:
        used += round(cpu_usage * cpu)
    return used


def in_flight(snap: MetricsSnapshot) -> int | None:
    """Requests the server holds (running + waiting + swapped); None without the queue gauges."""
    running, waiting = _queues(snap)
    if running is None or waiting is None:
        return None
    return round(running + waiting + (snap.value("reference_engine:num_requests_swapped") or 0))


#: cache_config_info label -> (Knobs field, type)
_KNOB_LABELS: dict[str, tuple[str, type]] = {
    "block_size": ("block_size", int), "num_gpu_blocks": ("num_gpu_blocks", int),
    "num_cpu_blocks": ("num_cpu_blocks", int), "max_num_seqs": ("max_num_seqs", int),
    "max_num_batched_tokens": ("max_num_batched_tokens", int), "max_model_len": ("max_model_len", int),
    "enable_chunked_prefill": ("enable_chunked_prefill", bool),
    "enable_prefix_caching": ("enable_prefix_caching", bool),
    "preemption_mode": ("preemption_mode", str), "scheduling_policy": ("scheduling_policy", str),
}


#: the Knobs fields a server's cache_config_info (or an ``--engine`` option declaring its value) can carry
KNOB_FIELDS: frozenset[str] = frozenset(field_ for field_, _ in _KNOB_LABELS.values())


def parse_knob(name: str, raw: str) -> Any:
    """A knob value from text (a label or an ``--engine`` option); ValueError naming the knob otherwise."""
    kind = next((k for label, (field_, k) in _KNOB_LABELS.items() if field_ == name), None)
    if kind is None:
        raise ValueError(f"{name!r} is not a knob; knobs: {', '.join(f for f, _ in _KNOB_LABELS.values())}")
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"knob {name}: expected true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"knob {name}: expected an integer, got {raw!r}") from None
    return raw


def knobs_from_config_info(snap: MetricsSnapshot) -> dict[str, Any]:
    """The knobs a server says it runs with (``vllm:cache_config_info`` labels); absent or unparsable
    labels are left out, so they read as "unknown", never as a default."""
    info = snap.labels(CONFIG_INFO) or {}
    knobs: dict[str, Any] = {}
    for label, (name, _) in _KNOB_LABELS.items():
        raw = info.get(label)
        if raw in (None, "", "None"):
            continue
        try:
            knobs[name] = parse_knob(name, raw)
        except ValueError:
            continue
    return knobs


def _server_totals(snap: MetricsSnapshot) -> tuple[int | None, int | None, int | None]:
    """(preemptions of every mode, prefix-cache hits, prefix-cache queries) as the server counts them."""
    c = cumulative_counters(snap)
    preemptions = c.preemptions_total if c.preemptions_total is not None else c.preemptions
    return preemptions, c.prefix_cache_hits, c.prefix_cache_queries


def sampled_step(snap: MetricsSnapshot, t: float, since_last: float,
                 first: MetricsSnapshot | None = None) -> StepRecord | None:
    """A queue/KV sample as a :class:`StepRecord` (``duration`` = time since the previous sample, so
    duration-weighted means are time-weighted); None without the queue gauges. Samples carry no
    token counts or per-step preemptions (``sampled=True``: metrics read those as not exposed, never as 0);
    with ``first`` (the run's first sample) they carry the server's own cumulative counts since then
    (``server_preemptions``, ``server_prefix_hits``, ``server_prefix_queries``), for the report's timelines."""
    running, waiting = _queues(snap)
    if running is None or waiting is None:
        return None
    usage = next((snap.value(n) for n in _USAGE if snap.has(n)), None)
    _, cpu = pool_sizes(snap)
    cpu_usage = snap.value("reference_engine:cpu_cache_usage_perc") if cpu else None
    since = [None, None, None]
    if first is not None:
        since = [None if now is None or then is None else max(now - then, 0)
                 for now, then in zip(_server_totals(snap), _server_totals(first), strict=True)]
    return StepRecord(t=t, duration=since_last, num_running=round(running), num_waiting=round(waiting),
                      num_swapped=round(snap.value("reference_engine:num_requests_swapped") or 0),
                      kv_usage=usage, cpu_kv_usage=cpu_usage, sampled=True, server_preemptions=since[0],
                      server_prefix_hits=since[1], server_prefix_queries=since[2])
