"""Prometheus metrics with vLLM's names and meanings, plus ``reference_engine:`` extras.

Every metric carries the label ``model_name`` (the served model name), as vLLM's do. Each server has
its own ``CollectorRegistry``, never the process-global one, so two servers (or tests) in one process
do not mix their numbers.

vLLM's names (meanings as in vLLM v1's ``v1/metrics/loggers.py``):

=====================================  =========  ====================================================
vllm:num_requests_running              gauge      requests in the running queue
vllm:num_requests_waiting              gauge      requests waiting to be scheduled
vllm:kv_cache_usage_perc               gauge      fraction of device KV blocks in use, 0..1 (1 = 100%)
vllm:num_preemptions_total             counter    preemptions, every mode
vllm:prefix_cache_queries_total        counter    prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total           counter    of those, tokens found cached
vllm:prompt_tokens_total               counter    prompt tokens of requests that produced output
vllm:generation_tokens_total           counter    tokens generated
vllm:request_success_total             counter    finished requests, label ``finished_reason``
vllm:time_to_first_token_seconds       histogram  arrival at the server -> first token
vllm:inter_token_latency_seconds       histogram  time between consecutive tokens of a request
vllm:cache_config_info                 gauge = 1  the knobs, as labels
=====================================  =========  ====================================================

``vllm:cache_config_info`` has vLLM's labels (``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``,
``enable_prefix_caching``) and, so a client can read every knob that shapes preemption, this
engine's ``preemption_mode``, ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``,
``scheduling_policy``, ``max_model_len`` and ``swap_space``.

Extras (no vLLM equivalent): ``reference_engine:num_requests_swapped``, ``reference_engine:num_gpu_blocks``,
``reference_engine:num_free_gpu_blocks``, ``reference_engine:cpu_cache_usage_perc``, and the counters
``reference_engine:preemptions_total{mode}``, ``reference_engine:swap_outs_total`` and
``reference_engine:swap_ins_total`` (requests whose KV went device -> host / host -> device, as
``engine.stats()`` counts them: the contract's ``swap_outs``/``swap_ins``),
``reference_engine:swap_out_blocks_total``, ``reference_engine:swap_in_blocks_total`` (blocks),
``reference_engine:swapped_out_bytes_total``, ``reference_engine:swapped_in_bytes_total``,
``reference_engine:swap_seconds_total``, ``reference_engine:swap_fallbacks_total``,
``reference_engine:recomputed_tokens_total``, ``reference_engine:prefill_chunks_total``,
``reference_engine:computed_tokens_total``, ``reference_engine:engine_steps_total``.

Engine-side numbers are read on the engine's own thread (``read_engine_stats``, after each step) into
an immutable snapshot; a scrape only reads the latest snapshot, so ``/metrics`` never touches the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reference_engine.config import EngineConfig

# vLLM v1's buckets for TTFT and inter-token latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)


@dataclass(frozen=True)
class EngineStats:
    """What the server reads from the engine, one definition per number (see the module table)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    kv_cache_usage: float = 0.0
    cpu_cache_usage: float = 0.0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    swap_outs: int = 0  # requests, not blocks
    swap_ins: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_seconds: float = 0.0
    swap_fallbacks: int = 0
    recomputed_tokens: int = 0
    prefill_chunks: int = 0
    computed_tokens: int = 0
    steps: int = 0


