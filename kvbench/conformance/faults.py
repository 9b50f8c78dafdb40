"""Deliberately broken reference engines: each breaks exactly one property a conformance check is
about, so that a test can show the check failing on it (a check that cannot fail proves nothing).

Not a registered kind, so it never shows in the list of engines; name it by import path::

    pytest suites/conformance --engine "kvbench.conformance.faults:FaultyReferenceAdapter:fault=fcfs_oldest_victim"

Each fault is a small patch applied to a fresh ``LLMEngine`` (or to the adapter's result); the
engine is otherwise the reference engine, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvbench.core.knobs import DEFAULT_KNOBS, Knobs
from kvbench.core.requests import GenOutput, GenRequest, GenResult
from kvbench.engines.reference import ReferenceAdapter

#: fault -> the property it breaks (the check that must catch it)
FAULTS: dict[str, str] = {
    "corrupts_recomputed_output": "a request preempted by recompute comes back with a wrong last token (check 1)",
    "scrambles_swap_in": "swap-in copies KV blocks into each other's places (check 2)",
    "ignores_prefix_caching": "enable_prefix_caching is silently off: nothing is ever reused (check 3)",
    "ignores_token_budget": "max_num_batched_tokens is ignored, so no prefill is ever split (check 4)",
    "never_aborts": "abort_request is accepted but does nothing (check 6)",
    "aborts_preemption_victims": "a request preempted by recompute is aborted instead of resumed (checks 1, 6)",
    "finishes_twice": "a finished request is reported finished again on the next step (check 6)",
    "leaks_block": "the first request released with device blocks (finished or aborted) keeps them (check 6)",
    "ignores_seed": "per-request seeds are ignored (check 7)",
    "vague_rejection": "a refused request's error does not say why (check 8)",
    "drops_unswappable_victims": "a victim the host pool cannot take is aborted, not recomputed (check 8)",
    "fcfs_oldest_victim": "under FCFS the oldest running request is preempted, not the latest (check 9)",
    "priority_most_important_victim": "under the priority policy the most important running request is preempted",
    "ignores_stop_token_ids": "stop_token_ids are never honoured (stop conditions)",
    "ignores_eos": "EOS never ends a request, even with ignore_eos=False (stop conditions)",
    "recomputed_counter_frozen": "the recomputed-token counter never moves (metrics truth)",
    "preemptions_without_swaps": "per-request preemption counts leave out swap preemptions (metrics truth)",
    "undercounts_prefix_hits": "the prefix-cache hit counter counts half of each admission's hit (check 3: its "
                               "responses' cached tokens and the shared prefixes' floor disagree with it)",
    "livelock": "after 20 steps the engine stops scheduling anything, forever (liveness)",
}


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

    def engine_config(self, knobs: Knobs = DEFAULT_KNOBS):
        if self.fault == "ignores_prefix_caching" and knobs.enable_prefix_caching:
            knobs = replace(knobs, enable_prefix_caching=False)
        if self.fault == "ignores_token_budget" and knobs.max_num_batched_tokens is not None:
            knobs = replace(knobs, max_num_batched_tokens=max(knobs.max_num_batched_tokens, 4096))
        return super().engine_config(knobs)

    def build_engine(self, knobs: Knobs = DEFAULT_KNOBS):
        engine = super().build_engine(knobs)
        patch = getattr(self, f"_patch_{self.fault}", None)
        if patch is not None:
            patch(engine)
        return engine

    def generate(self, requests: Sequence[GenRequest], knobs: Knobs = DEFAULT_KNOBS) -> GenResult:
        if self.fault == "ignores_stop_token_ids":
            requests = [replace(r, stop_token_ids=()) for r in requests]
        elif self.fault == "ignores_eos":
            requests = [replace(r, ignore_eos=True) for r in requests]
        elif self.fault == "ignores_seed":
            requests = [replace(r, seed=None) for r in requests]
        result = super().generate(requests, knobs)
        fix = getattr(self, f"_result_{self.fault}", None)
        return fix(result) if fix is not None else result

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
    def _patch_scrambles_swap_in(engine: Any) -> None:
        kv, swap_in = engine.kv_cache, engine.kv_cache.swap_in

        def scrambled(mapping):
            mapping = list(mapping)
            devices = [d for _, d in mapping][::-1]
            return swap_in([(h, d) for (h, _), d in zip(mapping, devices, strict=True)])

        kv.swap_in = scrambled

    @staticmethod
    def _patch_never_aborts(engine: Any) -> None:
        engine.abort_request = lambda request_id: True

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
            outputs = step()
            for request_id in victims:
                engine.abort_request(request_id)
            victims.clear()
            return outputs

        engine.scheduler.schedule = schedule_noting_victims
        engine.step = step_dropping_victims

    @staticmethod
    def _patch_finishes_twice(engine: Any) -> None:
        step, again = engine.step, []

        def step_twice():
            outputs = again + step()
            again[:] = [o for o in outputs if o.finished and o not in again][:1]
            return outputs

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
    def _patch_livelock(engine: Any) -> None:
        step, taken = engine.step, [0]

        def stalled():
            taken[0] += 1
            return step() if taken[0] <= 20 else []

        engine.step = stalled

    # ------------------------------------------------------------------ result patches
    @staticmethod
    def _result_corrupts_recomputed_output(result: GenResult) -> GenResult:
        for o in result.outputs:
            if o.num_preemptions and o.token_ids:
                o.token_ids[-1] = (o.token_ids[-1] + 1) % 512
        return result

    @staticmethod
    def _result_vague_rejection(result: GenResult) -> GenResult:
        for o in result.outputs:
            if o.finish_reason == "rejected":
                o.error = "rejected"
        return result

    @staticmethod
    def _result_drops_unswappable_victims(result: GenResult) -> GenResult:
        # Under preemption_mode="swap", a victim preempted by recompute is one the host pool could not take.
        dropped = {e.request_id for e in result.events or []
                   if e.kind == "preempted" and e.data.get("mode") == "recompute"}
        result.outputs = [GenOutput(o.request_id, o.token_ids[:1], "abort", o.num_preemptions, o.error)
                          if o.request_id in dropped else o for o in result.outputs]
        return result

    @staticmethod
    def _result_recomputed_counter_frozen(result: GenResult) -> GenResult:
        result.counters = replace(result.counters, recomputed_tokens=0)
        return result

    @staticmethod
    def _result_preemptions_without_swaps(result: GenResult) -> GenResult:
        swaps: dict[str, int] = {}
        for e in result.events or []:
            if e.kind == "preempted" and e.data.get("mode") == "swap":
                swaps[e.request_id] = swaps.get(e.request_id, 0) + 1
        result.outputs = [GenOutput(o.request_id, o.token_ids, o.finish_reason,
                                    None if o.num_preemptions is None
                                    else o.num_preemptions - swaps.get(o.request_id, 0), o.error)
                          for o in result.outputs]
        return result
