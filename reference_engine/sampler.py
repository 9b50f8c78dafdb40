"""Greedy and seeded temperature / top-k / top-p sampling.

Each sampled token draws from its own generator seeded by ``(request seed, output index)``, so
the k-th token of a request is the same whether the request ran straight through, was
recomputed after preemption or was swapped: no generator state is carried across steps.
"""

from __future__ import annotations

import zlib

import torch

from reference_engine.request import Request
from reference_engine.sampling_params import TokenLogprobs

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space


def request_seed(request: Request, engine_seed: int) -> int:
    """The request's own seed, or one derived from the engine seed and the request id."""
    if request.sampling_params.seed is not None:
        return request.sampling_params.seed
    return (engine_seed << 32) ^ zlib.crc32(request.request_id.encode())


def token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + index) % (1 << 63))
    return g


def sample(logits: torch.Tensor, requests: list[Request], engine_seed: int) -> list[int]:
    """logits: [num_requests, vocab] float32. Returns one token per request."""
    # max(dim).indices, not argmax: the same first index of the maximum (ties included, tested), and on
    # CPU less than half the time for a decode batch's float32 logits (argmax's reduction kernel is the slower one)
    greedy = logits.max(dim=-1).indices
    tokens = greedy.tolist()
    for row, req in enumerate(requests):
        params = req.sampling_params
        if params.greedy:
            continue
        # Shifted so the best score is 0: a tiny temperature then gives -inf, never inf - inf = nan.
        scores = (logits[row] - logits[row].max()) / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # drop a token when the tokens before it already reach top_p (always keep the first)
            drop = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        g = token_generator(request_seed(req, engine_seed), len(req.output_token_ids), logits.device)
        tokens[row] = int(torch.multinomial(probs, 1, generator=g))
    return tokens


def token_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[TokenLogprobs | None]:
    """Per request: the sampled token's log-probability and the top ``sampling_params.logprobs``, or None
    for requests that did not ask. Reads ``logits`` only, so sampling is untouched."""
    wanted = [row for row, req in enumerate(requests) if req.sampling_params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(requests)
    if not wanted:
        return out
    logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)  # [len(wanted), vocab]
    k = min(max(requests[row].sampling_params.logprobs for row in wanted), logprobs.shape[-1])
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen = logprobs.gather(1, torch.tensor([tokens[row] for row in wanted], device=logits.device)[:, None])
    for i, row in enumerate(wanted):
        n = requests[row].sampling_params.logprobs
        top = tuple(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True))
        out[row] = TokenLogprobs(tokens[row], float(chosen[i, 0]), top)
    return out
