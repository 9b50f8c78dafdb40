"""Deliberately broken reference engines: each breaks exactly one property a conformance check is
about, so that a test can show the check failing on it (a check that cannot fail proves nothing).

Not a registered kind, so it never shows in the list of engines; name it by import path::

    pytest suites/conformance --engine "kvbench.conformance.faults:FaultyReferenceAdapter:fault=fcfs_oldest_victim"

Each fault is a small patch applied to a fresh ``LLMEngine`` (its scheduler, block manager, KV cache,
request intake or stats) or to the configuration it is built from, never to the results kvbench reads
back; the engine is otherwise the reference engine, unchanged.

The same faults inside the reference server, for the checks that run over HTTP::

    pytest suites/conformance --engine "kvbench.conformance.faults:FaultyServerAdapter:fault=leaks_block"

:class:`FaultyServerAdapter` can also change its fault while its server runs (:meth:`~FaultyServerAdapter.use_fault`):
the server builds a fresh engine with the next fault in place, so a test module serves fault after fault
from one server instead of starting one per fault.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.engines.http.server import ServerAdapter
from kvbench.engines.inprocess.reference import ReferenceAdapter

#: fault -> the property it breaks (the check that must catch it). Every fault is in the engine: a
#: patch of the ``LLMEngine`` the adapter builds (its scheduler, block manager, KV cache, request intake,
#: stats) or of the configuration it is given, never of the results kvbench reads back.
FAULTS: dict[str, str] = {
    "miscomputes_one_position": "the token sampled at the 48th position of every sequence is off by one (the "
                                "unpressured run, and with it every equivalence check)",
    "corrupts_recomputed_output": "the first token sampled after a recompute resume is off by one (check 1)",
    "scrambles_swap_in": "swap-in copies KV blocks into each other's places (checks 2, 2b)",
    "ignores_prefix_caching": "enable_prefix_caching is silently off: nothing is ever reused (check 3)",
    "serves_stale_cached_blocks": "a prefix-cache hit serves its last block with the KV values lost (check 3: "
                                  "on != off)",
    "undercounts_prefix_hits": "the prefix-cache hit counter counts half of each admission's hit (check 3: its "
                               "responses' cached tokens and the shared prefixes' floor disagree with it)",
    "counts_prefix_hits_per_retry": "an admission that waits for room counts its prefix-cache hit again at each "
                                    "retry (checks 3b and 11: more hits than the requests can give, once per "
                                    "admission)",
    "ignores_token_budget": "max_num_batched_tokens is ignored, so no prefill is ever split (check 4)",
    "never_aborts": "abort_request is accepted but does nothing (check 6)",
    "ignores_early_abort": "an abort that arrives before a request's first token is accepted but does nothing "
                           "(an abort before the first token)",
    "fails_mid_stream": "the fifth step that gives out tokens and finishes no request raises once it has given "
                        "them, failing every request in flight mid-stream (tokens before an error: a server must "
                        "deliver those tokens ahead of its error event)",
    "aborts_preemption_victims": "a request preempted by recompute is aborted instead of resumed (checks 1, 6)",
    "finishes_twice": "a finished request is reported finished again on the next step (check 6)",
    "leaks_block": "the first request released with device blocks (finished or aborted) keeps them (check 6)",
    "ignores_seed": "per-request seeds are dropped at intake (check 7)",
    "truncates_over_long_prompts": "a prompt past max_model_len is cut to fit and run instead of refused (check 8)",
    "vague_rejection": "a refused request's error does not say why (check 8)",
    "drops_unswappable_victims": "a victim the host pool cannot take is aborted, not recomputed (check 8)",
    "vague_config_error": "an invalid configuration is refused without naming the field (check 8)",
    "uncounted_swap_fallbacks": "a swap the host pool could not take is recomputed without counting the fallback "
                                "(check 8)",
    "fcfs_oldest_victim": "under FCFS the oldest running request is preempted, not the latest (check 9)",
    "priority_most_important_victim": "under the priority policy the most important running request is preempted",
    "ignores_stop_token_ids": "stop_token_ids are dropped at intake (stop conditions)",
    "ignores_eos": "EOS never ends a request, even with ignore_eos=False (stop conditions)",
    "overruns_max_tokens": "a request gets one token more than its max_tokens (stop conditions)",
    "recomputed_counter_frozen": "the recomputed-token counter never moves (metrics truth)",
    "preemptions_without_swaps": "per-request preemption counts leave out swap preemptions (metrics truth)",
    "overcounts_generated_tokens": "the generated-token counter counts one token too many per step (counts told "
                                   "twice)",
    "preemptions_total_misses_a_mode": "the engine's preemption total leaves out its recompute preemptions, so the "
                                       "server's vllm:num_preemptions_total disagrees with its by-mode counts "
                                       "(counts told twice, over HTTP: in process no total is read)",
    "admission_ignores_headroom": "the watermark admission gate projects against the whole pool, ignoring "
                                  "admission_headroom (check 12)",
    "livelock": "after 20 steps the engine stops scheduling anything, forever (liveness)",
    "prefix_hit_takes_no_reference": "a prefix-cache hit on a block another running request holds shares it without "
                                     "taking a reference, so the first holder's release frees it under the other "
                                     "(check 5 from outside: refcount safety)",
    "starves_requests_at_max_model_len": "a request whose prompt and max_tokens reach max_model_len is never "
                                         "admitted (an off-by-one in the admission gate), so it waits forever (a "
                                         "request as long as the pool allows)",
    "drops_attention_bias": "the q/k/v projection's matmul leaves out its bias (on a checkpoint with attention "
                            "biases: the unpressured run, and with it every equivalence check)",
    "readmitted_holds_extra_blocks": "a request readmitted after a recompute preemption is given one block more "
                                     "than its tokens need (check 13)",
    "uncounted_auto_fallbacks": "under preemption_mode=auto, a swap the host pool could not take is recomputed "
                                "without counting it in swap_fallbacks or preemptions_recompute (checks 13, 8)",
}


def apply_fault(engine: Any, fault: str) -> None:
    """Patch ``fault`` into a built ``LLMEngine`` (in process, or inside the reference server:
    ``python -m kvbench.testing.patched_server --patch kvbench.conformance.faults:apply_fault=FAULT``).
    ValueError for a fault that is not a patch of a built engine (one in its configuration)."""
    patch = getattr(FaultyReferenceAdapter, f"_patch_{fault}", None)
    if patch is None:
        raise ValueError(f"fault={fault!r} is not a patch of a built engine; those are: "
                         f"{', '.join(sorted(engine_faults()))}")
    patch(engine)


def apply_fault_named_in(engine: Any, path: str) -> None:
    """:func:`apply_fault` with the fault the file ``path`` holds when ``engine`` is built: a server patched with
    ``--patch kvbench.conformance.faults:apply_fault_named_in=PATH`` builds each new engine (at a reconfigure)
    with whatever fault a test wrote there last."""
    apply_fault(engine, Path(path).read_text(encoding="utf-8").strip())


#: the counters record type of fault ``preemptions_total_misses_a_mode``: the engine's own, with a total of swap
#: preemptions only (made on first use, :func:`__getattr__`)
_TOTAL_WITHOUT_RECOMPUTE = "CountersTotalWithoutRecompute"


def _total_without_recompute(record: Any) -> Any:
    """``record`` (an engine's ``EngineCounters``) with the same fields and a ``preemptions`` total that leaves
    out recompute preemptions."""
    return __getattr__(_TOTAL_WITHOUT_RECOMPUTE)(**record.as_dict())


def __getattr__(name: str) -> Any:
    """The record type of :func:`_total_without_recompute`, made on first use from the engine's record type
    (found among the loaded modules: this module imports nothing of the engine) and kept under this module's
    name, where the reference server's front end finds it when it unpickles the records its engine process
    sends."""
    if name != _TOTAL_WITHOUT_RECOMPUTE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    record_type = sys.modules["reference_engine.engine_counters"].EngineCounters
    made = type(name, (record_type,), {"__module__": __name__, "__qualname__": name,
                                       "preemptions": property(lambda self: self.preemptions_swap)})
    globals()[name] = made
    return made


def engine_faults() -> list[str]:
    """The faults of :data:`FAULTS` that are patches of a built engine (not of its configuration)."""
    return [f for f in FAULTS if hasattr(FaultyReferenceAdapter, f"_patch_{f}")]


class FaultyReferenceAdapter(ReferenceAdapter):
    """The reference engine with one deliberate fault (option ``fault``; see FAULTS)."""

    kind = "reference-faulty"
    option_keys = {**ReferenceAdapter.option_keys, "fault": "one of: " + ", ".join(FAULTS)}  # noqa: RUF012

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        fault = options.get("fault")
        if fault not in FAULTS:
            raise ValueError(f"option fault={fault!r} is invalid: expected one of {', '.join(FAULTS)}")
        super().validate_options({k: v for k, v in options.items() if k != "fault"})

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        options = dict(options or {})
        super().__init__(model_dir, options, name)
        self.fault = self.options.pop("fault")

    def build_engine(self, knobs: Knobs = DEFAULT_KNOBS):
        try:
            engine = super().build_engine(knobs)
        except ValueError:  # the engine's ConfigError, which names the field
            if self.fault == "vague_config_error":
                raise ValueError("invalid engine configuration") from None
            raise
        patch = getattr(self, f"_patch_{self.fault}", None)
        if patch is not None:
            patch(engine)
        return engine

    # ------------------------------------------------------------------ engine patches
    @staticmethod
    def _patch_fcfs_oldest_victim(engine: Any) -> None:
        scheduler = engine.scheduler
        if scheduler.policy == "fcfs":
            scheduler._pick_victim = lambda candidates: min(candidates, key=lambda r: r.admitted_seq)

    @staticmethod
    def _patch_priority_most_important_victim(engine: Any) -> None:
        scheduler = engine.scheduler
        if scheduler.policy == "priority":
            scheduler._pick_victim = lambda candidates: min(candidates,
                                                            key=lambda r: (r.priority_key(), r.admitted_seq))

    @staticmethod
    def _patch_ignores_prefix_caching(engine: Any) -> None:
        # the block manager and its pool neither look up nor keep cached blocks, whatever the config says
        engine.block_manager.enable_caching = engine.block_manager.pool.enable_caching = False

    @staticmethod
    def _patch_ignores_token_budget(engine: Any) -> None:
        scheduler = engine.scheduler
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, 4096)

    @staticmethod
    def _patch_admission_ignores_headroom(engine: Any) -> None:
        admission = engine.scheduler.admission
        if hasattr(admission, "headroom"):  # the watermark gate; the others keep no headroom
            admission.headroom = 0.0

    @staticmethod
    def _patch_scrambles_swap_in(engine: Any) -> None:
        kv, swap_in = engine.kv_cache, engine.kv_cache.swap_in

        def scrambled(mapping):
            mapping = list(mapping)
            if len(mapping) == 1 and kv.host_cache.shape[0] > 1:
                # one block has no other place among its own to go to: it gets its host neighbour's bytes instead
                # (reversing a one-block swap-in changed nothing, and over HTTP a run whose swap-ins were all single
                # blocks went unscathed: the check passed on this fault about one run in three)
                (host, device), = mapping
                return swap_in([((host + 1) % kv.host_cache.shape[0], device)])
            devices = [d for _, d in mapping][::-1]
            return swap_in([(h, d) for (h, _), d in zip(mapping, devices, strict=True)])

        kv.swap_in = scrambled

    @staticmethod
    def _patch_never_aborts(engine: Any) -> None:
        engine.abort_request = lambda request_id: True

    @staticmethod
    def _patch_ignores_early_abort(engine: Any) -> None:
        abort = engine.abort_request

        def ignoring_early(request_id):
            req = engine.scheduler.requests.get(request_id)
            if req is not None and not req.output_token_ids:
                return True  # accepted, and the request goes on as if never aborted
            return abort(request_id)

        engine.abort_request = ignoring_early

    @staticmethod
    def _patch_fails_mid_stream(engine: Any) -> None:
        # A step that fails after its model run: its tokens are in the requests and counted, then it raises.
        # Never on a step that finished a request (a finished request is no longer held, so nobody could
        # deliver its last tokens), and only once: the engine serves on after.
        step, giving = engine.step, [0]

        def failing_once():
            result = step()
            gave = [o for o in result.outputs if o.token_ids]
            if gave and not any(o.finished for o in result.outputs):
                giving[0] += 1
                if giving[0] == 5:
                    raise RuntimeError("fails_mid_stream: the step failed after giving its requests their tokens")
            return result

        engine.step = failing_once

    @staticmethod
    def _patch_aborts_preemption_victims(engine: Any) -> None:
        # The engine gives up on its recompute victims: it aborts them itself (its own abort path, its
        # own "abort" finish reason) right after the step that preempted them.
        schedule, step, victims = engine.scheduler.schedule, engine.step, []

        def schedule_noting_victims():
            out = schedule()
            victims.extend(p.request_id for p in out.preempted if p.mode == "recompute")
            return out

        def step_dropping_victims():
            result = step()
            for request_id in victims:
                engine.abort_request(request_id)
            victims.clear()
            return result

        engine.scheduler.schedule = schedule_noting_victims
        engine.step = step_dropping_victims

    @staticmethod
    def _patch_finishes_twice(engine: Any) -> None:
        step, again = engine.step, []

        def step_twice():
            result = step()
            outputs = again + result.outputs
            again[:] = [o for o in outputs if o.finished and o not in again][:1]
            return replace(result, outputs=outputs)

        engine.step = step_twice

    @staticmethod
    def _patch_leaks_block(engine: Any) -> None:
        # Leaks on the first release of a request holding device blocks, finished or aborted: tying it
        # to an abort made the fault depend on timing (a request aborted while still waiting holds none).
        bm = engine.block_manager
        forget, leaked = bm.forget, []

        def leaky_forget(request_id):
            if not leaked and bm.blocks_of(request_id):
                leaked.append(request_id)  # this request's blocks stay allocated
                return None
            return forget(request_id)

        bm.forget = leaky_forget

    @staticmethod
    def _patch_undercounts_prefix_hits(engine: Any) -> None:
        bm = engine.block_manager
        record = bm.record_prefix_query
        bm.record_prefix_query = lambda num_tokens, hit_tokens: record(num_tokens, hit_tokens // 2)

    @staticmethod
    def _patch_counts_prefix_hits_per_retry(engine: Any) -> None:
        # An admission that cannot have its blocks yet is retried next step; this engine counts the hit it
        # found each time, not once when the request is admitted.
        scheduler, bm = engine.scheduler, engine.block_manager
        allocate = scheduler._allocate_for_admission

        def counting_each_try(req, num_new, hits, step):
            allocated = allocate(req, num_new, hits, step)
            if not allocated and hits:
                bm.counters.prefix_cache_hits += len(hits) * bm.block_size
            return allocated

        scheduler._allocate_for_admission = counting_each_try

    @staticmethod
    def _patch_preemptions_total_misses_a_mode(engine: Any) -> None:
        # The engine's counters record, as it hands it out (to the server's /metrics too), with a total that
        # leaves out recompute preemptions; the by-mode fields stay true.
        counters = engine.counters
        engine.counters = lambda: _total_without_recompute(counters())

    @staticmethod
    def _patch_livelock(engine: Any) -> None:
        step, taken, last = engine.step, [0], []

        def stalled():
            taken[0] += 1
            if taken[0] <= 20:
                last[:] = [step()]
                return last[0]
            # nothing scheduled: no outputs, and a record of a step that did nothing (its type's defaults)
            return replace(last[0], outputs=[], record=type(last[0].record)())

        engine.step = stalled

    @staticmethod
    def _patch_prefix_hit_takes_no_reference(engine: Any) -> None:
        # A hit on a block some running request holds joins its table without a reference of its own: when the
        # first holder lets go the block is free (and soon handed out and overwritten) under the other. The pool's
        # double-free guard would turn that into a crash at once; an engine with this bug has no such guard, so a
        # release of a block already at zero is dropped, and the bug shows as wrong tokens, as it would in the wild.
        pool = engine.block_manager.pool
        touch, free = pool.touch, pool.free

        def unguarded_free(blocks):
            for block in blocks:  # one at a time: a table may come to hold a block twice
                if block.ref_cnt > 0:
                    free([block])

        pool.touch = lambda blocks: touch([b for b in blocks if b.ref_cnt == 0])
        pool.free = unguarded_free

    @staticmethod
    def _patch_starves_requests_at_max_model_len(engine: Any) -> None:
        # "<" where "<=" was meant: a request exactly as long as the engine allows is held back, every step
        admission, limit = engine.scheduler.admission, engine.config.max_model_len
        admits = admission.admits

        def off_by_one(request, running, manager):
            return request.num_prompt_tokens + request.sampling_params.max_tokens < limit and admits(request, running,
                                                                                                     manager)

        admission.admits = off_by_one

    # --- faults at the engine's intake: what add_request does with a request
    @staticmethod
    def _wrap_intake(engine: Any, change: Any) -> None:
        add = engine.add_request

        def faulty_add(request_id, prompt_token_ids, sampling_params, *args, **kwargs):
            prompt_token_ids, sampling_params = change(list(prompt_token_ids), sampling_params)
            return add(request_id, prompt_token_ids, sampling_params, *args, **kwargs)

        engine.add_request = faulty_add

    @classmethod
    def _patch_ignores_stop_token_ids(cls, engine: Any) -> None:
        cls._wrap_intake(engine, lambda prompt, params: (prompt, replace(params, stop_token_ids=())))

    @classmethod
    def _patch_ignores_eos(cls, engine: Any) -> None:
        cls._wrap_intake(engine, lambda prompt, params: (prompt, replace(params, ignore_eos=True)))

    @classmethod
    def _patch_ignores_seed(cls, engine: Any) -> None:
        cls._wrap_intake(engine, lambda prompt, params: (prompt, replace(params, seed=None)))

    @classmethod
    def _patch_overruns_max_tokens(cls, engine: Any) -> None:
        cls._wrap_intake(engine, lambda prompt, params: (prompt, replace(params, max_tokens=params.max_tokens + 1)))

    @classmethod
    def _patch_truncates_over_long_prompts(cls, engine: Any) -> None:
        limit = engine.config.max_model_len

        def truncate(prompt, params):
            return (prompt[-(limit // 2):] if len(prompt) >= limit else prompt), params

        cls._wrap_intake(engine, truncate)

    @staticmethod
    def _patch_vague_rejection(engine: Any) -> None:
        # the engine's own exception type, from its module (kvbench's conformance part imports no engine)
        RequestRejected = sys.modules[type(engine).__module__].RequestRejected
        add = engine.add_request

        def vague_add(*args, **kwargs):
            try:
                return add(*args, **kwargs)
            except RequestRejected:
                raise RequestRejected("rejected") from None

        engine.add_request = vague_add

    # --- faults in what the model's sampled tokens become (the scheduler's update)
    @staticmethod
    def _wrap_update(engine: Any, change: Any) -> None:
        """``change(out, sampled)`` may rewrite ``sampled`` (request id -> token) before the scheduler takes
        it: the request then goes on from a wrong token, as it would after a miscomputed step."""
        scheduler = engine.scheduler
        update = scheduler.update

        def faulty_update(out, sampled):
            change(out, sampled)
            return update(out, sampled)

        scheduler.update = faulty_update

    @classmethod
    def _patch_miscomputes_one_position(cls, engine: Any) -> None:
        vocab = engine.model.config.vocab_size

        def change(out, sampled):
            for chunk in out.chunks:
                req = chunk.request
                if req.request_id in sampled and req.num_tokens == 47:  # this token lands at position 48
                    sampled[req.request_id] = (sampled[req.request_id] + 1) % vocab

        cls._wrap_update(engine, change)

    @classmethod
    def _patch_corrupts_recomputed_output(cls, engine: Any) -> None:
        vocab, resumed = engine.model.config.vocab_size, set()

        def change(out, sampled):
            for chunk in out.chunks:
                if chunk.start < chunk.request.max_computed_tokens:  # computing again what was discarded
                    resumed.add(chunk.request.request_id)
            for rid in resumed & set(sampled):
                sampled[rid] = (sampled[rid] + 1) % vocab
                resumed.discard(rid)

        cls._wrap_update(engine, change)

    # --- faults in the engine's stats
    @staticmethod
    def _patch_recomputed_counter_frozen(engine: Any) -> None:
        scheduler = engine.scheduler
        update = scheduler.update

        def frozen(out, sampled):
            before = scheduler.counters.recomputed_tokens
            touched = update(out, sampled)
            scheduler.counters.recomputed_tokens = before
            return touched

        scheduler.update = frozen

    @staticmethod
    def _patch_overcounts_generated_tokens(engine: Any) -> None:
        scheduler = engine.scheduler
        update = scheduler.update

        def overcounting(out, sampled):
            touched = update(out, sampled)
            if sampled:
                scheduler.counters.generated_tokens += 1
            return touched

        scheduler.update = overcounting

    @staticmethod
    def _patch_preemptions_without_swaps(engine: Any) -> None:
        scheduler = engine.scheduler
        preempt = scheduler._preempt

        def not_counting_swaps(victim, step):
            swaps = scheduler.counters.preemptions_swap
            preempt(victim, step)
            if scheduler.counters.preemptions_swap > swaps:
                victim.num_preemptions -= 1

        scheduler._preempt = not_counting_swaps

    # --- faults in the prefix cache and swap
    @staticmethod
    def _patch_serves_stale_cached_blocks(engine: Any) -> None:
        # (Reordering the hit blocks would not do: keys carry their positions, and attention over a
        # prefix is blind to the order its blocks sit in.)
        bm, cache = engine.block_manager, engine.kv_cache.device_cache
        find = bm.find_cached_prefix

        def stale(request):
            hits = find(request)
            if hits:
                cache[hits[-1].block_id, :, 1].zero_()  # [layers, K/V, block_size, kv_heads, head_dim]: V lost
            return hits

        bm.find_cached_prefix = stale

    @staticmethod
    def _patch_uncounted_swap_fallbacks(engine: Any) -> None:
        scheduler = engine.scheduler
        preempt = scheduler._preempt

        def uncounted(victim, step_builder):
            before = scheduler.counters.swap_fallbacks
            preempt(victim, step_builder)
            scheduler.counters.swap_fallbacks = before

        scheduler._preempt = uncounted

    @staticmethod
    def _patch_drops_unswappable_victims(engine: Any) -> None:
        # A victim the host pool cannot take (the scheduler falls back to recompute) is aborted by the
        # engine itself, through its own abort path, right after the step that preempted it.
        scheduler, step, dropped = engine.scheduler, engine.step, []
        preempt = scheduler._preempt

        def noting_fallbacks(victim, step_builder):
            before = scheduler.counters.swap_fallbacks
            preempt(victim, step_builder)
            if scheduler.counters.swap_fallbacks > before:
                dropped.append(victim.request_id)

        def step_dropping():
            outputs = step()
            for request_id in dropped:
                engine.abort_request(request_id)
            dropped.clear()
            return outputs

        scheduler._preempt = noting_fallbacks
        engine.step = step_dropping

    # --- faults in the model's matmuls and in block accounting
    @staticmethod
    def _patch_drops_attention_bias(engine: Any) -> None:
        # The projection each forward pass calls (the fused q/k/v matmul, whatever its backend) computes
        # x @ W.T alone; the checkpoint's bias stays loaded. A checkpoint without attention biases is unchanged.
        for layer in engine.model.model.layers:
            attn = layer.self_attn
            for proj in (attn.qkv,) if attn.qkv is not None else (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias = None

    @staticmethod
    def _patch_readmitted_holds_extra_blocks(engine: Any) -> None:
        bm = engine.block_manager
        allocate = bm.allocate_slots

        def one_block_more(request, num_new_tokens, new_computed_blocks=()):
            # a waiting request that was preempted before: a readmission after recompute. Where the extra
            # block does not fit it is admitted as it should be (a pool sized for it alone must not stall it).
            readmission = request.status.value == "waiting" and request.num_preemptions > 0
            if readmission and allocate(request, num_new_tokens + bm.block_size, new_computed_blocks):
                return True
            return allocate(request, num_new_tokens, new_computed_blocks)

        bm.allocate_slots = one_block_more

    @staticmethod
    def _patch_uncounted_auto_fallbacks(engine: Any) -> None:
        # Auto's fallback only (fixed swap still counts its own): its events stay, its counters do not move.
        scheduler = engine.scheduler
        preempt, counters = scheduler._preempt, scheduler.counters

        def uncounted(victim, step_builder):
            before = counters.swap_fallbacks, counters.preemptions_recompute
            preempt(victim, step_builder)
            if scheduler.preemption_mode == "auto" and counters.swap_fallbacks > before[0]:
                counters.swap_fallbacks, counters.preemptions_recompute = before

        scheduler._preempt = uncounted


class FaultyServerAdapter(ServerAdapter):
    """The reference server (``server:preset=reference``) with one deliberate fault inside its engine (option
    ``fault``: a fault of :func:`engine_faults`), through :mod:`kvbench.testing.patched_server`.

    Unlike ``server:preset=reference,cmd=...patched_server...``, which starts a server per knob set, it keeps
    the preset's reconfigure: one server process, a fresh engine built in place for each knob set, and for
    each :meth:`use_fault`. Servers kept: one (option ``keep_servers``), so that a server a failed check
    left busy (requests still in flight refuse a reconfigure) is replaced by a fresh one, not kept."""

    kind = "server-faulty"
    option_keys = {  # noqa: RUF012
        **{k: v for k, v in ServerAdapter.option_keys.items() if k not in ("preset", "cmd", "vllm")},
        "preset": "reference (the only one: the server is the patched reference server)",
        "fault": "a fault patched into the engine, one of: " + ", ".join(engine_faults()),
    }

    @classmethod
    def validate_options(cls, options: dict[str, str]) -> None:
        fault = options.get("fault")
        if fault not in engine_faults():
            raise ValueError(f"option fault={fault!r} is invalid: expected one of {', '.join(engine_faults())}")
        for key in ("cmd", "vllm"):
            if key in options:
                raise ValueError(f"option {key} is invalid for {cls.kind}: it always runs the patched reference server")
        if options.get("preset", "reference") != "reference":
            raise ValueError(f"option preset={options['preset']!r} is invalid for {cls.kind}: only reference")
        super().validate_options({**{k: v for k, v in options.items() if k != "fault"}, "preset": "reference"})

    def __init__(self, model_dir: str, options: dict[str, str] | None = None, name: str | None = None):
        options = {"keep_servers": "1", **(options or {}), "preset": "reference"}
        super().__init__(model_dir, options, name)
        self.fault = self.options.pop("fault")
        self._builds = 0  # bumped by use_fault: no engine built before it serves after it
        self.fault_file = self.log_dir / "fault"
        self.fault_file.write_text(self.fault, encoding="utf-8")
        spec = f"{__name__}:apply_fault_named_in={self.fault_file}".replace("{", "{{").replace("}", "}}")
        launcher = ("{python}", "-m", "kvbench.testing.patched_server", "--patch", spec)
        # the reference preset's own flags after its launcher; a reconfigure sends only those
        self.preset = replace(self.preset, command=(*launcher, *self.preset.command[self.preset.launcher_len:]),
                              launcher_len=len(launcher))

    def use_fault(self, fault: str) -> None:
        """Serve the next calls with ``fault`` (the same one again is allowed) in an engine built after this call:
        the running server builds it in place; state an earlier check left (blocks, requests) stays behind."""
        self.validate_options({"fault": fault})
        self.fault_file.write_text(fault, encoding="utf-8")
        self.fault = fault
        self._builds += 1

    def launch_key(self, knobs: Knobs) -> tuple[str, ...]:
        # an engine built under another fault (or before the latest use_fault) is never reused
        return (*super().launch_key(knobs), f"fault={self.fault}#{self._builds}")
