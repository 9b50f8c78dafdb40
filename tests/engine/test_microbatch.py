"""A step run as several forward passes (``EngineConfig.microbatch_tokens``), and the server streaming each
pass's tokens before the step ends (``reference_engine.serve.engine_process``)."""

from __future__ import annotations

import multiprocessing
import threading
from types import SimpleNamespace

import pytest

from reference_engine import ConfigError, EngineConfig, LLMEngine, SamplingParams
from reference_engine.config import CPU_MICROBATCH_TOKENS
from reference_engine.runner import microbatches
from reference_engine.scheduler import ScheduledChunk
from reference_engine.serve.engine_process import _EngineCore
from tests.engine.engine_steps import core_batches, finished_outputs


def _chunk(name: str, num_tokens: int, completes: bool = True) -> ScheduledChunk:
    return ScheduledChunk(SimpleNamespace(request_id=name), 0, num_tokens, completes)


def _names(passes: list[list[ScheduledChunk]]) -> list[list[str]]:
    return [[c.request.request_id for c in p] for p in passes]


def test_passes_hold_whole_chunks_those_that_sample_first_and_a_long_chunk_alone() -> None:
    chunks = [_chunk("d1", 1), _chunk("d2", 1), _chunk("mid", 300, completes=False), _chunk("a", 200),
              _chunk("b", 200), _chunk("long", 700), _chunk("c", 100)]
    assert _names(microbatches(chunks, 512)) == [["d1", "d2", "a", "b"], ["long"], ["c", "mid"]]
    assert _names(microbatches(chunks, 0)) == [[c.request.request_id for c in chunks]]  # 0: one pass, as scheduled
    assert _names(microbatches(chunks[:2], 512)) == [["d1", "d2"]]  # a step that fits: one pass
    assert microbatches([], 512) == []


def test_the_default_is_512_on_cpu_and_one_pass_on_cuda_and_a_bad_value_names_the_field() -> None:
    assert EngineConfig(model="m").resolve(1024).microbatch_tokens == CPU_MICROBATCH_TOKENS == 512
    assert EngineConfig(model="m", device="cuda").resolve(1024).microbatch_tokens == 0
    assert EngineConfig(model="m", microbatch_tokens=0).resolve(1024).microbatch_tokens == 0
    with pytest.raises(ConfigError) as error:
        EngineConfig(model="m", microbatch_tokens=-1)
    assert error.value.field == "microbatch_tokens"


PASSES = [3, 2, 2, 1, 1, 1, 1, 1]  # requests per pass of the wave's step: 20+25+30 | 35+40 | 45+50 | 55 | ... | 75


def _wave(engine: LLMEngine) -> None:
    """Twelve prompts of 20-75 tokens arriving together (one prefill step of 570 tokens: in passes of at
    most 100, ``PASSES``), greedy and seeded sampling, with logprobs; r4 asks for one token."""
    for i in range(12):
        prompt = [(7 * i + j) % 500 + 3 for j in range(20 + 5 * i)]
        max_tokens = 1 if i == 4 else 6  # r4's first token, sent early, also finishes it
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2) if i % 2 else
                  SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                                 logprobs=2))
        engine.add_request(f"r{i}", prompt, params)


def test_a_step_in_several_passes_gives_the_tokens_and_logprobs_of_one_pass(tiny_ckpt: str) -> None:
    one = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=512, microbatch_tokens=0))
    several = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=512, microbatch_tokens=100))
    passes = []
    run = several.runner._run
    several.runner._run = lambda chunks, block_ids: passes.append(len(chunks)) or run(chunks, block_ids)
    _wave(one)
    _wave(several)
    expected, got = finished_outputs(one), finished_outputs(several)
    assert passes[:len(PASSES)] == PASSES, "the wave's step did not run as passes of <= 100 tokens"
    assert set(got) == set(expected)
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids, rid
        for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_on_sampled_hears_every_pass_but_the_last_before_any_request_changes(tiny_ckpt: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=512, microbatch_tokens=100))
    _wave(engine)
    heard: list[dict[str, int]] = []

    def on_sampled(tokens: dict[str, int]) -> None:
        assert all(not engine.scheduler.requests[rid].output_token_ids for rid in tokens), \
            "a request already holds the token it is told of"
        heard.append(dict(tokens))

    engine.on_sampled = on_sampled
    outputs = {o.request_id: o for o in engine.step().outputs}
    assert [len(tokens) for tokens in heard] == PASSES[:-1], "a pass but the last was not heard of"
    early = {rid: tok for tokens in heard for rid, tok in tokens.items()}
    assert len(early) == 11 and len(outputs) == 12  # the last pass's one request only in the outputs
    assert all(outputs[rid].token_ids == [tok] for rid, tok in early.items())
    heard.clear()
    engine.step()  # eleven decodes: one pass, nothing heard early
    assert heard == []


def test_the_engine_core_sends_each_passes_tokens_before_the_step_ends(tiny_ckpt: str) -> None:
    # The raw batches off the pipe: the wave's first tokens come in several batches, pass by pass, and
    # each request's tokens over all batches are exactly the engine's own.
    reference = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=512, microbatch_tokens=0))
    _wave(reference)
    expected = {rid: out.token_ids for rid, out in finished_outputs(reference).items()}

    engine = LLMEngine(EngineConfig(model=tiny_ckpt, num_gpu_blocks_override=512, microbatch_tokens=100))
    server_end, core_end = multiprocessing.Pipe(duplex=True)
    adds = []
    _wave(SimpleNamespace(add_request=lambda *args: adds.append(args)))
    for request_id, prompt, params in adds:  # all queued before the core's first step
        server_end.send(("add", request_id, prompt, params, 0))
    thread = threading.Thread(target=lambda: _EngineCore(engine, core_end).run(), daemon=True)
    thread.start()
    batches = core_batches(server_end, lambda finished: len(finished) == 12)
    server_end.send(("stop",))
    thread.join(30)

    streamed: dict[str, list[int]] = {}
    first_seen_in: dict[str, int] = {}
    for index, (_, _, _, _, deltas, _, _) in enumerate(batches):
        for request_id, new_ids, done, *_ in deltas:
            assert new_ids or done, f"{request_id}: a delta with no token that finishes nothing"
            if new_ids and request_id not in streamed:
                first_seen_in[request_id] = index
            streamed.setdefault(request_id, []).extend(new_ids)
    assert streamed == expected
    r4 = [(new_ids, done, reason) for b in batches for rid, new_ids, done, reason, *_ in b[4] if rid == "r4"]
    assert r4 == [([expected["r4"][0]], False, None), ([], True, "length")], \
        "a request finished by its early token: the token early, its finish with the step"
    assert len(set(first_seen_in.values())) == len(PASSES), "the wave's first tokens did not leave pass by pass"
    early = [batches[i] for i in sorted(set(first_seen_in.values()))[:-1]]
    assert all(b[3] is None and not b[1] for b in early), "an early batch carried stats or failures"
