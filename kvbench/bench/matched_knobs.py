"""The behaviour every benchmark job states, so that engines are compared under the same settings.

A scenario sets the knobs its story is about (the pool, the preemption mode, prefix caching where it compares
caching on and off); what it leaves unset each engine would fill with its own default, and those differ: vLLM
caches prefixes and chunks prefills by default with a 2048-token step budget, the reference engine does
neither and budgets a step by ``max_model_len``, llama.cpp always chunks. Figures from such a run compare
defaults, not engines. So every job states these behaviour knobs where its scenario leaves them unset
(:data:`STATED`): prefix caching off (no workload of the storms shares prefixes unless its scenario says so),
chunked prefill on with a 2048-token step budget (what vLLM's CPU server runs, and what an engine that always
chunks can match). An engine that cannot set one of them (its adapter lists it in ``unsupported_knobs``) runs
its own way there, and the report's engine-settings table flags the row as not matched.

Stated on every run, alone or beside other engines, so an engine's figures never depend on which engines
shared its session (a gate against a baseline compares like with like).
"""

from __future__ import annotations

from typing import Any

from kvbench.core.knobs import Knobs

#: what a job states where its scenario leaves it unset
STATED = Knobs(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=2048)


def stated(knobs: Knobs, adapter: Any) -> Knobs:
    """``knobs`` with each of :data:`STATED` they leave unset filled in, except where ``adapter`` cannot set it.
    The step budget is stated only alongside chunked prefill on: without chunking a budget must hold a whole
    prompt, which only the scenario can size."""
    unsupported = getattr(adapter, "unsupported_knobs", {}) or {}
    fill: dict[str, Any] = {}
    for name, value in STATED.as_dict().items():
        if getattr(knobs, name) is None and name not in unsupported:
            fill[name] = value
    chunked = fill.get("enable_chunked_prefill", knobs.enable_chunked_prefill)
    if "max_num_batched_tokens" in fill and chunked is not True:
        del fill["max_num_batched_tokens"]
    return knobs.merged(Knobs(**fill)) if fill else knobs
