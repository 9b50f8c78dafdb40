"""SamplingParams.logprobs: top-k raw log-probabilities per output token, without changing any token."""

from __future__ import annotations

import math

from reference_engine import SamplingParams


def test_logprobs_align_with_tokens_and_leave_outputs_unchanged(make_engine) -> None:
    prompts = [[5, 6, 7, 8], list(range(3, 20)), [9] * 10, [11, 12, 13]]
    plain = make_engine(num_gpu_blocks_override=64).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    # A tiny pool forces recompute preemptions: logprobs must stay aligned with tokens through them.
    engine = make_engine(num_gpu_blocks_override=8, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
    assert engine.counters().preemptions > 0
    for p, o in zip(plain, outs, strict=True):
        assert o.token_ids == p.token_ids
        assert p.logprobs is None and len(o.logprobs) == len(o.token_ids)
        for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
            assert lp.token_id == tok and len(lp.top) == 3
            assert lp.top[0][0] == tok and math.isclose(lp.top[0][1], lp.logprob)  # greedy: top-1
            assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0


def test_sampled_token_logprob_is_reported_even_outside_top_k(make_engine) -> None:
    engine = make_engine(num_gpu_blocks_override=64)
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=5.0, seed=1, logprobs=0))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.top == () and lp.logprob <= 0 for lp in out.logprobs)
