"""Per-request sampling parameters (vLLM's names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy (argmax).

    With ``seed`` set, the k-th output token is drawn from a generator seeded by ``(seed, k)``, so
    sampled outputs are the same whether or not the request was preempted, recomputed or swapped.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Top-k log-probabilities to return per output token (vLLM's ``logprobs``): None = none. Raw
    # log-softmax of the model's logits (vLLM's default ``raw_logprobs``), before temperature/top-k/top-p.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r} is invalid: expected an integer >= 1")
        if (not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} is invalid: "
                             "expected a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} is invalid: expected 0 (off) or an integer >= 1")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} is invalid: expected a number in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed={self.seed!r} is invalid: expected None or an integer")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs={self.logprobs!r} is invalid: expected None or an integer >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one output position: the sampled token's, and the ``logprobs`` most likely
    tokens' as ``(token_id, logprob)`` pairs, most likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
