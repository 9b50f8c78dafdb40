"""Chunked prefill proven from outside, for an engine that counts no prefill chunks.

The argument: one engine step computes at most the step's token budget (``max_num_batched_tokens``) of
tokens. If the engine itself confirms that budget ``B`` and chunked prefill on
(:meth:`~kvbench.engines.base.EngineAdapter.confirmed_settings`: its configuration endpoint or its metric
labels, never what kvbench asked for), then a request whose prompt needed more than ``B`` tokens computed,
and that was answered with the right tokens, had its prefill split over at least ``ceil(computed / B)``
steps: ``ceil(computed / B) - 1`` prefill chunks in the sense of the ``prefill_chunks`` counter.

"Needed computed" leaves out the most a prefix-cache hit could have served: whole blocks its prompt shares
with another request's sequence, short of its last prompt token
(:func:`~kvbench.conformance.metrics_truth.first_hit_cap`), so the bound holds
with prefix caching on or off.

The proof rests on the engine's word for its budget: an engine that states one budget and runs with
another is caught only where it also counts its chunks (the reference engine's ``prefill_chunks``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.conformance.metrics_truth import first_hit_cap
from kvbench.core.requests import GenRequest, GenResult

#: finish reasons of a request the engine did not answer (refused, or failed): it proves no prefill
_UNANSWERED = ("rejected", "error")


@dataclass(frozen=True)
class ChunkedPrefill:
    """What the run proves: the confirmed ``budget`` and, per request whose prompt needed more than it,
    the fewest prefill chunks it must have taken (``chunks_floor``: request id -> ``ceil(computed / budget) - 1``)."""

    budget: int
    chunks_floor: dict[str, int] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        """The fewest prefill chunks the run took in all: the ``prefill_chunks`` counter's floor."""
        return sum(self.chunks_floor.values())

    def evidence(self) -> dict[str, Any]:
        """The proof as recorded evidence."""
        return {"confirmed_budget": self.budget, "prompts_longer_than_budget": len(self.chunks_floor),
                "prefill_chunks_at_least": self.chunks}


def chunked_prefill_from_outside(requests: Sequence[GenRequest], result: GenResult,
                                 settings: Mapping[str, Any]) -> ChunkedPrefill | str:
    """The proof that ``result`` prefilled in chunks, from the engine's confirmed ``settings``; or, as a
    string, why it cannot be had (a setting the engine does not confirm, no prompt longer than the budget).
    Call it once the outputs were compared: only a request answered with the right tokens proves its
    prefill was computed."""
    if settings.get("enable_chunked_prefill") is not True:
        said = settings.get("enable_chunked_prefill")
        return ("the engine does not confirm chunked prefill on" if said is None
                else f"the engine says enable_chunked_prefill={said}")
    budget = settings.get("max_num_batched_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return "the engine does not confirm its step's token budget (max_num_batched_tokens)"
    block_size = settings.get("block_size")
    caching_off = settings.get("enable_prefix_caching") is False
    floors = {}
    for i, (req, out) in enumerate(zip(requests, result.outputs, strict=True)):
        if not out.token_ids or out.finish_reason in _UNANSWERED:
            continue
        served = 0 if caching_off else first_hit_cap(requests, result, i, block_size)
        computed = len(req.prompt_token_ids) - served
        if computed > budget:
            floors[req.request_id] = math.ceil(computed / budget) - 1
    if not floors:
        return (f"no answered prompt needed more than the confirmed budget of {budget} tokens computed, so "
                "none had to be split")
    return ChunkedPrefill(budget, floors)
