"""Prometheus metrics: vLLM's names and meanings, and every engine counter under its own name.

Every metric carries the label ``model_name`` (the served model name), as vLLM's do. Each server has
its own ``CollectorRegistry``, never the process-global one, so two servers (or tests) in one process
do not mix their numbers.

vLLM's names (meanings as in vLLM v1's ``v1/metrics/loggers.py``):

=====================================  =========  ====================================================
vllm:num_requests_running              gauge      requests in the running queue
vllm:num_requests_waiting              gauge      requests waiting to be scheduled
vllm:kv_cache_usage_perc               gauge      fraction of device KV blocks in use, 0..1 (1 = 100%)
vllm:num_preemptions_total             counter    preemptions, every mode (``preemptions_recompute``
                                                  + ``preemptions_swap``)
vllm:prefix_cache_queries_total        counter    ``prefix_cache_queries``: tokens looked up in the
                                                  prefix cache, the whole sequence at each admission
vllm:prefix_cache_hits_total           counter    ``prefix_cache_hits``: of those, tokens found cached
vllm:prompt_tokens_total               counter    prompt tokens of requests that produced output
vllm:generation_tokens_total           counter    ``generated_tokens``: output tokens the engine sampled
vllm:request_success_total             counter    finished requests, label ``finished_reason``
vllm:time_to_first_token_seconds       histogram  arrival at the server -> first token
vllm:inter_token_latency_seconds       histogram  time between consecutive tokens of a request
vllm:cache_config_info                 gauge = 1  the knobs, as labels
=====================================  =========  ====================================================

``vllm:cache_config_info`` has vLLM's labels (``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``,
``enable_prefix_caching``) and, so a client can read every knob that shapes preemption, this
engine's ``preemption_mode``, ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``,
``scheduling_policy``, ``max_model_len`` and ``swap_space``.

This engine's own names (no vLLM equivalent, or vLLM's beside them):

=========================================  =========  ================================================
reference_engine:<name>_total              counter    every field of
                                                      :class:`~reference_engine.engine_counters.EngineCounters`
                                                      under its own name (the contract's), its help
                                                      text the field's docstring: preemptions_recompute,
                                                      preemptions_swap, swap_outs, swap_ins,
                                                      swap_fallbacks, swapped_out_bytes,
                                                      swapped_in_bytes, swap_seconds,
                                                      prefix_cache_queries, prefix_cache_hits,
                                                      prefill_chunks, computed_tokens,
                                                      recomputed_tokens, generated_tokens, aborts,
                                                      evicted_blocks, steps
reference_engine:num_requests_swapped      gauge      requests swapped out to the host pool
reference_engine:num_gpu_blocks            gauge      device KV blocks in the pool
reference_engine:num_free_gpu_blocks       gauge      device KV blocks free (evictable cached ones count)
reference_engine:cpu_cache_usage_perc      gauge      host (swap) KV pool usage, 0..1
=========================================  =========  ================================================

The engine's numbers are read on the engine's own thread (:func:`read_engine_stats`, after each step)
into one immutable :class:`EngineStats`: the ``EngineCounters`` snapshot itself and the gauges. Every
engine metric above, vLLM's and this engine's, is fed from that one record; a scrape only reads the
latest snapshot, so ``/metrics`` never touches the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reference_engine.config import EngineConfig
from reference_engine.engine_counters import EngineCounters, field_docs

# vLLM v1's buckets for TTFT and inter-token latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


@dataclass(frozen=True)
class EngineGauges:
    """What holds in the engine right now (from ``engine.stats()``), as the server publishes it."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    kv_cache_usage: float = 0.0
    cpu_cache_usage: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """What the server reads from the engine: its counters record (a snapshot) and its gauges."""

    counters: EngineCounters = field(default_factory=EngineCounters)
    gauges: EngineGauges = field(default_factory=EngineGauges)


def read_engine_stats(engine) -> EngineStats:
    """The engine's counters and gauges, read together; the one place that knows the shape of
    ``engine.stats()`` (a dict of gauges). Must run on the engine's thread."""
    s = engine.stats()
    gauges = EngineGauges(
        num_running=int(s["num_running"]), num_waiting=int(s["num_waiting"]), num_swapped=int(s["num_swapped"]),
        num_gpu_blocks=int(s["num_gpu_blocks"]), num_free_gpu_blocks=int(s["num_free_gpu_blocks"]),
        kv_cache_usage=float(s["gpu_cache_usage"]), cpu_cache_usage=float(s["cpu_cache_usage"]))
    return EngineStats(engine.counters(), gauges)


class _EngineCollector(Collector):
    """Turns the latest :class:`EngineStats` snapshot into gauges and counters at scrape time."""

    def __init__(self, model_name: str, snapshot):
        self.model_name = model_name
        self.snapshot = snapshot  # a callable returning the latest EngineStats

    def collect(self) -> Iterator[Metric]:
        stats: EngineStats = self.snapshot()
        c, g, name = stats.counters, stats.gauges, self.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])  # exposed as <metric>_total
            family.add_metric([name], value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", g.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", c.preemptions)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", c.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", c.prefix_cache_hits)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generated_tokens)

        docs = field_docs()
        for f in fields(c):
            yield counter(f"reference_engine:{f.name}", docs.get(f.name, f.name), getattr(c, f.name))

        yield gauge("reference_engine:num_requests_swapped", "Requests swapped out to the host pool.", g.num_swapped)
        yield gauge("reference_engine:num_gpu_blocks", "Device KV blocks in the pool.", g.num_gpu_blocks)
        yield gauge("reference_engine:num_free_gpu_blocks", "Device KV blocks free (evictable cached ones count).",
                    g.num_free_gpu_blocks)
        yield gauge("reference_engine:cpu_cache_usage_perc", "Host (swap) KV pool usage, 0..1.", g.cpu_cache_usage)


class ServerMetrics:
    """The server's metrics: the engine's numbers from snapshots (:class:`EngineStats`), request numbers
    (latencies, prompt tokens, finish reasons) observed as they happen.

    ``observe_*`` methods are thread safe (prometheus_client's own locks) and may be called from the
    engine thread.
    """

    def __init__(self, model_name: str, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 snapshot):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name, self._snapshot = model_name, snapshot
        self.registry.register(_EngineCollector(model_name, snapshot))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):  # present from the start, as vLLM's are
            self._success.labels(model_name, reason)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r).labels(model_name)
        info = {
            "model_name": model_name,
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_cpu_blocks": str(num_cpu_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "preemption_mode": config.preemption_mode,
            "max_num_seqs": str(config.max_num_seqs),
            "max_num_batched_tokens": str(config.max_num_batched_tokens),
            "enable_chunked_prefill": str(config.enable_chunked_prefill),
            "scheduling_policy": config.scheduling_policy,
            "max_model_len": str(config.max_model_len),
            "swap_space": str(config.swap_space),
        }
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)

    def renewed(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> ServerMetrics:
        """Metrics for another engine of the same server (a reconfigure): the same model name and snapshot
        source, the new knobs, every request metric (histograms, finish reasons, prompt tokens) at zero."""
        return ServerMetrics(self.model_name, config, num_gpu_blocks, num_cpu_blocks, self._snapshot)

    def observe_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
