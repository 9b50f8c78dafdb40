"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass

from reference_engine.request import Request


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

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), req.status.finished,
                   req.finish_reason, req.num_preemptions, req.num_recomputed_tokens, req.num_prefix_hit_tokens)
