"""Adapter ``hf-cb``: transformers' continuous batching (``transformers.generation.continuous_batching``).

What the engine is (transformers 5.24, read from its source): ``model.init_continuous_batching`` builds a
``ContinuousBatchingManager`` whose background thread loops ``prepare_next_batch -> forward -> update_batch``
over a ``PagedAttentionCache`` (one flat tensor cut into *sectors*, each cut into *blocks*; a block holds
``page_size`` tokens for every layer, so one block = one vLLM block). The scheduler (``fifo``: decodes
first; ``prefill_first``: split prefills first) packs requests into a token budget; a prompt longer than
the remaining budget is split across steps (chunked prefill, always on). Below ``safety_margin`` free
cache (fifo default 0.15) only decodes and at most one prefill are scheduled. With ``allow_block_sharing``
a full block is hashed (chained from its parent's hash) after its forward pass, de-duplicated against
identical blocks, and kept as a cached block when its request finishes; a pending request's prompt is
matched block by block against them (prefix caching; never the whole prompt). Requests prefilled in the
same step cannot hit each other's blocks (they are not hashed yet): their duplicates are merged after the
forward, which saves memory but no compute and is not counted as a hit.

When the cache is full: ``ContinuousBatchProcessor.prepare_next_batch`` calls
``OffloadingManager.offload_requests`` when ``schedule_batch`` returns ``None`` (nothing fits) or some
active requests were *starved* of a block. It first evicts every cached prefix block, then pops victims
off the starved list (scheduling order, so the most recently admitted first) until the rest fit, always
leaving one active request. A victim is copied to the pinned CPU swap pool if one exists and has room
(*CPU offload*, = vLLM swap) or else *soft reset*: its blocks are freed uncached (``no_cache=True``) and it
is requeued as a new request whose prompt is prompt + generated tokens
(``RequestState.create_equivalent_initial_request``, = vLLM recompute; the output stitches the two back
together). After an offload no waiting request is admitted until some request finishes
(``scheduler.block_new_requests``); CPU-offloaded requests are then interleaved with fresh ones, first.
If nothing can be scheduled and nothing can be offloaded (the one remaining active request needs more
blocks than the pool has) ``prepare_next_batch`` raises ``RuntimeError("No requests can be scheduled and
no requests can be offloaded.")``; ``_handle_critical_error`` then fails *every* request still in flight,
bystanders included, and the manager accepts no more requests.

Knob mapping (kvbench :class:`Knobs` -> ``ContinuousBatchingConfig``)::

    Knobs field             hf-cb                               notes
    ----------------------  ----------------------------------  -----------------------------------------
    block_size              page_size                           tokens per block; engine minimum 4
    num_gpu_blocks          num_blocks                          capacity target, rounded up to whole
                                                                sectors (one sector = one block for
                                                                Llama float32); the actual number is in
                                                                ``evidence``
    num_cpu_blocks          cpu_offload_space (GiB)             num_cpu_blocks * bytes per block
    preemption_mode         cpu_offload_space                   "recompute": 0 GiB, soft reset only;
                                                                "swap": > 0 GiB (needs num_cpu_blocks or
                                                                option cpu_offload_gib), soft reset when
                                                                the pool is full (a swap fallback);
                                                                "swap" is refused on CPU (see below)
    max_num_seqs            max_requests_per_batch              caps requests per forward; requests not in
                                                                the batch may still hold KV blocks
    max_num_batched_tokens  max_batch_tokens                    token budget per forward
    enable_prefix_caching   allow_block_sharing                 prefix sharing only if every attention
                                                                type supports it (all-full-attention
                                                                Llama does)
    enable_chunked_prefill  (always on)                         True accepted; False unsupported
    scheduling_policy       scheduler_type                      "fcfs" accepted (fifo or prefill_first
                                                                from option ``scheduler``); "priority"
                                                                unsupported
    max_model_len           (none)                              unsupported: no per-request length cap

``swap`` on CPU: ``OffloadingManager.__init__`` allocates its pool with ``torch.empty(..., pin_memory=True)``,
which a CPU-only torch build rejects ("pin_memory=True requires a CUDA or other accelerator backend"), so
the adapter refuses ``preemption_mode="swap"`` / ``num_cpu_blocks`` on device ``cpu`` and declares the
``swap`` capability only for ``device=cuda`` (read from the code; not exercised by this project's CPU tests).

What the engine exposes: per request, a ``GenerationOutput`` (tokens, status FINISHED/FAILED, error
string, ``lifespan`` = (left pending, finished), per-token ``timestamps`` with ``record_timestamps``),
streamed per token with ``streaming=True``; ``cancel_request(id)``; log lines on the logger
``ContinuousBatchingLogger``: at INFO ``Offloaded {n} requests ({c} to CPU, {s} soft reset): {k} starved
requests remain.``, ``Paged cache initialized: ...``, ``CPU swap pool initialized: ...``; at DEBUG prefix
matches, cached-block evictions and CPU restores. The adapter reads that logger at DEBUG while it runs
(filtering the logger's own handlers back to their previous level), counts what the lines say for the
cross-check and quotes the INFO ones in ``GenResult.evidence``.

What it does NOT expose (no counters, no metrics object, no per-step statistics, no event callbacks,
no per-request preemption count, no queue lengths, no KV usage, no token counts). kvbench gets those
with a *probe* (:mod:`kvbench.engines.hf.probe`) that wraps six methods of the engine's own
instances and reads their state: white-box, written for transformers 5.24, every hook guarded (a
missing or changed internal makes its counters ``None`` with a note, never a crashed run), an
"untested transformers version" note outside 5.24, and its counts cross-checked against the engine's
own log lines (a disagreement makes the counter ``None``). Counters follow the contract
(:mod:`kvbench.core.counters`): ``preemptions_recompute`` (soft resets), ``preemptions_swap`` (=
``swap_outs``, CPU offloads), ``swap_ins`` (restores), ``swap_fallbacks`` (soft resets while a CPU
pool exists), ``swapped_out_bytes`` / ``swapped_in_bytes``, ``prefix_cache_queries`` /
``prefix_cache_hits`` (tokens, only with prefix sharing on), ``prefill_chunks`` (scheduled prefill
pieces that did not finish their prompt: k pieces count k - 1), ``computed_tokens`` (query tokens
scheduled), ``recomputed_tokens`` (computed + prefix hits - (prompt + generated - 1) per request),
``leaked_blocks`` (blocks still in a request's block table after the loop stopped) and
``num_gpu_blocks``; ``generated_tokens``, ``aborts``, ``swap_seconds`` and ``num_cpu_blocks`` are not
exposed. Also per-request ``num_preemptions``, and in ``serve`` the admission, preemption, resume and
step records (``kv_usage`` = 1 - ``cache.compute_free_capacity()``, so cached prefix blocks count as
used). Not observed even by the probe: cached-block evictions (a DEBUG line only), the post-forward
de-duplication of identical blocks, and the KV bytes a soft reset drops (they are not copied anywhere;
their recomputation is what ``recomputed_tokens`` counts).

Sampling: ``do_sample`` and temperature/top-k/top-p are per manager, and the only seed is
``ContinuousBatchingConfig.seed`` (``torch.manual_seed`` once per run; samples then depend on batch
composition), so one call's requests must share their sampling parameters, per-request seeds are not
honoured and ``sampling`` is not a capability. The adapter runs each session inside
``torch.random.fork_rng`` so the engine's ``manual_seed`` does not leak into the caller.

``ignore_eos``: a request's ``eos_token_id=-1`` (the engine ignores negative ids) disables stopping
without masking EOS, so exactly ``max_tokens`` tokens come back. ``serve`` always ignores EOS.

Costs to know on CPU: leave ``num_gpu_blocks`` unset and the engine sizes the cache to 60% of memory and
fills an attention mask of ``max_batch_tokens x (cache tokens + max_batch_tokens)`` at every start (a
slow start on CPU); ``ContinuousBatchingManager.stop`` runs ``gc.collect()`` twice, a pause that
``serve`` cannot keep out of the wall time between its last token and its return.

Observed on CPU (tiny preset, page_size 16, ``tests/kvbench/test_hf_adapters.py``): with a pool too small for
all requests at once, the engine soft-resets victims and the greedy outputs still equal ``hf``'s exactly
(chunked prefill and prefix hits too); a request that alone outgrows the pool while it is the only
active one kills the run, and every request still in flight comes back with ``finish_reason="error"``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbench.core.counters import Counters
from kvbench.core.trace import StepRecord
from kvbench.drivers.release import Release, ReleaseSchedule, record_arrival
from kvbench.engines.base import (
    DEFAULT_KNOBS,
    AdapterRefusal,
    EngineAdapter,
    GenOutput,
    GenRequest,
    GenResult,
    Knobs,
)
from kvbench.engines.hf.generate import check_device, eos_token_ids, load_model
from kvbench.engines.hf.probe import (
    OFFLOAD,
    SCHEDULE,
    UPDATE,
    LogCapture,
    Probe,
    cross_check,
    transformers_version_note,
)

if TYPE_CHECKING:
    from kvbench.core.requests import WorkloadRequest
    from kvbench.core.trace import TraceRecorder

_GIB = 1024**3
_SCHEDULERS = ("fifo", "prefill_first")


# ----------------------------------------------------------------------------------------------------------
# Knob mapping (pure: testable without a model)
# ----------------------------------------------------------------------------------------------------------


def bytes_per_block(model_config: Any, page_size: int, dtype_size: int = 4) -> int:
    """Bytes of one block: keys and values of ``page_size`` tokens for every layer (float32 by default)."""
    num_kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return model_config.num_hidden_layers * 2 * num_kv_heads * head_dim * dtype_size * page_size


def map_knobs(knobs: Knobs, options: dict[str, str], model_config: Any, device: str = "cpu"
              ) -> tuple[dict[str, Any], list[str]]:
    """Translate kvbench knobs (+ adapter options) into ``ContinuousBatchingConfig`` keyword arguments.

    Returns ``(kwargs, notes)``; ``notes`` are evidence lines explaining non-obvious choices. Raises
    ``ValueError`` naming the knob for anything the engine cannot do (see the module docstring table).
    """
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    if knobs.max_model_len is not None:
        raise ValueError(f"hf-cb: {HFContinuousBatchingAdapter.unsupported_knobs['max_model_len']}")
    if knobs.enable_chunked_prefill is False:
        raise ValueError(f"hf-cb: enable_chunked_prefill=False: "
                         f"{HFContinuousBatchingAdapter.unsupported_knobs['enable_chunked_prefill']}")
    if knobs.scheduling_policy not in (None, "fcfs"):
        raise ValueError(f"hf-cb: scheduling_policy={knobs.scheduling_policy!r}: "
                         f"{HFContinuousBatchingAdapter.unsupported_knobs['scheduling_policy']}")

    scheduler = options.get("scheduler", "fifo")
    if scheduler not in _SCHEDULERS:
        raise ValueError(f"hf-cb: option scheduler={scheduler!r}; allowed: {list(_SCHEDULERS)}")
    kwargs["scheduler_type"] = scheduler
    if "safety_margin" in options:
        kwargs["safety_margin"] = float(options["safety_margin"])

    page_size = 256  # ContinuousBatchingConfig's default
    if knobs.block_size is not None:
        if knobs.block_size < 4:
            raise AdapterRefusal("block_size", knobs.block_size,
                                 f"hf-cb: block_size={knobs.block_size}: the engine's page_size must be >= 4")
        page_size = kwargs["page_size"] = knobs.block_size
    if knobs.num_gpu_blocks is not None:
        if knobs.num_gpu_blocks < 1:
            raise AdapterRefusal("num_gpu_blocks", knobs.num_gpu_blocks,
                                 f"hf-cb: num_gpu_blocks={knobs.num_gpu_blocks}: must be >= 1")
        kwargs["num_blocks"] = knobs.num_gpu_blocks
    if knobs.max_num_batched_tokens is not None:
        kwargs["max_batch_tokens"] = knobs.max_num_batched_tokens
    if knobs.max_num_seqs is not None:
        kwargs["max_requests_per_batch"] = knobs.max_num_seqs
    if knobs.enable_prefix_caching is not None:
        kwargs["allow_block_sharing"] = knobs.enable_prefix_caching

    # CPU offload (swap) pool: explicit GiB option wins, else num_cpu_blocks converted to GiB.
    cpu_gib: float | None = None
    if "cpu_offload_gib" in options:
        cpu_gib = float(options["cpu_offload_gib"])
    elif knobs.num_cpu_blocks is not None:
        cpu_gib = knobs.num_cpu_blocks * bytes_per_block(model_config, page_size) / _GIB
    if knobs.preemption_mode not in (None, "recompute", "swap"):
        raise AdapterRefusal("preemption_mode", knobs.preemption_mode,
                             f"hf-cb: preemption_mode={knobs.preemption_mode!r}; allowed: 'recompute', 'swap'")
    if knobs.preemption_mode == "recompute":
        if cpu_gib:
            notes.append("hf-cb: preemption_mode=recompute: CPU offload pool disabled (num_cpu_blocks ignored)")
        cpu_gib = 0.0
    elif knobs.preemption_mode == "swap" and not cpu_gib:
        raise ValueError("hf-cb: preemption_mode='swap' needs a CPU offload pool: set num_cpu_blocks or "
                         "option cpu_offload_gib")
    if cpu_gib:
        if not device.startswith("cuda"):
            raise ValueError("hf-cb: CPU offload (preemption_mode='swap' / num_cpu_blocks) needs device=cuda: "
                             "transformers allocates the swap pool with pin_memory=True, which CPU-only torch "
                             "rejects")
        kwargs["cpu_offload_space"] = cpu_gib
        notes.append(f"hf-cb: CPU offload pool {cpu_gib * _GIB:.0f} bytes; victims that do not fit are soft reset")
    elif cpu_gib is not None:
        kwargs["cpu_offload_space"] = 0.0
    return kwargs, notes


# ----------------------------------------------------------------------------------------------------------
# The adapter
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sampling:
    do_sample: bool
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def _sampling_of(requests: Sequence[Any]) -> _Sampling:
    """The one sampling setup shared by all ``requests`` (the engine has one per manager)."""
    setups = {(float(getattr(r, "temperature", 0.0)), int(getattr(r, "top_k", 0) or 0),
               float(getattr(r, "top_p", 1.0))) for r in requests}
    if len(setups) > 1:
        raise ValueError(f"hf-cb: all requests of one run must share temperature/top_k/top_p (the engine "
                         f"samples per manager, not per request); got {sorted(setups)}")
    if not setups:
        return _Sampling(do_sample=False)
    temperature, top_k, top_p = setups.pop()
    if temperature <= 0:
        return _Sampling(do_sample=False)
    seeds = {r.seed for r in requests if getattr(r, "seed", None) is not None}
    # One seed per run (the smallest one given), not per request: see the module docstring.
    seed = min(seeds) if seeds else 0
    return _Sampling(True, temperature, top_k, top_p, seed)


@dataclass
class _Session:
    manager: Any
    probe: Probe
    logs: LogCapture
    notes: list[str]
    batch_processor: Any
    description: str = ""


#: why hf-cb cannot take reference_engine's admission-control knobs
_NO_ADMISSION_CONTROL = "hf-cb admits whatever its scheduler fits now; it has no admission control to configure"


class HFContinuousBatchingAdapter(EngineAdapter):
    """transformers continuous batching (see the module docstring for the mapping and what it exposes)."""

    kind = "hf-cb"
    #: on device=cuda an instance also declares "swap" (CPU offload needs pinned memory)
    capabilities = frozenset({"recompute", "prefix_caching", "chunked_prefill", "abort"})
    option_keys = {  # noqa: RUF012 - read-only class-level table
        "device": "cpu (default) or cuda[:N]",
        "attn_implementation": "transformers' default (sdpa), eager (run as paged|eager) or a flash one",
        "scheduler": "fifo (default: decodes first) or prefill_first",
        "safety_margin": "fraction of free cache under which no new prefill is scheduled (engine default "
                         "0.15 for fifo, 0.0 for prefill_first)",
        "cpu_offload_gib": "CPU offload (swap) pool in GiB, overriding num_cpu_blocks (cuda only)",
        "timeout_s": "wall-clock limit of one generate/serve call, seconds (default 600)",
    }
    unsupported_knobs = {  # noqa: RUF012
        "max_model_len": "hf-cb has no per-request length cap (max_blocks_per_request only sizes the "
                         "flash decode fast path)",
        "enable_chunked_prefill": "hf-cb always splits a prompt that exceeds the step's token budget; "
                                  "it cannot be turned off",
        "scheduling_policy": "hf-cb has no priorities: its fifo and prefill_first schedulers both admit "
                             "new requests in arrival order (only 'fcfs' is accepted)",
        "admission_policy": _NO_ADMISSION_CONTROL,
        "admission_headroom": _NO_ADMISSION_CONTROL,
        "prefill_pacing_tokens": "hf-cb fills each step's token budget; it has no pacing of prefills beside decodes",
    }
    no_length_limit = ("hf-cb (ContinuousBatchingManager, transformers 5.24) has no per-request length limit: "
                       "a prompt longer than max_position_embeddings is generated without an error "
                       "(scripts/findings/hf_cb_repro.py, case 2)")

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        """Option values checked as the adapter reads them (nothing is loaded): device, scheduler, numbers."""
        super().validate_options(options)
        check_device(options.get("device", "cpu"))
        if options.get("scheduler", "fifo") not in _SCHEDULERS:
            raise ValueError(f"hf-cb: option scheduler={options['scheduler']!r}; allowed: {list(_SCHEDULERS)}")
        for key, low, high in (("safety_margin", 0.0, 1.0), ("cpu_offload_gib", 0.0, math.inf),
                               ("timeout_s", 0.0, math.inf)):
            if key in options:
                try:
                    value = float(options[key])
                except ValueError:
                    value = math.nan
                if not (low <= value <= high) or (key == "timeout_s" and value == 0):
                    raise ValueError(f"hf-cb: option {key}={options[key]!r}; expected a number from {low} to {high}"
                                     + (" (not 0)" if key == "timeout_s" else ""))

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        super().__init__(model_dir, options, name)
        self.device = check_device(self.options.get("device", "cpu"))
        # None = transformers' default (sdpa), the same cache key as ``hf``'s: one model in memory for both
        self.attn_implementation = self.options.get("attn_implementation")
        self.timeout_s = float(self.options.get("timeout_s", 600))
        if self.device.startswith("cuda"):
            self.capabilities = type(self).capabilities | {"swap"}

    @property
    def model(self) -> Any:
        return load_model(self.model_dir, self.device, self.attn_implementation)

    # -- session ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, knobs: Knobs, sampling: _Sampling) -> Iterator[_Session]:
        """A started manager with the probe attached; stopped (hard) and torn down on exit."""
        import torch
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = self.model
        cb_kwargs, notes = map_knobs(knobs, self.options, model.config, self.device)
        cb_config = ContinuousBatchingConfig(seed=sampling.seed, **cb_kwargs)
        gen_kwargs: dict[str, Any] = {"do_sample": sampling.do_sample, "eos_token_id": -1}
        if sampling.do_sample:
            gen_kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                              top_p=sampling.top_p)
        gen_config = GenerationConfig(**gen_kwargs)
        rng_devices = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []

        logs = LogCapture()
        version_note = transformers_version_note()
        if version_note:
            notes = [*notes, version_note]
        with logs.attached(), torch.random.fork_rng(devices=rng_devices):
            manager = model.init_continuous_batching(generation_config=gen_config,
                                                     continuous_batching_config=cb_config)
            probe: Probe | None = None
            try:
                # warmup() builds the batch processor (cache, scheduler, offloading manager) on this
                # thread; start() then reuses it, so the probe is attached before the first step.
                manager.warmup()
                bp = manager.batch_processor
                probe = Probe(bp)
                manager.start()
                yield _Session(manager, probe, logs, notes, bp, self._describe_cache(bp))
            finally:
                # Hard stop: never wait for stragglers (after a timeout or an error there may be some).
                with contextlib.suppress(Exception):
                    manager.stop(block=True, timeout=30, hard_stop=True)
                with contextlib.suppress(Exception):
                    manager.destroy()
                if probe is not None:
                    probe.detach()

    def _describe_cache(self, bp: Any) -> str:
        """One evidence line: the configuration the engine actually resolved (read while it runs)."""
        cfg = bp.cb_config
        return (f"hf-cb: page_size={cfg.page_size} num_blocks={bp.cache.num_blocks} "
                f"(sectors={bp.cache.num_sectors}) max_batch_tokens={bp.cache.max_batch_tokens} "
                f"max_requests_per_batch={cfg.max_requests_per_batch} scheduler={cfg.scheduler_type} "
                f"safety_margin={bp.scheduler.safety_margin} prefix_sharing={bp.cache.use_prefix_sharing} "
                f"cpu_offload_space={cfg.cpu_offload_space} GiB "
                f"attn={self.model.config._attn_implementation} device={self.device}")

    def _eos_for(self, ignore_eos: bool) -> int | list[int]:
        if ignore_eos:
            return -1  # negative ids are dropped by RequestState: no stopping, EOS not masked
        eos = sorted(eos_token_ids(self.model))
        return eos if eos else -1

    # -- generate --------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        """Submit every request, then collect final outputs, in request order, with the probe's counters.

        A request the engine failed (e.g. the loop died because one request alone exceeds the pool)
        comes back with ``finish_reason="error"`` and the engine's message in ``evidence``.
        """
        _check_requests(requests)
        sampling = _sampling_of(requests)
        results: dict[str, Any] = {}
        with self._session(knobs, sampling) as session:
            manager = session.manager
            for r in requests:
                manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                    eos_token_id=self._eos_for(r.ignore_eos), streaming=False)
            deadline = time.monotonic() + self.timeout_s
            while len(results) < len(requests):
                out = manager.get_result(timeout=0.05)
                if out is None:
                    if not manager.is_running():
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"hf-cb: {len(requests) - len(results)} requests unfinished after "
                                           f"timeout_s={self.timeout_s}")
                    continue
                if out.is_finished():
                    results[out.request_id] = out
            fatal = manager.background_thread_status.fatal_error
        # The generation thread is joined now: the probe's statistics are final.
        eos = eos_token_ids(self.model)
        outputs, produced, evidence = [], {}, [session.description, *session.notes]
        for r in requests:
            out = results.get(r.request_id)
            tokens = list(out.generated_tokens) if out is not None else []
            produced[r.request_id] = (len(r.prompt_token_ids), len(tokens))
            reason = _finish_reason(out, r.ignore_eos, r.max_tokens, eos)
            error = (out.error if out is not None and out.error else
                     ("no output (the generation loop died)" if reason == "error" else None))
            outputs.append(GenOutput(r.request_id, tokens, reason,
                                     num_preemptions=self._preemptions_of(session, r.request_id), error=error))
            if out is not None and out.error:
                evidence.append(f"hf-cb: request {r.request_id} failed: {out.error}")
            elif out is None:
                evidence.append(f"hf-cb: request {r.request_id} never finished")
        if fatal is not None:
            evidence.append(f"hf-cb: generation loop died: {fatal!r}")
        counters, _, lines = _final_counters(session, produced)
        if counters.preemptions_recompute is None or counters.preemptions_swap is None:
            for output in outputs:  # per-request counts come from the same hook: not trusted either
                output.num_preemptions = None
        evidence += lines
        evidence += session.logs.evidence()
        return GenResult(outputs=outputs, counters=counters, evidence=evidence)

    def _preemptions_of(self, session: _Session, request_id: str) -> int | None:
        if OFFLOAD in session.probe.missing:
            return None
        return session.probe.stats.per_request_preemptions[request_id]

    # -- serve -----------------------------------------------------------------------------------------

    def serve(self, workload: Any, recorder: TraceRecorder, knobs: Knobs = DEFAULT_KNOBS) -> None:
        """Serve a timed workload on the wall clock, recording to ``recorder`` from this thread only.

        ``workload`` is duck-typed: ``.requests`` (each with ``request_id``, ``prompt_token_ids``,
        ``max_tokens``, ``arrival_time``, ``priority``, ``abort_at``, ``temperature``, ``seed``) and
        ``.concurrency`` (closed loop when not None: that many requests in flight, arrival times
        ignored, each released when one finishes). EOS is always ignored. ``abort_at`` (seconds after
        arrival) cancels the request through ``cancel_request`` and records it finished with reason
        ``"abort"``. Priorities are recorded but not honoured (no priority scheduling).
        """
        requests = list(getattr(workload, "requests", workload))
        _check_requests(requests)
        concurrency = getattr(workload, "concurrency", None)
        # the release order of kvbench.drivers.release (closed-loop arrivals are all 0: workload order)
        order = sorted(requests, key=lambda r: r.arrival_time)
        try:  # the schedule checks the concurrency: before the model loads, in the adapter's name
            schedule = ReleaseSchedule(order, concurrency)
        except ValueError as e:
            raise ValueError(f"hf-cb: workload {e}") from None
        sampling = _sampling_of(requests)

        with self._session(knobs, sampling) as session:
            _Server(session, recorder, order, schedule, self.timeout_s).run()
        produced = {rid: (r.prompt_len, len(r.token_times)) for rid, r in recorder.trace.requests.items()}
        counters, recomputed, lines = _final_counters(session, produced)
        for rid in produced:
            recorder.add_request_counts(rid, recomputed_tokens=recomputed.get(rid, 0),
                                        prefix_hit_tokens=session.probe.stats.per_request_hits[rid])
        recorder.set_counters(counters)
        for name, why in session.probe.missing.items():
            what = {SCHEDULE: "admitted", OFFLOAD: "preemptions", UPDATE: "per_step"}.get(name, name)
            recorder.not_exposed(what, f"hf-cb probe hook {name} unavailable: {why}")
        # A counter the probe could not count, or that the engine's log contradicted, must not be
        # rebuilt from per-request records either (they come from the same hooks).
        for name, value in counters.to_dict().items():
            why = [line for line in lines if value is None and name in line
                   and line.startswith(("hf-cb probe:", "hf-cb cross-check FAILED"))]
            if why:
                recorder.not_exposed(name, why[0])


class _Server:
    """The serve loop: release, abort, drain engine events and streamed outputs, all on one thread.

    Which request goes out when, and when one is aborted, is :class:`~kvbench.drivers.release.ReleaseSchedule`'s
    rule on the wall clock (the recorder's seconds), polled between waits for the engine's outputs, as
    the step loop polls it between steps. ``order`` is the workload in that rule's release order.
    """

    def __init__(self, session: _Session, recorder: TraceRecorder, order: list[WorkloadRequest],
                 schedule: ReleaseSchedule, timeout_s: float):
        """``schedule``: a fresh :class:`ReleaseSchedule` of ``order`` (nothing released yet)."""
        self.session, self.recorder, self.order = session, recorder, order
        self.schedule, self.timeout_s = schedule, timeout_s
        self.concurrency = schedule.concurrency
        self.released = 0  # how many of ``order`` the schedule let out (it releases them in that order)
        self.in_flight: dict[str, WorkloadRequest] = {}  # accepted by the engine, not yet finished or aborted
        self.produced: dict[str, int] = {}
        self.offset = 0.0  # recorder time = perf_counter + offset

    def to_trace_time(self, perf_t: float) -> float:
        return perf_t + self.offset

    def run(self) -> None:
        manager, recorder, schedule = self.session.manager, self.recorder, self.schedule
        recorder.restart_clock()
        self.offset = recorder.now() - time.perf_counter()
        last_arrival = max((r.arrival_time for r in self.order), default=0.0) if self.concurrency is None else 0.0
        deadline = last_arrival + self.timeout_s
        while not schedule.done:
            now = recorder.now()
            if now > deadline:
                raise TimeoutError(f"hf-cb serve: {len(schedule.in_flight)} requests in flight after timeout_s="
                                   f"{self.timeout_s}")
            for release in schedule.release_due(now):
                self._release(release)
            for rid in schedule.aborts_due(now):
                manager.cancel_request(rid)
                recorder.finished(rid, now, "abort")
                self._finished(rid)
            self._drain_events()
            if not manager.is_running():
                self._fail_all(self.order[self.released:])
                break
            wait = 0.01
            if (next_point := schedule.next_point()) is not None:  # open loop: wake for the next arrival
                wait = max(0.0, min(wait, next_point - now))
            out = manager.get_result(timeout=wait)
            while out is not None:
                self._on_output(out)
                out = manager.get_result(timeout=0)
        self._drain_events()

    def _release(self, release: Release) -> None:
        request, rid = release.request, release.request_id
        self.released += 1
        record_arrival(self.recorder, request, release.at)
        added = self.session.manager.add_request(list(request.prompt_token_ids), request_id=rid,
                                                 max_new_tokens=request.max_tokens, eos_token_id=-1,
                                                 streaming=True, record_timestamps=True)
        if added is None:  # the manager refused it (its loop is stopping or died)
            self.recorder.finished(rid, self.recorder.now(), "error")
            self.schedule.finished(rid)  # a refused request holds no slot
            return
        self.in_flight[rid] = request
        self.produced[rid] = 0

    def _finished(self, rid: str) -> None:
        """``rid`` is over (finished, aborted or failed): later events and outputs for it are ignored."""
        del self.in_flight[rid]
        self.schedule.finished(rid)

    def _drain_events(self) -> None:
        events = self.session.probe.events
        while True:
            try:
                event = events.get_nowait()
            except queue.Empty:
                return
            kind = event[0]
            if kind == "step":
                record: StepRecord = event[1]
                record.t = self.to_trace_time(record.t)
                self.recorder.step(record)
                continue
            rid, t = event[1], self.to_trace_time(event[2])
            if rid not in self.in_flight:  # finished or aborted already
                continue
            if kind == "admitted":
                self.recorder.admitted(rid, t)
            elif kind == "preempted":
                self.recorder.preempted(rid, t, event[3])
            elif kind == "resumed":
                self.recorder.resumed(rid, t)

    def _on_output(self, out: Any) -> None:
        rid = out.request_id
        if rid not in self.in_flight:  # tokens streamed before a cancel took effect
            return
        now = self.recorder.now()
        tokens = len(out.generated_tokens)
        new = tokens - self.produced[rid]
        if new > 0:
            stamps = out.timestamps or []
            # The engine stamps each token as it is appended; a soft reset starts a new stamp list, so
            # take the last ``new`` stamps when there are enough, else the time we received them.
            times = ([self.to_trace_time(s) for s in stamps[-new:]] if len(stamps) >= new else [now] * new)
            for t in times:
                self.recorder.tokens(rid, min(t, now))
            self.produced[rid] = tokens
        if out.is_finished():
            request = self.in_flight[rid]
            reason = "error" if out.error else "length" if tokens >= request.max_tokens else "stop"
            self.recorder.finished(rid, now, reason)
            self._finished(rid)

    def _fail_all(self, unreleased: list[WorkloadRequest]) -> None:
        """The loop died: every request in flight or not yet released finishes with ``"error"``."""
        # Outputs already queued (the engine delivers FAILED outputs before its thread exits) come first.
        out = self.session.manager.get_result(timeout=0)
        while out is not None:
            self._on_output(out)
            out = self.session.manager.get_result(timeout=0)
        now = self.recorder.now()
        for rid in list(self.in_flight):
            self.recorder.finished(rid, now, "error")
            self._finished(rid)
        for request in unreleased:
            record_arrival(self.recorder, request, now)
            self.recorder.finished(request.request_id, now, "error")
        fatal = self.session.manager.background_thread_status.fatal_error
        self.recorder.not_exposed("completion", f"hf-cb generation loop stopped early: {fatal!r}")


def _final_counters(session: _Session, produced: dict[str, tuple[int, int]]
                    ) -> tuple[Counters, dict[str, int], list[str]]:
    """The probe's counters, cross-checked against the engine's log lines: (counters, per-request
    recomputed tokens, evidence lines). Call after the generation thread has been joined."""
    probe = session.probe
    counters, recomputed, notes = probe.counters(produced)
    counters, checked = cross_check(counters, session.logs.counts, prefix_sharing=probe.prefix_sharing(),
                                    cpu_pool=probe.has_cpu_pool())
    if counters.recomputed_tokens is None:
        recomputed = {}
    lines = [f"hf-cb probe: {probe.stats.num_steps} engine steps, peak KV usage {probe.stats.peak_kv_usage:.0%}",
             *(f"hf-cb probe: hook {name} unavailable: {why}" for name, why in probe.missing.items()),
             *notes, *checked]
    if session.logs.dropped_lines:
        lines.append(f"hf-cb: {session.logs.dropped_lines} log lines beyond the first few thousand not kept "
                     f"(still counted)")
    return counters, recomputed, lines


def _finish_reason(out: Any, ignore_eos: bool, max_tokens: int, eos: set[int]) -> str:
    """kvbench's finish reason for a final ``GenerationOutput`` (None = never came back)."""
    if out is None or out.error is not None or not out.is_finished():
        return "error"
    tokens = out.generated_tokens
    if not ignore_eos and tokens and tokens[-1] in eos:
        return "stop"
    return "length"


def _check_requests(requests: Sequence[Any]) -> None:
    """Unique ids, non-empty prompts, max_tokens >= 1: the engine would fail later and less clearly."""
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"hf-cb: duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)
        if not r.prompt_token_ids:
            raise ValueError(f"hf-cb: request {r.request_id!r} has an empty prompt")
        if r.max_tokens < 1:
            raise ValueError(f"hf-cb: request {r.request_id!r}: max_tokens must be >= 1, got {r.max_tokens}")