def read_engine_stats(engine) -> EngineStats:
    """The one place that knows the shape of ``engine.stats()`` (a dict today): adapt here if it changes.

    Must run on the engine's thread. Swapped blocks come from bytes: the engine counts swap-outs per
    request, and a block is always ``kv_cache.block_bytes`` bytes.
    """
    s = engine.stats()
    block_bytes = engine.kv_cache.block_bytes or 1
    return EngineStats(
        num_running=int(s["num_running"]), num_waiting=int(s["num_waiting"]), num_swapped=int(s["num_swapped"]),
        num_gpu_blocks=int(s["num_gpu_blocks"]), num_free_gpu_blocks=int(s["num_free_gpu_blocks"]),
        kv_cache_usage=float(s["gpu_cache_usage"]), cpu_cache_usage=float(s["cpu_cache_usage"]),
        preemptions_recompute=int(s["num_preemptions_recompute"]), preemptions_swap=int(s["num_preemptions_swap"]),
        prefix_cache_queries=int(s["prefix_cache_queries"]), prefix_cache_hits=int(s["prefix_cache_hits"]),
        swap_outs=int(s["num_swap_outs"]), swap_ins=int(s["num_swap_ins"]),
        swap_out_blocks=int(s["swapped_out_bytes"]) // block_bytes,
        swap_in_blocks=int(s["swapped_in_bytes"]) // block_bytes,
        swapped_out_bytes=int(s["swapped_out_bytes"]), swapped_in_bytes=int(s["swapped_in_bytes"]),
        swap_seconds=float(s["swap_seconds"]), swap_fallbacks=int(s["num_swap_fallbacks"]),
        recomputed_tokens=int(s["num_recomputed_tokens"]),
        prefill_chunks=int(s["num_prefill_chunks"]), computed_tokens=int(s["num_computed_tokens"]),
        steps=int(s["num_steps"]),
    )


class _EngineCollector(Collector):
    """Turns the latest ``EngineStats`` snapshot into gauges and counters at scrape time."""

    def __init__(self, model_name: str, snapshot):
        self.model_name = model_name
        self.snapshot = snapshot  # a callable returning the latest EngineStats

    def collect(self) -> Iterator[Metric]:
        s: EngineStats = self.snapshot()
        name = self.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                      s.preemptions_recompute + s.preemptions_swap)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits)

        yield gauge("reference_engine:num_requests_swapped", "Requests swapped out to the host pool.", s.num_swapped)
        yield gauge("reference_engine:num_gpu_blocks", "Device KV blocks in the pool.", s.num_gpu_blocks)
        yield gauge("reference_engine:num_free_gpu_blocks", "Device KV blocks free (evictable cached ones count).",
                    s.num_free_gpu_blocks)
        yield gauge("reference_engine:cpu_cache_usage_perc", "Host (swap) KV pool usage, 0..1.", s.cpu_cache_usage)
        by_mode = CounterMetricFamily("reference_engine:preemptions", "Preemptions by mode.",
                                      labels=["model_name", "mode"])
        by_mode.add_metric([name, "recompute"], s.preemptions_recompute)
        by_mode.add_metric([name, "swap"], s.preemptions_swap)
        yield by_mode
        yield counter("reference_engine:swap_outs", "Requests whose KV blocks were copied device -> host.",
                      s.swap_outs)
        yield counter("reference_engine:swap_ins", "Requests whose KV blocks were copied host -> device on resume.",
                      s.swap_ins)
        yield counter("reference_engine:swap_out_blocks", "KV blocks copied device -> host.", s.swap_out_blocks)
        yield counter("reference_engine:swap_in_blocks", "KV blocks copied host -> device.", s.swap_in_blocks)
        yield counter("reference_engine:swapped_out_bytes", "Bytes copied device -> host.", s.swapped_out_bytes)
        yield counter("reference_engine:swapped_in_bytes", "Bytes copied host -> device.", s.swapped_in_bytes)
        yield counter("reference_engine:swap_seconds", "Wall seconds spent copying KV between the pools.",
                      s.swap_seconds)
        yield counter("reference_engine:swap_fallbacks",
                      "Swap preemptions that fell back to recompute (host pool full).", s.swap_fallbacks)
        yield counter("reference_engine:recomputed_tokens",
                      "Tokens whose KV was computed again after a preemption.", s.recomputed_tokens)
        yield counter("reference_engine:prefill_chunks", "Prefill chunks scheduled.", s.prefill_chunks)
        yield counter("reference_engine:computed_tokens", "Tokens whose KV was computed (incl. recompute).",
                      s.computed_tokens)
        yield counter("reference_engine:engine_steps", "Engine steps taken.", s.steps)


class ServerMetrics:
    """The server's metrics: engine numbers from snapshots, request numbers observed as they happen.

    ``observe_*`` methods are thread safe (prometheus_client's own locks) and may be called from the
    engine thread.
    """

    def __init__(self, model_name: str, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 snapshot):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
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
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(model_name)
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

    def observe_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
