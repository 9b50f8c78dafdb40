"""What the engine hands back: per request (:class:`RequestOutput`), and per step (:class:`StepResult`:
the step's outputs and its :class:`StepRecord`)."""

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


@dataclass(frozen=True)
class StepRecord:
    """What one step did: its seconds on the engine's timer (swap copies included) and the tokens it
    computed (``num_tokens`` = prefill + decode) and the requests it preempted."""

    seconds: float = 0.0
    num_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens of chunks that are not decodes
    num_decode_tokens: int = 0
    num_preempted: int = 0


@dataclass(frozen=True)
class StepResult:
    """What ``LLMEngine.step()`` returns: ``outputs``, one per request that got a token, finished or was
    aborted since the last step (aborted ones first); ``record``, what the step did."""

    outputs: list[RequestOutput]
    record: StepRecord
