"""Request and response bodies of ``/v1/completions`` (OpenAI's names, plus vLLM's extras).

Unknown fields are refused (``extra="forbid"``), as vLLM does when run strict: a misspelt knob
(``max_token``) is a 400 naming it, never silently ignored. Fields that OpenAI defines but this engine
cannot honour (``echo``, ``stop`` strings, ``n > 1``, ``min_tokens > 0``) are accepted only at their
neutral value and refused otherwise, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: 1 MiB: ~100k token ids as JSON, far above max_model_len of these models
DEFAULT_MAX_BODY_BYTES = 1 << 20

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. ``prompt`` is text (tokenised with the checkpoint's tokenizer) or a list
    of token ids; one prompt per request."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM: -1 or 0 = off
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    # vLLM's extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    priority: int = 0
    return_token_ids: bool = False
    # vLLM's: requests share cached prefix blocks only with requests of the same salt
    cache_salt: str | None = Field(default=None, min_length=1)


class UnsupportedField(ValueError):
    """A known field set to a value this engine cannot honour (a 400 naming ``field``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def refuse_unsupported(req: CompletionRequest) -> None:
    """Raise :class:`UnsupportedField` for the first field set to a value the engine cannot honour."""
    if req.echo:
        raise UnsupportedField("echo", "echo=true is not supported by reference_engine.serve")
    if req.stop:
        raise UnsupportedField("stop", "stop strings are not supported by reference_engine.serve; "
                                       "use stop_token_ids")
    if req.n != 1:
        raise UnsupportedField("n", f"n={req.n} is not supported: expected 1 (one choice per request)")
    if req.min_tokens:
        raise UnsupportedField("min_tokens", f"min_tokens={req.min_tokens} is not supported by reference_engine "
                                             "(its SamplingParams has no min_tokens): expected 0")


class ReconfigureRequest(BaseModel):
    """``POST /kvbench/reconfigure`` (``--allow-reconfigure``): the engine flags of a command line, as
    ``python -m reference_engine.serve`` takes them (``["--block-size", "32", "--enable-prefix-caching"]``).
    The new engine is the one a server started with these flags would have: a flag not given takes its
    default, ``--model`` this server's. Server flags may be given only at the values this server runs
    with (so a launcher can send its whole command line)."""

    model_config = ConfigDict(extra="forbid")

    args: list[str]


class BadEngineArgs(ValueError):
    """A reconfigure's arguments refused; ``flag`` names the flag (``--block-size``), or ``args``."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


class CompletionLogprobs(BaseModel):
    """OpenAI's completions ``logprobs`` object: one entry per output token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["length", "stop", "abort"] | None = None
    # vLLM's return_token_ids: present only when asked for (excluded when None).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # reference_engine's extension (no vLLM equivalent): on the choice that carries finish_reason, how
    # many times the engine preempted this request, so a client can check per-request preemptions
    # against /metrics' totals
    num_preemptions: int | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache, summed over the request's admissions


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # vLLM's (--enable-prompt-tokens-details)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def error_body(message: str, param: str | None, code: int, type_: str = "BadRequestError") -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
