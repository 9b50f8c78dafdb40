"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass

from reference_engine.request import Request
from reference_engine.sampling_params import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every token generated so far
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" once finished
    num_preemptions: int
    num_recomputed_tokens: int  # tokens whose KV was computed again after a preemption
    num_cached_tokens: int  # prompt tokens served from the prefix cache, over all admissions
    # One per token in token_ids when SamplingParams.logprobs is set, else None.
    logprobs: list[TokenLogprobs] | None = None

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), req.status.finished,
                   req.finish_reason, req.num_preemptions, req.num_recomputed_tokens, req.num_prefix_hit_tokens,
                   list(req.output_logprobs) if req.sampling_params.logprobs is not None else None)
