"""Request sets for the stop-condition check: each ends its requests through one stop condition.

* ``max_tokens``: every request runs to its length limit (``ignore_eos=True``).
* ``stop_token_ids``: each request stops at a token the ground truth generates (its last, or the one
  halfway through), so the stop provably fires (at that token's first occurrence).
* ``eos``: ``ignore_eos=False``. Greedy decoding on the built-in random checkpoints almost never
  picks EOS, so the set adds prompts cut right before a position where the ground truth's greedy
  choice *is* EOS (found by one teacher-forced pass over the prompts): those requests end at their
  first token with "stop".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

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


def eos_prompts(model: Any, requests: Sequence[GenRequest], eos_token_ids: set[int],
                limit: int = 6) -> list[GenRequest]:
    """Up to ``limit`` requests whose prompt is a prefix of one of ``requests``' prompts after which
    ``model`` (a transformers causal LM, the ground truth) greedily picks an EOS token."""
    import torch

    found: list[GenRequest] = []
    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids], dtype=torch.long, device=model.device)
            greedy = model(ids).logits[0].argmax(-1).tolist()  # [prompt_len]
            for i, token in enumerate(greedy):
                if token in eos_token_ids and len(found) < limit:
                    found.append(replace(r, request_id=f"{r.request_id}-eos{i}",
                                         prompt_token_ids=r.prompt_token_ids[:i + 1],
                                         ignore_eos=False))
    return found


def eos_requests(requests: Sequence[GenRequest], prompts_ending_in_eos: Sequence[GenRequest]) -> list[GenRequest]:
    """The request set with EOS honoured, plus the prompts after which EOS is the greedy choice."""
    return [replace(r, ignore_eos=False) for r in requests] + list(prompts_ending_in_eos)
