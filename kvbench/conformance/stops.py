"""Request sets for the stop-condition check: each ends its requests through one stop condition.

* ``max_tokens``: every request runs to its length limit (``ignore_eos=True``).
* ``stop_token_ids``: each request stops at a token the ground truth generates (its last, or the one
  halfway through), so the stop provably fires (at that token's first occurrence).
* ``eos``: ``ignore_eos=False`` on a checkpoint whose EOS is a token the ground truth's greedy outputs reach
  mid-output (:mod:`kvbench.models.eos_checkpoint`): each request that reaches it stops there, at a position
  known in advance (:func:`eos_positions`), often after a preemption took it off and brought it back. (The
  built-in checkpoints' own EOS is almost never picked greedily: prompts that happened to end right before it
  gave requests that stopped at their first token, never under pressure, and none at all on some seeds.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvbench.core.requests import GenRequest, GenResult

CONDITIONS = ("eos", "stop_token_ids", "max_tokens")


def stop_token_requests(requests: Sequence[GenRequest], truth: GenResult) -> list[GenRequest]:
    """Each request with one stop token from the ground truth's output: its last token for every other
    request (same length as ``max_tokens`` would give, so the run keeps its pressure, but the finish
    reason must be "stop"), the token halfway through it for the others (the request ends early)."""
    out = []
    for i, (r, t) in enumerate(zip(requests, truth.outputs, strict=True)):
        position = len(t.token_ids) - 1 if i % 2 == 0 else len(t.token_ids) // 2
        out.append(replace(r, stop_token_ids=(t.token_ids[position],) if t.token_ids else ()))
    return out


def eos_requests(requests: Sequence[GenRequest]) -> list[GenRequest]:
    """The request set with EOS honoured."""
    return [replace(r, ignore_eos=False) for r in requests]


def eos_positions(truth: GenResult, eos: int) -> dict[str, int]:
    """Request id -> the index of the output token at which EOS ``eos`` ends it: its first ``eos`` in the
    ground truth generated with EOS ignored; requests that never reach it are left out."""
    return {o.request_id: o.token_ids.index(eos) for o in truth.outputs if eos in o.token_ids}
